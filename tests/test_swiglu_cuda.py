"""The fused SwiGLU kernels (csrc/swiglu.cu) against the torch reference (moonep_ops/ops/swiglu.py).

Every output element is compared with the reference (fresh random inputs, two scales, odd sizes
for the scalar tail, extreme values).  Tolerance: one bf16 ulp (the kernel's fp32 exp may round
differently from torch's sigmoid).
"""
from __future__ import annotations

import pytest
import torch

from moonep_ops import native
from moonep_ops.ops import swiglu as sw

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(native.ep() is None, reason="libmoonep_ep.so not loaded"),
]


def _close_bf16(got, ref):
    """|got - ref| <= 1 bf16 ulp of ref (relative 2^-7), plus a tiny absolute floor."""
    assert torch.isfinite(got).all()
    g, r = got.float(), ref.float()
    tol = r.abs() * 2.0 ** -7 + 1e-6
    bad = (g - r).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} elements off, e.g. {g[bad][:4]} vs {r[bad][:4]}"


@pytest.mark.parametrize("shape", [(1, 8), (7, 24), (333, 1024), (4097, 2056), (5, 3)])
@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_swiglu_matches_reference(shape, scale):
    gen = torch.Generator(device="cuda").manual_seed(hash((shape, scale)) % 2**31)
    r = lambda: (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)
    g, u, da = r(), r(), r()
    g[0, 0] = 0                                     # padding rows are zero: a = dg = du = 0
    u[0, 0] = 0
    a = sw.swiglu(g, u)
    _close_bf16(a, sw.reference_swiglu(g, u))
    dg, du, a2 = sw.swiglu_backward(g, u, da)
    rdg, rdu, ra = sw.reference_swiglu_backward(g, u, da)
    _close_bf16(dg, rdg)
    _close_bf16(du, rdu)
    assert torch.equal(a2, a), "backward's recomputed a differs from the forward's"
    assert a[0, 0] == 0 and dg[0, 0] == 0


def test_swiglu_extreme_values():
    v = torch.tensor([-1e4, -90.0, -20.0, 0.0, 20.0, 90.0, 1e4, 3.0], device="cuda")
    g = v.to(torch.bfloat16)[None].repeat(3, 1)
    u = torch.ones_like(g)
    da = torch.ones_like(g)
    a = sw.swiglu(g, u)
    _close_bf16(a, sw.reference_swiglu(g, u))
    dg, du, _ = sw.swiglu_backward(g, u, da)
    rdg, rdu, _ = sw.reference_swiglu_backward(g, u, da)
    _close_bf16(dg, rdg)
    _close_bf16(du, rdu)


def test_swiglu_unaligned_view_uses_reference():
    base = torch.randn(2 * 8 + 1, device="cuda").to(torch.bfloat16)
    g, u = base[1:9], base[9:17]                  # contiguous, 2-byte offset: not 16-aligned
    assert torch.equal(sw.swiglu(g, u), sw.reference_swiglu(g, u))


def test_swiglu_falls_back_off_contract():
    g = torch.randn(4, 8, device="cuda")            # fp32: the torch reference path
    u = torch.randn(4, 8, device="cuda")
    assert torch.equal(sw.swiglu(g, u), sw.reference_swiglu(g, u))
    with pytest.raises(ValueError, match="must match"):
        sw.swiglu(g, u[:, :4])
