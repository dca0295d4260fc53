"""Op family ``moonep::dispatch`` / ``moonep::dispatch_with_plan`` / ``moonep::combine``.

Schema, argument checks, fake kernels, the reference implementation (through the Buffer's
backend) and autograd, together.  The ops take the Buffer's registry name and plain ints, never
a Python object, so they trace under ``torch.compile(fullgraph=True)``.

  dispatch(x [s,H], topk_ids [s,K] i32, route_weights [s,K] f32?, buffer, total_num_tokens)
      -> h [nvs_s,H], w [nvs_s] f32, cu_seqlens [G] i32,
         dst [s*K] i32, experts_to_copy [R,epn] i32, zero_fill_ranges [G,2] i32,
         remote_stats [2] i32                          (the last four: the Plan's tensors)
  dispatch_with_plan(x [s,H], route_weights [s,K] f32?, dst [s*K] i32, buffer, total)
      -> h [nvs_s,H], w [nvs_s] f32                    (scatter with a saved plan)
  combine(h [nvs_s|NvS,H], route_weights [nvs_s|NvS] f32?, dst [s*K] i32, buffer, total)
      -> y [s,H] (h's dtype), w [s,K] f32               (w is zeros when none was given)

total_num_tokens = -1 means every rank passes the same s.  Semantics (moonep.md §4):
  * dispatch writes token t's row to the K slots named by dst (a duplicate entry - same token,
    same destination - is sent once and copied on the destination); route weight w[t,k] to its
    own slot; all other rows/weights of the [nvs_s] layout are exactly zero.
  * combine: y[t] = sum over k = 0..K-1 of h[slot(t,k)], accumulated in fp32 in that order,
    rounded once to h's dtype; it does not apply route weights; w[t,k] = w_nvs[slot(t,k)].
  * autograd: dispatch backward = combine with the saved plan, combine backward = dispatch
    with the saved plan (both are exact transposes, duplicates included).
Every check that reads no data runs in the fake kernel too, so a bad call fails at trace time.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import config
from .buffer import lookup

# No cudagraph_unsafe tag: with the CUDA symmetric-memory backend every op is capturable; the
# host-reading collective backend refuses to run under capture with a clear error instead.
_TAGS = ()

# ---------------------------------------------------------------------------------------------
# Argument checks (shape / dtype / device only: safe in fake kernels, run before any write)
# ---------------------------------------------------------------------------------------------


def _tensor(name: str, t, dtype, ndim: int, buf) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.device.type not in (buf.device.type, "meta"):
        raise ValueError(f"{name} is on {t.device} but the Buffer lives on {buf.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()})")


def check_s(buf, s, total: int) -> None:
    if s < 1 or s > buf.S:
        raise ValueError(f"s={s} tokens is outside [1, S={buf.S}] (the Buffer's capacity)")
    if total != -1 and (total < s or total > buf.R * buf.S):
        raise ValueError(f"total_num_tokens={total} must lie in [s={s}, R*S={buf.R * buf.S}]")


def _check_hidden(name: str, x, buf) -> int:
    _tensor(name, x, buf.dtype, 2, buf)
    if x.shape[1] != buf.H:
        raise ValueError(f"{name} must be [s, H={buf.H}], got {tuple(x.shape)}")
    return x.shape[0]


def _check_route_weights(rw, s, buf) -> None:
    if rw is None:
        return
    _tensor("route_weights [s, K]", rw, torch.float32, 2, buf)
    if rw.shape[0] != s or rw.shape[1] != buf.K:
        raise ValueError(f"route_weights must be [s={s}, K={buf.K}], got {tuple(rw.shape)}")


def _check_dst(dst, s, buf) -> None:
    _tensor("plan.dst [s*K]", dst, torch.int32, 1, buf)
    if dst.shape[0] != s * buf.K:
        raise ValueError(
            f"the plan was made for {dst.shape[0] // buf.K} tokens but this call has s={s} "
            f"tokens: a plan can only be reused with the same number of tokens")


def check_dispatch_args(x, topk, rw, buf, total: int) -> int:
    s = _check_hidden("x [s, H]", x, buf)
    _tensor("topk_ids [s, K]", topk, torch.int32, 2, buf)
    if topk.shape[0] != s or topk.shape[1] != buf.K:
        raise ValueError(f"topk_ids must be [s={s}, K={buf.K}], got {tuple(topk.shape)}")
    _check_route_weights(rw, s, buf)
    check_s(buf, s, total)
    return s


def check_reuse_args(x, rw, dst, buf, total: int) -> int:
    s = _check_hidden("x [s, H]", x, buf)
    _check_route_weights(rw, s, buf)
    check_s(buf, s, total)
    _check_dst(dst, s, buf)
    return s


def check_combine_args(h, w, dst, buf, total: int) -> int:
    _tensor("plan.dst [s*K]", dst, torch.int32, 1, buf)
    if dst.shape[0] % buf.K:
        raise ValueError(f"plan.dst has {dst.shape[0]} entries, not a multiple of K={buf.K}")
    s = dst.shape[0] // buf.K
    check_s(buf, s, total)
    rows = buf.nvs_s(s, total)
    _tensor("h [nvs_s, H]", h, buf.dtype, 2, buf)
    if h.shape[1] != buf.H or (h.shape[0] != rows and h.shape[0] != buf.NvS):
        raise ValueError(
            f"combine expects h of shape [nvs_s={rows} or NvS={buf.NvS}, H={buf.H}] (the rows "
            f"dispatch produced for this plan), got {tuple(h.shape)}")
    if w is not None:
        _tensor("route_weights [nvs_s]", w, torch.float32, 1, buf)
        if w.shape[0] != h.shape[0]:
            raise ValueError(f"route_weights must have h's {h.shape[0]} rows, got {w.shape[0]}")
    return s


def check_dst_values(dst, buf, s: int, total: int) -> None:
    """Data check (CPU / MOONEP_VALIDATE=1): every slot lies inside its destination's rows."""
    if not config.should_validate(dst) or dst.numel() == 0:
        return
    d = dst.long()
    raw = torch.where(d < 0, -d - 1, d)
    if int(raw.max()) >= buf.R * buf.NvS:
        raise ValueError(f"plan.dst names rank {int(raw.max()) // buf.NvS} >= R={buf.R}: the "
                         "plan was not made for this Buffer")
    if int((raw % buf.NvS).max()) >= buf.nvs_s(s, total):
        raise ValueError(f"plan.dst names a row >= nvs_s={buf.nvs_s(s, total)}: the plan was "
                         "made for another token count or Buffer")


