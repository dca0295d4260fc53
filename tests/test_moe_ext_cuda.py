"""The gated SwiGLU kernels (csrc/swiglu.cu moonep_ep_glu_*: expert biases and gpt-oss's clamped
variant in the one elementwise pass) against the torch reference (moonep_ops/ops/swiglu.py), and
the biased, clamped MoE layer on CUDA against the same layer on the CPU.

Kernel: every output element within one bf16 ulp of the reference (the kernel's fp32 exp and
FMA contraction may round differently); swiglu without biases bitwise the plain kernel; rows
past the last group and empty groups included.  The route-weight pass with the down bias
bitwise its torch formula (its backward's row sums to fp32 reassociation).  The bias grads,
summed inside the backward passes (csrc/swiglu.cu "Row tiles"): dg, du, a bitwise the plain
gated backward's and dy bitwise its formula, every row; db1, db3, db2 within fp32 summation
error of an fp64 reference, run to run and for two grid sizes bitwise, on skewed groups (empty
ones, a one-row one, sizes off the 128-row tiles) with NaN rows past the last group that must
not reach them.  Layer (one GPU, bf16, gpt-oss-like options, token padding 128): forward and
every grad close to the CPU reference run on the same weights.
"""
from __future__ import annotations

import pytest
import torch

from moonep_ops import native
from moonep_ops.nn import MoEArgs, MoonEPMoE
from moonep_ops.ops import moe_experts_ext as mx
from moonep_ops.ops import swiglu as sw

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(native.ep() is None, reason="libmoonep_ep.so not loaded"),
]


from test_swiglu_cuda import _close_bf16  # noqa: E402  (one bf16 ulp of the reference)


