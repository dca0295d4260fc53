"""Op family ``moonep::dispatch`` / ``moonep::dispatch_with_plan`` / ``moonep::combine``.

Schema, argument checks, fake kernels, the reference implementation (through the Buffer's
backend) and autograd, together.  The ops take the Buffer's registry name and plain ints, never
a Python object, so they trace under ``torch.compile(fullgraph=True)``.

  dispatch(x [s,D], topk_ids [s,K] i32, route_weights [s,K] f32?, buffer, total_num_tokens)
      -> h [nvs_s,D], w [nvs_s] f32, cu_seqlens [G] i32,
         dst [s*K] i32, experts_to_copy [R,epn] i32, zero_fill_ranges [G,2] i32,
         remote_stats [2] i32                          (the last four: the Plan's tensors)
  dispatch_with_plan(x [s,D], route_weights [s,K] f32?, dst [s*K] i32, buffer, total)
      -> h [nvs_s,D], w [nvs_s] f32                    (scatter with a saved plan)
  combine(h [nvs_s|NvS,D], route_weights [nvs_s|NvS] f32?, dst [s*K] i32, buffer, total,
          weighted=False)
      -> y [s,D] (h's dtype), w [s,K] f32               (w is zeros when none was given)
  dispatch_fp8(x [s,D], topk_ids, route_weights?, buffer, total, pow2_scales=False)
      -> h [nvs_s,D] e4m3, h_scale [nvs_s,ceil(D/128)] f32, w, cu_seqlens, dst,
         experts_to_copy, zero_fill_ranges, remote_stats
      x is quantised once on this rank (1 x 128 tiles, moonep_ops/ops/quantize_fp8.py) and the
      e4m3 rows travel with their scales (D + 4*ceil(D/128) bytes a row instead of
      D*sizeof(dtype)) into the layout dispatch would give: same plan, same slots; padding rows
      and their scales are zero.  Needs a backend with ``supports_fp8_dispatch``.  Not
      differentiable (the FP8 expert op routes the gradient: moonep_ops/ops/moe_experts_fp8.py);
      combine stays in the Buffer's dtype with fp32 accumulation.

total_num_tokens = -1 means every rank passes the same s.  Semantics (moonep.md §4):
  * dispatch writes token t's row to the K slots named by dst (a duplicate entry - same token,
    same destination - is sent once and copied on the destination); route weight w[t,k] to its
    own slot; all other rows/weights of the [nvs_s] layout are exactly zero.
  * combine: y[t] = sum over k = 0..K-1 of h[slot(t,k)], accumulated in fp32 (fp64 for fp64
    h) in that order, rounded once to h's dtype; w[t,k] = w_nvs[slot(t,k)].  weighted=True
    (route_weights required) applies the route weights: the terms are h[slot] * w_nvs[slot],
    each product in the accumulation type (the MoE layer's route-weight step).
  * autograd: dispatch backward = combine with the saved plan, combine backward = dispatch
    with the saved plan (both are exact transposes, duplicates included); weighted combine
    backward = dispatch with the saved plan, then the grads of the rows' weighting
    (moonep::scale_rows_backward for bf16: dh = bf16(w * dy rows), dw = sum_D fp32(h) * dy).
Every check that reads no data runs in the fake kernel too, so a bad call fails at trace time.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import registry, runtime
from ..backends.base import Backend
from ..planner import decode_raw_dst
from . import fastpath
from . import quantize_fp8 as qf  # moonep::scale_rows_backward, the weighted combine's grads
from .checks import (ARG_ERRORS, call_device, device_error, has_real_tensor, mark_passed,
                     on_device, passed, reject_call, signature)
from .quantize_fp8 import FP8ArgumentError, fake_rows_fp8, fp8_checks, rows_fp8


def _backend(name: str) -> Backend:
    return registry.lookup(name, Backend)

# No cudagraph_unsafe tag: with the CUDA symmetric-memory backend every op is capturable; the
# host-reading collective backend refuses to run under capture with a clear error instead.
_TAGS = ()

# ---------------------------------------------------------------------------------------------
# Argument checks (shape / dtype / device only: safe in fake kernels, run before any write)
# ---------------------------------------------------------------------------------------------


def _tensor(name: str, t, dtype, ndim: int, be, dev=None, first: str = "x") -> None:
    """One tensor argument.  ``dev``: the call's device (checks.call_device from the call's
    ``first`` tensor: the Buffer's, or meta for a shape-only call); a meta tensor among real
    ones is refused here (the dispatcher sends such a call to the fake kernel)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    dev = be.device if dev is None else dev
    if not on_device(t, dev):
        raise ValueError(device_error(name, t, dev, be.device, first))
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()})")


