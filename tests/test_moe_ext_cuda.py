"""The gated SwiGLU kernels (csrc/swiglu.cu moonep_ep_glu_*: expert biases and gpt-oss's clamped
variant in the one elementwise pass) against the torch reference (moonep_ops/ops/swiglu.py), and
the biased, clamped MoE layer on CUDA against the same layer on the CPU.

Kernel: every output element within one bf16 ulp of the reference (the kernel's fp32 exp and
FMA contraction may round differently); swiglu without biases bitwise the plain kernel; rows
past the last group and empty groups included.  The route-weight pass with the down bias
bitwise its torch formula (its backward's row sums and the bias-grad group sums to fp32
reassociation, the latter run-to-run bitwise).  Layer (one GPU, bf16, gpt-oss-like options,
token padding 128): forward and every grad close to the CPU reference run on the same weights.
"""
from __future__ import annotations

import pytest
import torch

from moonep_ops import native
from moonep_ops.nn import MoEArgs, MoonEPMoE
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


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M,D,G", [(9, 8, 2), (4097, 2880, 16)])
def test_route_weight_pass_with_down_bias(bias, M, D, G):
    """moonep_ep_bias_scale_rows (bitwise the torch formula) and its backward (dy bitwise,
    d_rows to fp32 reassociation), rows past the last group included."""
    from moonep_ops.ops import moe_experts_ext as mx
    gen = torch.Generator().manual_seed(M + D)
    y, dz = ((torch.randn(M, D, generator=gen) * 3).bfloat16().cuda() for _ in range(2))
    b2 = (torch.randn(G, D, generator=gen) * 0.5).bfloat16().cuda() if bias else None
    w = torch.rand(M, generator=gen).cuda()
    cu = _cu(M, G, gen)
    z = mx.scale_rows_biased(y, b2, cu, w)
    assert torch.equal(z, (mx.biased_y(y, b2, cu) * w[:, None]).to(torch.bfloat16))
    dy, d_rows = mx.scale_rows_biased_backward(dz, y, b2, cu, w)
    dzf = dz.float()
    assert torch.equal(dy, (dzf * w[:, None]).to(torch.bfloat16))
    prod = dzf * mx.biased_y(y, b2, cu)
    assert ((d_rows - prod.sum(1)).abs() <= 1e-5 * prod.abs().sum(1) + 1e-6).all()


@pytest.mark.parametrize("M,C,G", [(9, 8, 2), (4097, 2880, 16), (5000, 64, 32), (20011, 40, 3)])
def test_group_sums_kernel(M, C, G):
    """(20011, 40, 3): a group of ~20k rows (hundreds of rows per row lane) and a last column
    tile with one pack of its four."""
    gen = torch.Generator().manual_seed(C + G)
    x = (torch.randn(M, C, generator=gen) * 2).bfloat16().cuda()
    cu = _cu(M, G, gen)
    if G == 3:
        cu = torch.tensor([5, 20000, 20000], dtype=torch.int32, device="cuda")
    x[int(cu[-1]):] = float("nan")                       # unwritten tail rows are not read
    got = sw.group_sums(x, cu)
    want = sw.reference_group_sums(x, cu)
    scale = sw.reference_group_sums(x.abs(), cu)
    assert torch.isfinite(got).all() and ((got - want).abs() <= 1e-5 * scale + 1e-6).all()
    assert torch.equal(sw.group_sums(x, cu), got)        # a fixed order: run to run bitwise


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