# ---------------------------------------------------------------------------------------------
# moonep::dispatch  (gather histograms, plan, scatter)
# ---------------------------------------------------------------------------------------------

_DISPATCH_SCHEMA = ("(Tensor x, Tensor topk_ids, Tensor? route_weights, str buffer, "
                    "int total_num_tokens) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
                    "Tensor)")


@torch.library.custom_op("moonep::dispatch", mutates_args=(), schema=_DISPATCH_SCHEMA, tags=_TAGS)
def _dispatch(x: Tensor, topk_ids: Tensor, route_weights: Optional[Tensor], buffer: str,
              total_num_tokens: int):
    buf = lookup(buffer)
    s = check_dispatch_args(x, topk_ids, route_weights, buf, total_num_tokens)
    be, E = buf.backend, buf.E
    bad = ""
    if config.should_validate(topk_ids):
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= E:
            bad = f"expert ids must lie in [0, E={E}); got values in [{lo}, {hi}]"
    if getattr(be, "device_side", False):
        # Histogram exchange, planning and the other input checks run on the device; bad input
        # sets the Buffer's error word (Buffer.check_errors) instead of a host read.
        if bad:
            raise ValueError(f"moonep dispatch: {bad}")
        return be.dispatch_fresh(buf, x, topk_ids, route_weights, total_num_tokens)
    # One all-gather carries the histogram plus (bad-input flag, s, total) of every rank, so a
    # rank with bad ids makes every rank raise instead of leaving its peers in a collective.
    hist = torch.bincount(topk_ids.reshape(-1).long().clamp(0, E - 1), minlength=E)
    extra = torch.tensor([int(bool(bad)), s, total_num_tokens], dtype=torch.long, device=x.device)
    rows = be.gather_rows(torch.cat([hist, extra]))
    flags, s_R, tot_R = rows[:, E].tolist(), rows[:, E + 1].tolist(), rows[:, E + 2].tolist()
    if bad:
        raise ValueError(f"moonep dispatch: {bad}")
    if any(flags):
        raise ValueError(f"moonep dispatch: rank {flags.index(1)} rejected its input (see that "
                         "rank's error); no rank wrote anything")
    if len(set(tot_R)) != 1:
        raise ValueError(f"total_num_tokens differs across ranks: {tot_R}")
    if total_num_tokens == -1 and len(set(s_R)) != 1:
        raise ValueError(f"ranks pass different s {s_R}; pass total_num_tokens for per-rank s")
    if total_num_tokens != -1 and sum(s_R) != total_num_tokens:
        raise ValueError(f"total_num_tokens={total_num_tokens} but the ranks pass s={s_R} "
                         f"(sum {sum(s_R)})")
    dst, cu, etc, zf, stats = _plan_gathered(rows, topk_ids, buf, be.rank, total_num_tokens)
    h, w = be.scatter(buf, x, route_weights, dst, buf.nvs_s(s, total_num_tokens))
    return h, w, cu, dst, etc, zf, stats