def check_s(be, s, total: int) -> None:
    if s < 1 or s > be.spec.S:
        raise ValueError(f"s={s} tokens is outside [1, S={be.spec.S}] (the Buffer's capacity)")
    if total != -1 and (total < s or total > be.spec.R * be.spec.S):
        raise ValueError(f"total_num_tokens={total} must lie in [s={s}, R*S={be.spec.R * be.spec.S}]")


def _check_hidden(name: str, x, be, dev) -> int:
    _tensor(name, x, be.spec.dtype, 2, be, dev)
    if x.shape[1] != be.spec.D:
        raise ValueError(f"{name} must be [s, D={be.spec.D}], got {tuple(x.shape)}")
    return x.shape[0]


def _check_route_weights(rw, s, be, dev) -> None:
    if rw is None:
        return
    _tensor("route_weights [s, K]", rw, torch.float32, 2, be, dev)
    if rw.shape[0] != s or rw.shape[1] != be.spec.K:
        raise ValueError(f"route_weights must be [s={s}, K={be.spec.K}], got {tuple(rw.shape)}")


def _check_dst(dst, s, be, dev) -> None:
    _tensor("plan.dst [s*K]", dst, torch.int32, 1, be, dev)
    if dst.shape[0] != s * be.spec.K:
        raise ValueError(
            f"the plan was made for {dst.shape[0] // be.spec.K} tokens but this call has s={s} "
            f"tokens: a plan can only be reused with the same number of tokens")


def check_dispatch_args(be, x, topk, rw, total: int) -> int:
    dev = call_device(x, be.device)
    s = _check_hidden("x [s, D]", x, be, dev)
    _tensor("topk_ids [s, K]", topk, torch.int32, 2, be, dev)
    if topk.shape[0] != s or topk.shape[1] != be.spec.K:
        raise ValueError(f"topk_ids must be [s={s}, K={be.spec.K}], got {tuple(topk.shape)}")
    _check_route_weights(rw, s, be, dev)
    check_s(be, s, total)
    return s


def check_reuse_args(be, x, rw, dst, total: int) -> int:
    dev = call_device(x, be.device)
    s = _check_hidden("x [s, D]", x, be, dev)
    _check_route_weights(rw, s, be, dev)
    check_s(be, s, total)
    _check_dst(dst, s, be, dev)
    return s


def check_combine_args(be, h, w, dst, total: int, weighted: bool = False) -> int:
    if not isinstance(weighted, bool):        # the schema would coerce an int silently
        raise TypeError(f"combine: weighted must be a bool, got {type(weighted).__name__}")
    if weighted and w is None:
        raise ValueError("combine: weighted=True applies the route weights: pass them "
                         "(route_weights [nvs_s] fp32, dispatch's w)")
    dev = call_device(h, be.device)
    _tensor("plan.dst [s*K]", dst, torch.int32, 1, be, dev, "h")
    if dst.shape[0] % be.spec.K:
        raise ValueError(f"plan.dst has {dst.shape[0]} entries, not a multiple of K={be.spec.K}")
    s = dst.shape[0] // be.spec.K
    check_s(be, s, total)
    rows = be.spec.nvs_s(s, total)
    _tensor("h [nvs_s, D]", h, be.spec.dtype, 2, be, dev, "h")
    if h.shape[1] != be.spec.D or (h.shape[0] != rows and h.shape[0] != be.spec.NvS):
        raise ValueError(
            f"combine expects h of shape [nvs_s={rows} or NvS={be.spec.NvS}, D={be.spec.D}] (the rows "
            f"dispatch produced for this plan), got {tuple(h.shape)}")
    if w is not None:
        _tensor("route_weights [nvs_s]", w, torch.float32, 1, be, dev, "h")
        if w.shape[0] != h.shape[0]:
            raise ValueError(f"route_weights must have h's {h.shape[0]} rows, got {w.shape[0]}")
    return s


