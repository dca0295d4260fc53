"""The torch.distributed backend on CUDA tensors (NCCL, world size 1, backend forced to "torch"
so the all-to-all path runs), checked bitwise against the single-rank CPU path.  Skipped
without a GPU.  Multi-GPU runs: MOONEP_TEST_DIST=nccl python -m pytest tests/test_data_plane.py
-k multi_rank (one GPU per rank)."""
from __future__ import annotations

import pytest
import torch

from moonep_ops.buffer import Buffer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _inputs(s, H, K, E, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, H, generator=g).to(dtype)
    w = torch.rand(s, K, generator=g)
    t = torch.randint(0, E, (s, K), generator=g, dtype=torch.int32)
    t[::3, -1] = t[::3, 0]                                   # duplicates
    return x, w, t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_cpu(nccl_world, dtype):
    S, H, K, E, tp = 64, 256, 4, 8, 8
    gpu = Buffer(S, H, K, E, group=nccl_world, token_padding=tp, dtype=dtype, backend="torch",
                 device="cuda")
    cpu = Buffer(S, H, K, E, token_padding=tp, dtype=dtype, device="cpu")
    for s in (1, 37, S):
        x, w, t = _inputs(s, H, K, E, dtype, seed=s)
        hg, wg, cug, pg = gpu.dispatch(x.cuda(), t.cuda(), w.cuda())
        hc, wc, cuc, pc = cpu.dispatch(x, t, w)
        assert hg.is_cuda and torch.equal(hg.cpu(), hc) and torch.equal(wg.cpu(), wc)
        assert torch.equal(cug.cpu(), cuc) and torch.equal(pg.dst.cpu(), pc.dst)
        z = (hg.float() * 1.5).to(dtype)
        yg, wkg = gpu.combine(pg, z, wg)
        yc, wkc = cpu.combine(pc, z.cpu(), wc)
        assert torch.equal(yg.cpu(), yc) and torch.equal(wkg.cpu(), wkc)
        # autograd on CUDA
        xg = x.cuda().requires_grad_()
        wgr = w.cuda().requires_grad_()
        h, wn, _, p = gpu.dispatch(xg, t.cuda(), wgr)
        y, _ = gpu.combine(p, (h.float() * wn[:, None]).to(dtype))
        y.float().sum().backward()
        xc = x.clone().requires_grad_()
        wcr = w.clone().requires_grad_()
        h, wn, _, p = cpu.dispatch(xc, t, wcr)
        y, _ = cpu.combine(p, (h.float() * wn[:, None]).to(dtype))
        y.float().sum().backward()
        assert torch.equal(xg.grad.cpu(), xc.grad)
        # the route-weight grad goes through torch's own row reduction (h * gy summed over H),
        # whose order differs between CPU and CUDA: close, not bitwise
        torch.testing.assert_close(wgr.grad.cpu(), wcr.grad, rtol=1e-5, atol=1e-5)


def test_torch_backend_plans_on_device(nccl_world, monkeypatch):
    """On CUDA the torch.distributed backend plans with the device planner (not the torch
    planner's hundreds of small kernels), and gets the torch planner's plan."""
    from moonep_ops import planner
    from moonep_ops.planner import device as plan_device      # where the backends' entry looks
    if not planner.device_planner_available():
        pytest.skip("libmoonep_ep.so not built")
    calls = []
    real = plan_device.plan_on_device
    monkeypatch.setattr(plan_device, "plan_on_device",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    S, H, K, E, tp = 64, 32, 4, 8, 8
    gpu = Buffer(S, H, K, E, group=nccl_world, token_padding=tp, dtype=torch.float32,
                 backend="torch", device="cuda")
    for s in (1, 37, S):
        x, w, t = _inputs(s, H, K, E, torch.float32, seed=s)
        t[: s // 2] = 3                                    # a hot expert
        _, _, cu, p = gpu.dispatch(x.cuda(), t.cuda(), w.cuda())
        tpe = torch.bincount(t.reshape(-1).long(), minlength=E).to(torch.int32)[None]
        dst, cur, *_ = torch.ops.moonep.plan(tpe, t, 0, 1, S, tp, -1, "moonep")
        assert torch.equal(p.dst.cpu(), dst) and torch.equal(cu.cpu(), cur)
    assert len(calls) == 3


def test_cuda_prefetch_reduce(nccl_world):
    buf = Buffer(8, 16, 2, 4, group=nccl_world, dtype=torch.float32, backend="torch",
                 device="cuda")
    etc = torch.tensor([[1, -1, 3, 3]], dtype=torch.int32, device="cuda")
    local = torch.randn(4, 8, 4, device="cuda")
    slots = torch.full_like(local, 9.0)
    torch.ops.moonep.prefetch_weight(etc, [local], [slots], buf.name)
    assert torch.equal(slots[0], local[1]) and torch.equal(slots[2], local[3])
    assert torch.equal(slots[3], local[3]) and bool((slots[1] == 9).all())
    g = torch.randn(4, 8, 4, device="cuda")
    sg = torch.randn(4, 8, 4, device="cuda")
    expect = g.clone()
    expect[1] = expect[1] + sg[0]
    expect[3] = (expect[3] + sg[2]) + sg[3]
    before = sg[1].clone()
    torch.ops.moonep.reduce_grad(etc, [g], [sg], buf.name)
    assert torch.equal(g, expect) and torch.equal(sg[1], before)
    assert bool((sg[[0, 2, 3]] == 0).all())


def test_cuda_compile_inductor(nccl_world):
    import torch._dynamo
    from torch._dynamo.utils import counters
    buf = Buffer(32, 128, 2, 4, group=nccl_world, token_padding=4, dtype=torch.bfloat16,
                 backend="torch", device="cuda")
    x, w, t = _inputs(32, 128, 2, 4, torch.bfloat16)
    x, w, t = x.cuda(), w.cuda(), t.cuda()

    def block(x, t, w):
        h, wn, cu, plan = buf.dispatch(x, t, w)
        y, _ = buf.combine(plan, (h.float() * wn[:, None]).to(h.dtype))
        return y

    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(block, fullgraph=True)(x, t, w)
    assert not counters["graph_break"]
    assert torch.equal(got, block(x, t, w))


def test_cuda_opcheck(nccl_world):
    from torch.library import opcheck
    buf = Buffer(8, 16, 2, 4, group=nccl_world, token_padding=2, dtype=torch.float32,
                 backend="torch", device="cuda")
    x, w, t = _inputs(5, 16, 2, 4, torch.float32)
    x, w, t = x.cuda(), w.cuda(), t.cuda()
    ops = torch.ops.moonep
    opcheck(ops.dispatch.default, (x.requires_grad_(), t, w.requires_grad_(), buf.name, -1))
    h, wn, cu, dst, etc, zf, st = ops.dispatch(x.detach(), t, w.detach(), buf.name, -1)
    opcheck(ops.dispatch_with_plan.default, (x, w, dst, buf.name, -1))
    opcheck(ops.combine.default, (h.requires_grad_(), wn.requires_grad_(), dst, buf.name, -1))
    loc = [torch.randn(buf.epn, 3, device="cuda")]
    opcheck(ops.prefetch_weight.default, (etc, loc, [torch.zeros_like(loc[0])], buf.name))
    opcheck(ops.reduce_grad.default, (etc, [loc[0].clone()], [torch.randn_like(loc[0])],
                                      buf.name))
