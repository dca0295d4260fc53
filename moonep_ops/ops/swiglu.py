"""SwiGLU of the routed experts: the elementwise part of ``moonep::moe_experts`` and its backward.

    a_MF                = bf16(silu(g_MF) * u_MF)                      silu(x) = x * sigmoid(x)
    dg_MF, du_MF, a_MF  = swiglu_backward(g_MF, u_MF, da_MF)           (a recomputed, not saved)

Ops: ``moonep::swiglu(g, u) -> a`` (differentiable in g and u, fake kernel, opcheck-tested) and
``moonep::swiglu_backward(g, u, da) -> (dg, du, a)``; ``moe_experts`` calls the Python functions
directly (it is one custom op already), the all-to-all baseline uses the op.

M rows of the dispatched token buffer (padding rows included: there g = u = 0, so a = 0 and, with
da = 0 there, dg = du = 0), F the expert FFN dim.  All math in fp32, one rounding per output.

Backends, from device and dtype only (no host sync):
  CUDA bf16 contiguous, libmoonep_ep.so loaded -> one fused kernel each way (csrc/swiglu.cu):
      6 bytes per element forward, 12 backward, against ~38 / ~90 for the unfused torch ops
      (every fp32 temporary is a full [M, F] pass, and inside the opaque moe_experts custom op
      torch.compile cannot fuse them);
  anything else -> the torch reference below (same formulas, same operation order).
Kernel and reference agree to within one bf16 ulp (fp32 ``exp`` rounding), not bitwise;
tests/test_swiglu_cuda.py checks it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import native
from ..runtime import call_on, current_raw_stream, sm_count


def _native_ok(*ts: Tensor) -> bool:
    t0 = ts[0]
    if not t0.is_cuda:
        return False
    dev = t0.device
    for t in ts:
        # 16-byte loads: base pointers must be 16-byte aligned (a contiguous view may not be).
        if (t.dtype != torch.bfloat16 or not t.is_contiguous() or t.device != dev
                or t.data_ptr() % 16):
            return False
    return native.ep() is not None


def _launch_args(t: Tensor):
    return sm_count(t.device), current_raw_stream(t.device)


def _acc(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))     # fp32 (fp64 stays fp64)


def reference_swiglu(g: Tensor, u: Tensor) -> Tensor:
    gf = _acc(g)
    return (gf * torch.sigmoid(gf)).mul_(_acc(u)).to(g.dtype)


def reference_swiglu_backward(g: Tensor, u: Tensor, da: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    gf, uf, daf = _acc(g), _acc(u), _acc(da)
    sig = torch.sigmoid(gf)
    s = gf * sig
    a = (s * uf).to(g.dtype)
    dg = (daf * uf * (sig * (1 + gf * (1 - sig)))).to(g.dtype)
    du = (daf * s).to(g.dtype)
    return dg, du, a


def _check_inputs(op: str, **named: Tensor) -> None:
    """Tensors of one floating dtype, on one device, of one shape (the op, its fake kernel and
    the Python functions run it; the reference would truncate integer inputs and compute mixed
    inputs in the first one's dtype)."""
    for n, t in named.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {n} must be a Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{op}: {n} must be a floating tensor, got {t.dtype}")
    (n0, t0), *rest = named.items()
    for n, t in rest:
        if t.dtype != t0.dtype:
            raise TypeError(f"{op}: {n} is {t.dtype} but {n0} is {t0.dtype}: all inputs must "
                            "share one dtype")
        if t.device != t0.device:
            raise ValueError(f"{op}: {n} is on {t.device} but {n0} on {t0.device}")
    shapes = {n: tuple(t.shape) for n, t in named.items()}
    first = shapes[n0]
    if any(sh != first for sh in shapes.values()):          # (SymInts: compare, don't hash)
        raise ValueError(f"{op}: " + ", ".join(f"{n} {s}" for n, s in shapes.items())
                         + " must match")


def swiglu(g_MF: Tensor, u_MF: Tensor) -> Tensor:
    _check_inputs("swiglu", g=g_MF, u=u_MF)
    return run_swiglu(g_MF, u_MF)


def swiglu_backward(g_MF: Tensor, u_MF: Tensor, da_MF: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dg, du, a) from the forward's inputs and the grad of its output."""
    _check_inputs("swiglu_backward", g=g_MF, u=u_MF, da=da_MF)
    return run_swiglu_backward(g_MF, u_MF, da_MF)


def run_swiglu(g_MF: Tensor, u_MF: Tensor) -> Tensor:
    """``swiglu`` after its checks: callers whose g and u are the same shape and dtype by
    construction (moonep::moe_experts, whose GEMMs made them)."""
    if not _native_ok(g_MF, u_MF):
        return reference_swiglu(g_MF, u_MF)
    a = torch.empty_like(g_MF)
    sms, stream = _launch_args(g_MF)
    rc = call_on(g_MF.device, native.ep().ep_swiglu_fwd, g_MF.data_ptr(), u_MF.data_ptr(),
                 a.data_ptr(), g_MF.numel(), sms, stream)
    if rc:
        native.ep_check(rc, "moonep swiglu")
    return a


def run_swiglu_backward(g_MF: Tensor, u_MF: Tensor, da_MF: Tensor
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """``swiglu_backward`` after its checks (see ``run_swiglu``)."""
    if not _native_ok(g_MF, u_MF, da_MF):
        return reference_swiglu_backward(g_MF, u_MF, da_MF)
    dg, du, a = (torch.empty_like(g_MF) for _ in range(3))
    sms, stream = _launch_args(g_MF)
    rc = call_on(g_MF.device, native.ep().ep_swiglu_bwd, g_MF.data_ptr(), u_MF.data_ptr(),
                 da_MF.data_ptr(), dg.data_ptr(), du.data_ptr(), a.data_ptr(), g_MF.numel(), sms,
                 stream)
    if rc:
        native.ep_check(rc, "moonep swiglu backward")
    return dg, du, a


# --------------------------------------------------------------------------------------------
# Custom ops (schema + fake + autograd here; the kernel is csrc/swiglu.cu)
# --------------------------------------------------------------------------------------------

@torch.library.custom_op("moonep::swiglu", mutates_args=())
def _swiglu_op(g: Tensor, u: Tensor) -> Tensor:
    return swiglu(g, u)


@_swiglu_op.register_fake
def _(g, u):
    _check_inputs("swiglu", g=g, u=u)
    return torch.empty_like(g)


@torch.library.custom_op("moonep::swiglu_backward", mutates_args=())
def _swiglu_backward_op(g: Tensor, u: Tensor, da: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return swiglu_backward(g, u, da)


@_swiglu_backward_op.register_fake
def _(g, u, da):
    _check_inputs("swiglu_backward", g=g, u=u, da=da)
    return torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, da):
    g, u = ctx.saved_tensors
    dg, du, _ = torch.ops.moonep.swiglu_backward(g, u, da.contiguous())
    return dg, du


_swiglu_op.register_autograd(_backward, setup_context=_setup)