def _call_signature(op: str, buffer: str, total, *tensors, flag=None) -> Optional[tuple]:
    """checks.signature of a Buffer op's call, for its static checks (once per signature): the
    op, the Buffer (a registry name is never reused; its backend and spec are fixed), total and
    its type, ``flag`` (combine's weighted) and its type, which tensors are absent
    (route_weights None), and the others, all of which the checks require contiguous."""
    present = [t for t in tensors if t is not None]
    return signature((op, buffer, total, type(total), flag, type(flag),
                      *(t is None for t in tensors)), present, present)


def check_dst_values(dst, be, s: int, total: int) -> None:
    """Data check (real kernels; CPU / MOONEP_VALIDATE=1): every slot lies inside its
    destination's rows."""
    if not runtime.should_validate(dst) or dst.numel() == 0:
        return
    raw = decode_raw_dst(dst)
    if int(raw.max()) >= be.spec.R * be.spec.NvS:
        raise ValueError(f"plan.dst names rank {int(raw.max()) // be.spec.NvS} >= R={be.spec.R}: the "
                         "plan was not made for this Buffer")
    if int((raw % be.spec.NvS).max()) >= be.spec.nvs_s(s, total):
        raise ValueError(f"plan.dst names a row >= nvs_s={be.spec.nvs_s(s, total)}: the plan was "
                         "made for another token count or Buffer")


def _fake_checked(buffer: str, op: str, check, *args):
    """(the Buffer's backend ``be``, ``check(be, *args)``): a fake kernel's argument checks (a
    real kernel makes the same try inline: no wrapper call on the eager hot path).  A fake
    kernel on real tensors is an eager call that a meta tensor routed here (the dispatcher
    prefers the Meta kernel): its error reaches the peers as the real kernel's would
    (checks.reject_call)."""
    be = _backend(buffer)
    try:
        return be, check(be, *args)
    except ARG_ERRORS as e:
        raise reject_call(be, op, op, e, eager=has_real_tensor(*args)) from None


# ---------------------------------------------------------------------------------------------
# moonep::dispatch  (gather histograms, plan, scatter)
# ---------------------------------------------------------------------------------------------


def dispatch_body(x: Tensor, topk_ids: Tensor, route_weights: Optional[Tensor], buffer: str,
                  total_num_tokens: int):
    """moonep::dispatch's kernel (every device; the backend does the work)."""
    be = _backend(buffer)
    try:
        key = _call_signature("dispatch", buffer, total_num_tokens, x, topk_ids, route_weights)
        if not passed(key):
            check_dispatch_args(be, x, topk_ids, route_weights, total_num_tokens)
            mark_passed(key)
    except ARG_ERRORS as e:
        raise reject_call(be, "dispatch", "dispatch", e) from None
    return tuple(be.dispatch(x, topk_ids, route_weights, total_num_tokens,
                             _id_values(topk_ids, be)))