def _plan_gathered(rows_RX: Tensor, topk_ids: Tensor, buf, rank: int, total_num_tokens: int):
    """Plan from the gathered, host-validated [R, E+3] rows (histogram, bad flag, s, total).

    On CUDA with policy "moonep" the device planner (csrc/plan_kernels.cu, two launches, ~40 us
    at R = 8, E = 384) plans from rows_RX as it is; elsewhere the torch planner runs (on CUDA it
    is hundreds of small kernels: ~12 ms at E = 384).  Same plan either way (tests).  The rows
    were validated on the host, so the device planner's error word can only flag an internal
    error; it is read when validation is on (MOONEP_VALIDATE=1)."""
    from . import plan_device
    # Only the device planner writes an error word: no allocation per dispatch off CUDA.
    err = torch.zeros(1, dtype=torch.int32, device=rows_RX.device) if rows_RX.is_cuda else None
    # topk_ids is int32 and contiguous already (check_dispatch_args)
    out, on_device = plan_device.plan_from_rows(rows_RX, topk_ids, rank, buf, total_num_tokens, err)
    if on_device and config.should_validate(err) and int(err.item()) != 0:
        raise RuntimeError(f"moonep dispatch: the device planner flagged error bits "
                           f"{int(err.item()):#x} on host-validated input (a bug)")
    return out


@_dispatch.register_fake
def _dispatch_fake(x, topk_ids, route_weights, buffer, total_num_tokens):
    buf = lookup(buffer)
    s = check_dispatch_args(x, topk_ids, route_weights, buf, total_num_tokens)
    n = buf.nvs_s(s, total_num_tokens)
    i32 = torch.int32
    return (x.new_empty((n, buf.H)), x.new_empty((n,), dtype=torch.float32),
            x.new_empty((buf.G,), dtype=i32), x.new_empty((s * buf.K,), dtype=i32),
            x.new_empty((buf.R, buf.epn), dtype=i32), x.new_empty((buf.G, 2), dtype=i32),
            x.new_empty((2,), dtype=i32))


def _dispatch_setup(ctx, inputs, output):
    _, _, rw, buffer, total = inputs
    ctx.save_for_backward(output[3])
    ctx.buffer, ctx.total, ctx.has_w = buffer, total, rw is not None


def _dispatch_backward(ctx, grad_h, grad_w, *_plan_grads):
    (dst,) = ctx.saved_tensors
    gx, gw = torch.ops.moonep.combine(grad_h.contiguous(),
                                      grad_w.contiguous() if ctx.has_w else None,
                                      dst, ctx.buffer, ctx.total)
    return gx, None, (gw if ctx.has_w else None), None, None


_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)

# ---------------------------------------------------------------------------------------------
# moonep::dispatch_with_plan  (scatter only)
# ---------------------------------------------------------------------------------------------

