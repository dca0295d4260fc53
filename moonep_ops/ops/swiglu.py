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

import math

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


# --------------------------------------------------------------------------------------------
# The gated variant: per-expert biases and gpt-oss's clamped SwiGLU (moonep::moe_experts_ext)
# --------------------------------------------------------------------------------------------
#
#   g' = g + b1[grp(m)], u' = u + b3[grp(m)]           grp(m): row m's group in cu_seqlens_G
#   gc = min(g', limit), uc = clamp(u', -limit, limit)
#   a  = gc * sigmoid(alpha * gc) * (uc + offset)
#
# "swiglu" is alpha = 1, limit = inf, offset = 0 (then, without biases, bitwise ``swiglu``);
# "swiglu_clamped" is gpt-oss's (transformers GptOssExperts._apply_gate): offset 1 and its
# swiglu_alpha / swiglu_limit.  b1, b3 are [G, F] (one row per group: the home experts, then the
# slots), rows past the last group get no bias (nothing reads them).  One pass each way on CUDA
# (csrc/swiglu.cu moonep_ep_glu_*); the reference below has the kernel's operation order.

ACTIVATIONS = ("swiglu", "swiglu_clamped")


def check_activation(activation: str, alpha: float, limit: float) -> None:
    """ValueError for an activation the experts do not implement or invalid parameters."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if activation != "swiglu_clamped":
        return
    for name, v in (("alpha", alpha), ("limit", limit)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"activation 'swiglu_clamped' needs a finite {name} > 0, got {v!r}")


def glu_params(activation: str, alpha: float, limit: float) -> tuple[float, float, float]:
    """(alpha, limit, offset) of the kernel for an activation."""
    if activation == "swiglu":
        return 1.0, math.inf, 0.0
    return float(alpha), float(limit), 1.0


def rows_group(cu_G: Tensor, M: int) -> Tensor:
    """grp(m) for every row: the number of inclusive ends cu_G[g] <= m (G past the last group)."""
    rows = torch.arange(M, device=cu_G.device, dtype=cu_G.dtype)
    return torch.searchsorted(cu_G, rows, right=True)


def reference_group_sums(x_MF: Tensor, cu_G: Tensor) -> Tensor:
    """fp32 [G, F] (fp64 for fp64 x): the sum of each group's rows (the bias grads' reference;
    on CUDA the backward passes sum them as they write the rows, moe_experts_ext.py); rows past
    the last group are not counted.  An fp32 GEMM of the groups' 0/1 row masks."""
    G, M = cu_G.shape[0], x_MF.shape[0]
    grp = rows_group(cu_G, M)
    x = torch.where((grp < G)[:, None], _acc(x_MF), 0.0)
    onehot_GM = (grp[None, :] == torch.arange(G, device=grp.device)[:, None]).to(x.dtype)
    return onehot_GM @ x


def _row_bias(b_GF: Tensor, grp: Tensor) -> Tensor:
    b = _acc(b_GF)
    return torch.cat([b, b.new_zeros(1, b.shape[1])])[grp]


def _glu_inputs(g, u, b1, b3, cu):
    gf, uf = _acc(g), _acc(u)
    if b1 is not None or b3 is not None:
        grp = rows_group(cu, g.shape[0])
        gf = gf + _row_bias(b1, grp) if b1 is not None else gf
        uf = uf + _row_bias(b3, grp) if b3 is not None else uf
    return gf, uf


def glu_fp32(g, u, b1, b3, cu, alpha: float, limit: float, offset: float) -> Tensor:
    """The gated variant's activation in fp32 (fp64 for fp64 inputs), not rounded: what the FP8
    path quantises."""
    gf, uf = _glu_inputs(g, u, b1, b3, cu)
    gc, uc = gf.clamp(max=limit), uf.clamp(-limit, limit)
    return gc * torch.sigmoid(alpha * gc) * (uc + offset)


def reference_glu(g, u, b1, b3, cu, alpha: float, limit: float, offset: float) -> Tensor:
    return glu_fp32(g, u, b1, b3, cu, alpha, limit, offset).to(g.dtype)


def reference_glu_backward(g, u, da, b1, b3, cu, alpha: float, limit: float, offset: float):
    gf, uf = _glu_inputs(g, u, b1, b3, cu)
    gc, uc = gf.clamp(max=limit), uf.clamp(-limit, limit)
    sig = torch.sigmoid(alpha * gc)
    s = gc * sig
    up = uc + offset
    daf = _acc(da)
    dg = torch.where(gf <= limit, daf * up * (sig * (1 + alpha * gc * (1 - sig))), 0.0)
    du = torch.where((uf >= -limit) & (uf <= limit), daf * s, 0.0)
    return dg.to(g.dtype), du.to(g.dtype), (s * up).to(g.dtype)


def _glu_native_ok(g, u, b1, b3, cu, *more) -> bool:
    bs = [b for b in (b1, b3) if b is not None]
    return (g.dim() == 2 and g.shape[1] % 8 == 0 and _native_ok(g, u, *bs, *more)
            and cu.is_contiguous() and cu.device == g.device)


def _ptr(t):
    return t.data_ptr() if t is not None else None


def run_glu(g_MF: Tensor, u_MF: Tensor, b1_GF, b3_GF, cu_G: Tensor, alpha: float, limit: float,
            offset: float) -> Tensor:
    """The gated variant's forward (arguments checked by the caller, moonep::moe_experts_ext)."""
    if not _glu_native_ok(g_MF, u_MF, b1_GF, b3_GF, cu_G):
        return reference_glu(g_MF, u_MF, b1_GF, b3_GF, cu_G, alpha, limit, offset)
    a = torch.empty_like(g_MF)
    sms, stream = _launch_args(g_MF)
    rc = call_on(g_MF.device, native.ep().ep_glu_fwd, g_MF.data_ptr(), u_MF.data_ptr(),
                 _ptr(b1_GF), _ptr(b3_GF), cu_G.data_ptr(), cu_G.shape[0], g_MF.shape[1],
                 a.data_ptr(), g_MF.numel(), alpha, limit, offset, sms, stream)
    if rc:
        native.ep_check(rc, "moonep glu")
    return a


def run_glu_backward(g_MF: Tensor, u_MF: Tensor, da_MF: Tensor, b1_GF, b3_GF, cu_G: Tensor,
                     alpha: float, limit: float, offset: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dg, du, a) of the gated variant (see ``run_glu``)."""
    if not _glu_native_ok(g_MF, u_MF, b1_GF, b3_GF, cu_G, da_MF):
        return reference_glu_backward(g_MF, u_MF, da_MF, b1_GF, b3_GF, cu_G, alpha, limit, offset)
    dg, du, a = (torch.empty_like(g_MF) for _ in range(3))
    sms, stream = _launch_args(g_MF)
    rc = call_on(g_MF.device, native.ep().ep_glu_bwd, g_MF.data_ptr(), u_MF.data_ptr(),
                 da_MF.data_ptr(), _ptr(b1_GF), _ptr(b3_GF), cu_G.data_ptr(), cu_G.shape[0],
                 g_MF.shape[1], dg.data_ptr(), du.data_ptr(), a.data_ptr(), g_MF.numel(), alpha,
                 limit, offset, sms, stream)
    if rc:
        native.ep_check(rc, "moonep glu backward")
    return dg, du, a