_dispatch = torch.library.custom_op(
    "moonep::dispatch", dispatch_body, mutates_args=(), tags=_TAGS,
    schema="(Tensor x, Tensor topk_ids, Tensor? route_weights, str buffer, int total_num_tokens)"
           " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


def _id_values(topk_ids, be) -> str:
    """The value check of the expert ids (MOONEP_VALIDATE): '' or the backend's reject reason
    (it travels with the histogram, so every rank raises)."""
    if runtime.should_validate(topk_ids):
        E = be.spec.E
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= E:
            return f"expert ids must lie in [0, E={E}); got values in [{lo}, {hi}]"
    return ""


@_dispatch.register_fake
def _dispatch_fake(x, topk_ids, route_weights, buffer, total_num_tokens):
    be, s = _fake_checked(buffer, "dispatch", check_dispatch_args, x, topk_ids, route_weights,
                          total_num_tokens)
    n = be.spec.nvs_s(s, total_num_tokens)
    i32 = torch.int32
    return (x.new_empty((n, be.spec.D)), x.new_empty((n,), dtype=torch.float32),
            x.new_empty((be.spec.G,), dtype=i32), x.new_empty((s * be.spec.K,), dtype=i32),
            x.new_empty((be.spec.R, be.spec.epn), dtype=i32), x.new_empty((be.spec.G, 2), dtype=i32),
            x.new_empty((2,), dtype=i32))


def _save_plan(ctx, dst, rw, buffer: str, total: int, rw_at: int, *more: Tensor) -> None:
    """What the backward of dispatch, dispatch_with_plan and combine keeps: the plan's dst (it
    runs the transpose with it), the Buffer, the token total and route_weights' input position
    (None: no route weights); ``more`` tensors are saved after dst."""
    ctx.save_for_backward(dst, *more)
    ctx.buffer, ctx.total, ctx.rw_at = buffer, total, None if rw is None else rw_at


def _scatter_backward(ctx, grad_h, grad_w, *_plan_grads):
    """The backward of dispatch and dispatch_with_plan: combine with the saved plan, their
    exact transpose; x's grad, and route_weights' at its position."""
    (dst,) = ctx.saved_tensors
    has_w = ctx.rw_at is not None
    gx, gw = combine(grad_h.contiguous(), grad_w.contiguous() if has_w else None, dst,
                     ctx.buffer, ctx.total)
    grads = [gx, None, None, None, None]
    if has_w:
        grads[ctx.rw_at] = gw
    return tuple(grads)


def _dispatch_setup(ctx, inputs, output):
    _, _, rw, buffer, total = inputs
    _save_plan(ctx, output[3], rw, buffer, total, 2)


_DispatchFn = fastpath.autograd(_dispatch, "DispatchFn", dispatch_body, _dispatch_setup,
                                _scatter_backward)


def dispatch(x, topk_ids, route_weights, buffer: str, total_num_tokens: int):
    """``torch.ops.moonep.dispatch(...)``; in eager mode without the dispatcher (fastpath)."""
    return fastpath.call(torch.ops.moonep.dispatch, dispatch_body, _DispatchFn, x, topk_ids,
                         route_weights, buffer, total_num_tokens)

# ---------------------------------------------------------------------------------------------
# moonep::dispatch_with_plan  (scatter only)
# ---------------------------------------------------------------------------------------------


def dispatch_with_plan_body(x: Tensor, route_weights: Optional[Tensor], dst: Tensor, buffer: str,
                            total_num_tokens: int):
    """moonep::dispatch_with_plan's kernel."""
    be = _backend(buffer)
    try:
        key = _call_signature("dispatch_with_plan", buffer, total_num_tokens, x, route_weights,
                              dst)
        if not passed(key):
            check_reuse_args(be, x, route_weights, dst, total_num_tokens)
            mark_passed(key)
        s = x.shape[0]
        check_dst_values(dst, be, s, total_num_tokens)
    except ARG_ERRORS as e:
        raise reject_call(be, "dispatch_with_plan", "dispatch_with_plan", e) from None
    return be.dispatch_with_plan(x, route_weights, dst, be.spec.nvs_s(s, total_num_tokens))


_dispatch_with_plan = torch.library.custom_op(
    "moonep::dispatch_with_plan", dispatch_with_plan_body, mutates_args=(), tags=_TAGS,
    schema="(Tensor x, Tensor? route_weights, Tensor dst, str buffer, int total_num_tokens)"
           " -> (Tensor, Tensor)")


@_dispatch_with_plan.register_fake
def _dispatch_with_plan_fake(x, route_weights, dst, buffer, total_num_tokens):
    be, s = _fake_checked(buffer, "dispatch_with_plan", check_reuse_args, x, route_weights, dst,
                          total_num_tokens)
    n = be.spec.nvs_s(s, total_num_tokens)
    return x.new_empty((n, be.spec.D)), x.new_empty((n,), dtype=torch.float32)


def _reuse_setup(ctx, inputs, output):
    _, rw, dst, buffer, total = inputs
    _save_plan(ctx, dst, rw, buffer, total, 1)


_ReuseFn = fastpath.autograd(_dispatch_with_plan, "DispatchWithPlanFn", dispatch_with_plan_body,
                             _reuse_setup, _scatter_backward)


def dispatch_with_plan(x, route_weights, dst, buffer: str, total_num_tokens: int):
    """``torch.ops.moonep.dispatch_with_plan(...)``; in eager mode without the dispatcher."""
    return fastpath.call(torch.ops.moonep.dispatch_with_plan, dispatch_with_plan_body, _ReuseFn,
                         x, route_weights, dst, buffer, total_num_tokens)

# ---------------------------------------------------------------------------------------------
# moonep::combine
# ---------------------------------------------------------------------------------------------


def combine_body(h: Tensor, route_weights: Optional[Tensor], dst: Tensor, buffer: str,
                 total_num_tokens: int, weighted: bool = False):
    """moonep::combine's kernel."""
    be = _backend(buffer)
    try:
        key = _call_signature("combine", buffer, total_num_tokens, h, route_weights, dst,
                              flag=weighted)
        if not passed(key):
            check_combine_args(be, h, route_weights, dst, total_num_tokens, weighted)
            mark_passed(key)
        s = dst.shape[0] // be.spec.K
        check_dst_values(dst, be, s, total_num_tokens)
    except ARG_ERRORS as e:
        raise reject_call(be, "combine", "combine", e) from None
    y, w = be.combine(h, route_weights, dst, weighted)
    if w is None:
        w = torch.zeros((s, be.spec.K), dtype=torch.float32, device=h.device)
    return y, w


_combine = torch.library.custom_op(
    "moonep::combine", combine_body, mutates_args=(), tags=_TAGS,
    schema="(Tensor h, Tensor? route_weights, Tensor dst, str buffer, int total_num_tokens, "
           "bool weighted=False) -> (Tensor, Tensor)")


@_combine.register_fake
def _combine_fake(h, route_weights, dst, buffer, total_num_tokens, weighted=False):
    be, s = _fake_checked(buffer, "combine", check_combine_args, h, route_weights, dst,
                          total_num_tokens, weighted)
    return h.new_empty((s, be.spec.D)), h.new_empty((s, be.spec.K), dtype=torch.float32)


def _combine_setup(ctx, inputs, output):
    h, rw, dst, buffer, total, ctx.weighted = inputs     # (the op's default filled in)
    # weighted: the weighting's backward reads the rows and their weights too
    _save_plan(ctx, dst, rw, buffer, total, 1, *((h, rw) if ctx.weighted else ()))
    ctx.rows = h.shape[0]


def _weighting_backward(dz: Tensor, w: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """The grads (of h, of w) of the terms acc(h) * w of a weighted combine, given dz, the
    gathered grad of y: moonep::scale_rows_backward for bf16 (the layer's dtype: one pass),
    else its formula in h's accumulation type (fp32; fp64 for fp64 rows), which that op,
    bf16 only, does not take."""
    if h.dtype == torch.bfloat16:
        return fastpath.call(torch.ops.moonep.scale_rows_backward,
                             qf._scale_rows_backward_bf16_impl, None, dz, w, h)
    dza = dz.to(torch.promote_types(h.dtype, torch.float32))
    return (dza * w.to(dza.dtype)[:, None]).to(h.dtype), (dza * h.to(dza.dtype)).sum(-1).float()


def _combine_backward(ctx, grad_y, grad_w):
    dst, *hw = ctx.saved_tensors           # (read once: activation checkpointing's contract)
    has_w = ctx.rw_at is not None
    gh, gw = dispatch_with_plan(grad_y.contiguous(), grad_w.contiguous() if has_w else None,
                                dst, ctx.buffer, ctx.total)
    if ctx.weighted:                       # y = sum of h * w: then the weighting's grads
        h, w = hw
        n = gh.shape[0]
        gh, d_rows = _weighting_backward(gh, w[:n], h[:n])
        gw = gw + d_rows
    pad = ctx.rows - gh.shape[0]                 # h had NvS rows: the tail gets zero gradient
    if pad:
        gh = torch.nn.functional.pad(gh, (0, 0, 0, pad))
        gw = torch.nn.functional.pad(gw, (0, pad))
    return gh, (gw if has_w else None), None, None, None, None


_CombineFn = fastpath.autograd(_combine, "CombineFn", combine_body, _combine_setup,
                               _combine_backward)


def combine(h, route_weights, dst, buffer: str, total_num_tokens: int, weighted: bool = False):
    """``torch.ops.moonep.combine(...)``; in eager mode without the dispatcher (fastpath)."""
    return fastpath.call(torch.ops.moonep.combine, combine_body, _CombineFn, h, route_weights,
                         dst, buffer, total_num_tokens, weighted)


# ---------------------------------------------------------------------------------------------
# moonep::dispatch_fp8  (quantise once on the source rank, rows + scales travel together)
# ---------------------------------------------------------------------------------------------


def check_fp8_dispatch(be, pow2_scales) -> None:
    """The capability and the flag (the shared dispatch checks run first)."""
    if not isinstance(pow2_scales, bool):
        raise FP8ArgumentError(f"dispatch_fp8: pow2_scales must be a bool, got {type(pow2_scales).__name__}")
    if not be.supports_fp8_dispatch:
        raise NotImplementedError(
            f"dispatch_fp8: the Buffer's backend {type(be).__name__} does not declare the "
            "capability supports_fp8_dispatch (moonep_ops/backends/base.py)")


@fp8_checks
def check_dispatch_fp8_args(be, x, topk, rw, total, pow2_scales) -> int:
    """dispatch's checks, then the FP8 ones; every bad argument is a ValueError
    (FP8ArgumentError, also a TypeError for a wrong type or dtype) raised before any work."""
    s = check_dispatch_args(be, x, topk, rw, total)
    check_fp8_dispatch(be, pow2_scales)
    return s


@torch.library.custom_op(
    "moonep::dispatch_fp8", mutates_args=(), tags=_TAGS,
    schema="(Tensor x, Tensor topk_ids, Tensor? route_weights, str buffer, int total_num_tokens, "
           "bool pow2_scales=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
           "Tensor)")
def _dispatch_fp8(x: Tensor, topk_ids: Tensor, route_weights: Optional[Tensor], buffer: str,
                  total_num_tokens: int, pow2_scales: bool = False):
    be = _backend(buffer)
    try:
        check_dispatch_fp8_args(be, x, topk_ids, route_weights, total_num_tokens, pow2_scales)
    except ARG_ERRORS as e:
        raise reject_call(be, "dispatch_fp8", "dispatch_fp8", e) from None
    reject = _id_values(topk_ids, be)
    xq, xs = rows_fp8(x, pow2_scales)
    return tuple(be.dispatch_fp8(xq, xs, topk_ids, route_weights, total_num_tokens, reject,
                                 pow2_scales=pow2_scales))


@_dispatch_fp8.register_fake
def _dispatch_fp8_fake(x, topk_ids, route_weights, buffer, total_num_tokens, pow2_scales=False):
    be, s = _fake_checked(buffer, "dispatch_fp8", check_dispatch_fp8_args, x, topk_ids,
                          route_weights, total_num_tokens, pow2_scales)
    n = be.spec.nvs_s(s, total_num_tokens)
    D, i32 = be.spec.D, torch.int32
    return (*fake_rows_fp8(x, n, D), x.new_empty((n,), dtype=torch.float32),
            x.new_empty((be.spec.G,), dtype=i32), x.new_empty((s * be.spec.K,), dtype=i32),
            x.new_empty((be.spec.R, be.spec.epn), dtype=i32), x.new_empty((be.spec.G, 2), dtype=i32),
            x.new_empty((2,), dtype=i32))
