"""moonep::swiglu / moonep::swiglu_backward on CPU: schema, fake, autograd (the reference path;
the fused kernel is tests/test_swiglu_cuda.py)."""
from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import moonep_ops  # noqa: F401  (registers the ops)
from moonep_ops.ops import swiglu as sw


def _inputs(dtype, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(9, 16, generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]
    if requires_grad:
        t[0].requires_grad_(True)
        t[1].requires_grad_(True)
    return t


def test_swiglu_autograd_matches_torch():
    g, u, _ = _inputs(torch.float64, requires_grad=True)
    a = torch.ops.moonep.swiglu(g, u)
    g2, u2 = g.detach().clone().requires_grad_(True), u.detach().clone().requires_grad_(True)
    a2 = torch.nn.functional.silu(g2) * u2
    torch.testing.assert_close(a, a2)
    da = torch.randn_like(a)
    a.backward(da)
    a2.backward(da)
    torch.testing.assert_close(g.grad, g2.grad)
    torch.testing.assert_close(u.grad, u2.grad)


def test_swiglu_gradcheck():
    g, u, _ = _inputs(torch.float64, requires_grad=True, seed=3)
    assert torch.autograd.gradcheck(torch.ops.moonep.swiglu, (g, u))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_opcheck(dtype):
    g, u, da = _inputs(dtype, seed=5)
    opcheck(torch.ops.moonep.swiglu.default, (g, u))
    opcheck(torch.ops.moonep.swiglu_backward.default, (g, u, da))
    gr, ur, _ = _inputs(dtype, requires_grad=True, seed=5)
    opcheck(torch.ops.moonep.swiglu.default, (gr, ur))


def test_swiglu_backward_recomputes_forward():
    g, u, da = _inputs(torch.bfloat16, seed=7)
    _, _, a = sw.swiglu_backward(g, u, da)
    assert torch.equal(a, sw.swiglu(g, u))


def test_swiglu_bad_shapes():
    g, u, da = _inputs(torch.float32)
    with pytest.raises(ValueError, match="must match"):
        sw.swiglu(g, u[:, :8])
    with pytest.raises(ValueError, match="must match"):
        sw.swiglu_backward(g, u, da[:4])
    with pytest.raises(ValueError, match="must match"):
        torch.ops.moonep.swiglu(g.to("meta"), u[:, :8].to("meta"))