def _cu(M, G, gen):
    sizes = torch.randint(0, max(2, M // G), (G,), generator=gen)
    sizes[G // 2] = 0                                    # an empty group
    cu = torch.cumsum(sizes, 0).clamp(max=M - 1).to(torch.int32)   # a tail past the last
    return cu.cuda()


@pytest.mark.parametrize("act", ["swiglu", "swiglu_clamped"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M,F,G", [(9, 8, 2), (333, 1024, 8), (4097, 2880, 16)])
def test_glu_kernel_matches_reference(act, bias, M, F, G):
    gen = torch.Generator().manual_seed(M + F + G)
    r = lambda *s: (torch.randn(*s, generator=gen) * 4).to(torch.bfloat16).cuda()
    g, u, da = r(M, F), r(M, F), r(M, F)
    b1, b3 = (r(G, F), r(G, F)) if bias else (None, None)
    cu = _cu(M, G, gen)
    p = sw.glu_params(act, 1.702, 7.0)
    a = sw.run_glu(g, u, b1, b3, cu, *p)
    _close_bf16(a, sw.reference_glu(g, u, b1, b3, cu, *p))
    dg, du, a2 = sw.run_glu_backward(g, u, da, b1, b3, cu, *p)
    rdg, rdu, _ = sw.reference_glu_backward(g, u, da, b1, b3, cu, *p)
    _close_bf16(dg, rdg)
    _close_bf16(du, rdu)
    assert torch.equal(a2, a)
    if act == "swiglu" and not bias:
        assert torch.equal(a, sw.swiglu(g, u))
        assert all(torch.equal(x, y) for x, y in zip((dg, du), sw.swiglu_backward(g, u, da)))


def test_glu_kernel_clamp_edges():
    v = torch.tensor([-1e4, -7.0, -6.99, 0.0, 6.99, 7.0, 7.01, 1e4], dtype=torch.bfloat16)
    g = v[None].repeat(3, 1).cuda()
    u, da = g.flip(1).contiguous(), torch.ones_like(g)
    cu = torch.tensor([1, 3], dtype=torch.int32, device="cuda")
    p = sw.glu_params("swiglu_clamped", 1.702, 7.0)
    _close_bf16(sw.run_glu(g, u, None, None, cu, *p), sw.reference_glu(g, u, None, None, cu, *p))
    got, want = (sw.run_glu_backward(g, u, da, None, None, cu, *p),
                 sw.reference_glu_backward(g, u, da, None, None, cu, *p))
    for x, y in zip(got, want):
        _close_bf16(x, y)
        assert torch.equal(x == 0, y == 0)               # the clamps' masks agree exactly


def _skewed_cu(M, G, gen):
    """cu [G] int32: skewed sizes (cubes of uniforms), group 0 one row, an empty group in the
    middle and the last one empty, and a tail of about M / 10 rows past the last group (M = 0:
    all empty)."""
    if M == 0:
        return torch.zeros(G, dtype=torch.int32, device="cuda")
    sizes = (torch.rand(G, generator=gen) ** 3 * (3 * M / G)).long()
    sizes[0], sizes[G // 2], sizes[-1] = 1, 0, 0
    room = M - M // 10 - 1
    if sizes.sum() > room:
        sizes[1:] = sizes[1:] * (room - 1) // sizes[1:].sum().clamp(min=1)
    return torch.cumsum(sizes, 0).to(torch.int32).cuda()


def _bitwise(x, y):
    return torch.equal(x.view(torch.int16), y.view(torch.int16))     # NaN rows included


def _check_sums(got, x, cu):
    """got [G, C] fp32 against the fp64 group sums of x's rows, within fp32 summation error (a
    relative 2^-24 per add along the kernel's longest chain, ~200 adds, on sum |x|)."""
    want = sw.reference_group_sums(x.double(), cu)
    scale = sw.reference_group_sums(x.double().abs(), cu)
    assert torch.isfinite(got).all()
    assert ((got.double() - want).abs() <= 2e-5 * scale + 1e-30).all()


SUM_SHAPES = [(9, 8, 2), (0, 64, 3), (333, 1024, 8), (4097, 2880, 16), (5000, 64, 300),
              (20011, 40, 3)]


def _glu_bias_grads(g, u, da, b1, b3, cu, p, num_sms):
    """moonep_ep_glu_bwd_bias_grads with a given num_sms (the grid), as glu_backward_sums calls
    it otherwise."""
    M, F, G = g.shape[0], g.shape[1], cu.shape[0]
    dg, du, a = (torch.empty_like(g) for _ in range(3))
    db1, db3 = (torch.empty(G, F, device="cuda") for _ in range(2))
    work = mx._row_tile_work(M, G, F, 2, False, g.device)
    assert native.ep().ep_glu_bwd_bias_grads(
        g.data_ptr(), u.data_ptr(), da.data_ptr(), b1.data_ptr(), b3.data_ptr(), cu.data_ptr(),
        G, F, dg.data_ptr(), du.data_ptr(), a.data_ptr(), db1.data_ptr(), db3.data_ptr(),
        work.data_ptr(), M, *p, num_sms, torch.cuda.current_stream().cuda_stream) == 0
    return dg, du, a, [db1, db3]


@pytest.mark.parametrize("act", ["swiglu", "swiglu_clamped"])
@pytest.mark.parametrize("M,F,G", SUM_SHAPES)
def test_glu_backward_with_bias_grads(act, M, F, G):
    """(20011, 40, 3): a group of ~20k rows (157 tiles) and a column tile with 5 packs of 32;
    (5000, 64, 300): mostly tiny and empty groups; (0, 64, 3): no rows, zero sums."""
    gen = torch.Generator().manual_seed(M + F + G)
    r = lambda *s: (torch.randn(*s, generator=gen) * 4).to(torch.bfloat16).cuda()
    g, u, da = r(M, F), r(M, F), r(M, F)
    b1, b3 = r(G, F), r(G, F)
    cu = _skewed_cu(M, G, gen)
    if G == 3 and M > 0:
        cu = torch.tensor([5, 20000, 20000], dtype=torch.int32, device="cuda")
    for t in (g, u, da):
        t[int(cu[-1]):] = float("nan")                  # unwritten rows past the last group
    p = sw.glu_params(act, 1.702, 7.0)
    dg, du, a, sums = mx.glu_backward_sums(g, u, da, b1, b3, cu, *p)
    for x, y in zip((dg, du, a), sw.run_glu_backward(g, u, da, b1, b3, cu, *p)):
        assert _bitwise(x, y)                           # the plain gated kernel's values
    for s, x in zip(sums, (dg, du)):
        _check_sums(s, x[:int(cu[-1])], cu)
    again = mx.glu_backward_sums(g, u, da, b1, b3, cu, *p)
    other = _glu_bias_grads(g, u, da, b1, b3, cu, p, 1)  # 32 blocks: the tiles grid-stride
    for run in (again, other):
        assert all(_bitwise(x, y) for x, y in zip(run[:3], (dg, du, a)))
        assert all(torch.equal(x, y) for x, y in zip(run[3], sums))


def _route_bwd(dz, y, b2, cu, w, num_sms):
    """moonep_ep_bias_scale_rows_bwd with a given num_sms (the grid)."""
    M, D, G = y.shape[0], y.shape[1], cu.shape[0]
    dy = torch.empty_like(dz)
    d_rows = torch.empty(M, device="cuda")
    db2 = torch.empty(G, D, device="cuda") if b2 is not None else None
    work = mx._row_tile_work(M, G, D, int(b2 is not None), True, dz.device)
    ptr = lambda t: t.data_ptr() if t is not None else None
    assert native.ep().ep_bias_scale_rows_bwd(
        dz.data_ptr(), y.data_ptr(), ptr(b2), cu.data_ptr(), G, D, w.data_ptr(), dy.data_ptr(),
        d_rows.data_ptr(), ptr(db2), work.data_ptr(), M, num_sms,
        torch.cuda.current_stream().cuda_stream) == 0
    return dy, d_rows, db2


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M,D,G", SUM_SHAPES)
def test_route_weight_pass_with_down_bias(bias, M, D, G):
    """moonep_ep_bias_scale_rows (bitwise the torch formula) and its backward: dy bitwise,
    d_rows to fp32 reassociation, db2 (with the bias) as the glu's sums; rows past the last
    group (NaN in the backward) included."""
    gen = torch.Generator().manual_seed(M + D + G)
    y, dz = ((torch.randn(M, D, generator=gen) * 3).bfloat16().cuda() for _ in range(2))
    b2 = (torch.randn(G, D, generator=gen) * 0.5).bfloat16().cuda() if bias else None
    w = torch.rand(M, generator=gen).cuda()
    cu = _skewed_cu(M, G, gen)
    if G == 3 and M > 0:
        cu = torch.tensor([5, 20000, 20000], dtype=torch.int32, device="cuda")
    z = mx.scale_rows_biased(y, b2, cu, w)
    assert torch.equal(z, (mx.biased_y(y, b2, cu) * w[:, None]).to(torch.bfloat16))
    end = int(cu[-1])
    dz[end:] = float("nan")
    dy, d_rows, db2 = mx.scale_rows_biased_backward(dz, y, b2, cu, w)
    dzf = dz.float()
    assert torch.equal(dy[:end], (dzf * w[:, None]).to(torch.bfloat16)[:end])
    assert dy[end:].isnan().all()                       # (NaN encodings may differ from torch's)
    prod = (dzf * mx.biased_y(y, b2, cu))[:end]
    assert ((d_rows[:end] - prod.sum(1)).abs() <= 1e-5 * prod.abs().sum(1) + 1e-6).all()
    assert d_rows[end:].isnan().all()                   # every row's, the tail's too
    assert (db2 is None) == (not bias)
    if bias:
        _check_sums(db2, dy[:end], cu)
    for run in (mx.scale_rows_biased_backward(dz, y, b2, cu, w), _route_bwd(dz, y, b2, cu, w, 1)):
        assert _bitwise(run[0], dy)
        assert torch.equal(run[1][:end], d_rows[:end])
        assert (run[2] is None and db2 is None) or torch.equal(run[2], db2)


def test_layer_cuda_matches_cpu_reference():
    D, F, E, K, S = 256, 384, 8, 4, 512
    args = MoEArgs(num_experts=E, top_k=K, capacity=S, token_padding=128, expert_bias=True,
                   activation="swiglu_clamped", swiglu_alpha=1.702, swiglu_limit=7.0,
                   router_dtype=None, gate_bias=True, topk_before_score=True)
    torch.manual_seed(0)
    cpu = MoonEPMoE(args, D, F, dtype=torch.bfloat16)
    with torch.no_grad():
        for n, p in cpu.named_parameters():
            p.normal_(0.0, 0.3 if n.startswith("b") else 0.05)
    gpu = MoonEPMoE(args, D, F, dtype=torch.bfloat16)
    gpu.load_state_dict(cpu.state_dict())
    cpu.bind(device="cpu")
    gpu.bind(device="cuda")
    try:
        x = torch.randn(S, D).to(torch.bfloat16)
        outs = []
        for layer, dev in ((cpu, "cpu"), (gpu, "cuda")):
            xr = x.detach().to(dev).requires_grad_()   # a fresh leaf on each device
            out = layer(xr)
            out.float().square().sum().backward()
            outs.append((out.float().cpu(), xr.grad.float().cpu(),
                         {n: p.grad.float().cpu() for n, p in layer.named_parameters()}))
        (o1, dx1, g1), (o2, dx2, g2) = outs
        rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))
        assert rel(o2, o1) < 1e-2 and rel(dx2, dx1) < 2e-2
        for n in g1:
            assert rel(g2[n], g1[n]) < 2e-2, n
    finally:
        cpu.buffer.destroy()
        gpu.buffer.destroy()