_REUSE_SCHEMA = ("(Tensor x, Tensor? route_weights, Tensor dst, str buffer, int total_num_tokens)"
                 " -> (Tensor, Tensor)")


@torch.library.custom_op("moonep::dispatch_with_plan", mutates_args=(), schema=_REUSE_SCHEMA,
                         tags=_TAGS)
def _dispatch_with_plan(x: Tensor, route_weights: Optional[Tensor], dst: Tensor, buffer: str,
                        total_num_tokens: int):
    buf = lookup(buffer)
    s = check_reuse_args(x, route_weights, dst, buf, total_num_tokens)
    check_dst_values(dst, buf, s, total_num_tokens)
    return buf.backend.scatter(buf, x, route_weights, dst, buf.nvs_s(s, total_num_tokens))


@_dispatch_with_plan.register_fake
def _dispatch_with_plan_fake(x, route_weights, dst, buffer, total_num_tokens):
    buf = lookup(buffer)
    s = check_reuse_args(x, route_weights, dst, buf, total_num_tokens)
    n = buf.nvs_s(s, total_num_tokens)
    return x.new_empty((n, buf.H)), x.new_empty((n,), dtype=torch.float32)


def _reuse_setup(ctx, inputs, output):
    _, rw, dst, buffer, total = inputs
    ctx.save_for_backward(dst)
    ctx.buffer, ctx.total, ctx.has_w = buffer, total, rw is not None


def _reuse_backward(ctx, grad_h, grad_w):
    (dst,) = ctx.saved_tensors
    gx, gw = torch.ops.moonep.combine(grad_h.contiguous(),
                                      grad_w.contiguous() if ctx.has_w else None,
                                      dst, ctx.buffer, ctx.total)
    return gx, (gw if ctx.has_w else None), None, None, None


_dispatch_with_plan.register_autograd(_reuse_backward, setup_context=_reuse_setup)

# ---------------------------------------------------------------------------------------------
# moonep::combine
# ---------------------------------------------------------------------------------------------

_COMBINE_SCHEMA = ("(Tensor h, Tensor? route_weights, Tensor dst, str buffer, int total_num_tokens)"
                   " -> (Tensor, Tensor)")


@torch.library.custom_op("moonep::combine", mutates_args=(), schema=_COMBINE_SCHEMA, tags=_TAGS)
def _combine(h: Tensor, route_weights: Optional[Tensor], dst: Tensor, buffer: str,
             total_num_tokens: int):
    buf = lookup(buffer)
    s = check_combine_args(h, route_weights, dst, buf, total_num_tokens)
    check_dst_values(dst, buf, s, total_num_tokens)
    y, w = buf.backend.gather(buf, h, route_weights, dst)
    if w is None:
        w = torch.zeros((s, buf.K), dtype=torch.float32, device=h.device)
    return y, w


@_combine.register_fake
def _combine_fake(h, route_weights, dst, buffer, total_num_tokens):
    buf = lookup(buffer)
    s = check_combine_args(h, route_weights, dst, buf, total_num_tokens)
    return h.new_empty((s, buf.H)), h.new_empty((s, buf.K), dtype=torch.float32)


def _combine_setup(ctx, inputs, output):
    h, rw, dst, buffer, total = inputs
    ctx.save_for_backward(dst)
    ctx.buffer, ctx.total, ctx.has_w, ctx.rows = buffer, total, rw is not None, h.shape[0]


def _combine_backward(ctx, grad_y, grad_w):
    (dst,) = ctx.saved_tensors
    gh, gw = torch.ops.moonep.dispatch_with_plan(grad_y.contiguous(),
                                                 grad_w.contiguous() if ctx.has_w else None,
                                                 dst, ctx.buffer, ctx.total)
    pad = ctx.rows - gh.shape[0]                 # h had NvS rows: the tail gets zero gradient
    if pad:
        gh = torch.nn.functional.pad(gh, (0, 0, 0, pad))
        gw = torch.nn.functional.pad(gw, (0, pad))
    return gh, (gw if ctx.has_w else None), None, None, None


_combine.register_autograd(_combine_backward, setup_context=_combine_setup)


