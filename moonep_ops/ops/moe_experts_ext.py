"""Op family ``moonep::moe_experts_ext`` / ``moonep::moe_experts_ext_backward``: the routed experts
of ``moe_experts.py`` with per-expert biases and a gated activation variant (gpt-oss), the route
weights applied inside (so the down bias is added in that pass, not in one of its own).

    z_MD, g_MF, u_MF, y_MD = moe_experts_ext(h_MD, w_M, cu_G, etc_RB, w1, w3, w2, biases, pool,
                                             activation, alpha, limit)
        prefetch_weight (owners push the weights and the biases into the pool's slots), then
        g = grouped_mm(h, w1), u = grouped_mm(h, w3)                         no bias
        a = glu(g + b1[grp], u + b3[grp])   biases and activation in one pass (ops/swiglu.py)
        y = grouped_mm(a, w2)                                                no bias
        z = dtype((fp32(y) + b2[grp]) * w_M)     the down bias in the route-weight pass
    dh, dw_M, dw1, dw3, dw2, dbiases = moe_experts_ext_backward(dz, h, w_M, g, u, y, ...)
        dy = dtype(fp32(dz) * w_M), dw_M = sum_D fp32(dz) * (fp32(y) + b2[grp])
        then the bf16 op's backward with the gated activation's, and the bias grads: each
        group's row sums of dg, du and dy in fp32, rounded once to the biases' dtype; the slot
        groups' sums land in the pool's gb1, gb3, gb2, and reduce_grad adds them into their
        owners' with the weight grads.  CUDA bf16: summed inside the passes that write dy
        (moonep_ep_bias_scale_rows_bwd) and dg, du (moonep_ep_glu_bwd_bias_grads), in an order
        fixed by the code (csrc/swiglu.cu "Row tiles": run to run bitwise); elsewhere
        ops/swiglu.py ``reference_group_sums``.

``biases``: [] (no biases) or [b1 [B, F] (gate), b3 [B, F] (up), b2 [B, D] (down)], this rank's
home experts' biases in the weights' dtype; grp = a row's group (``cu_seqlens``): home experts
0..B-1, then the slots B..2B-1, whose biases the pool holds.  ``activation``: ops/swiglu.py
ACTIVATIONS, "swiglu" or gpt-oss's "swiglu_clamped" with its alpha and limit (checked before
anything runs: ``check_activation``).  Without biases and with "swiglu" the op computes bitwise
what ``moonep::moe_experts`` and the layer's fp32 route-weight multiply do, so the layer calls
this op only when a variant is on.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import grouped_mm as _gm
from .moe_experts import (ExpertPool, _backend, _call, _check_expert_args, _pool, checked,
                          expert_grads)
from .. import native
from ..runtime import call_on
from .swiglu import (_glu_native_ok, _launch_args, _native_ok, _ptr, _row_bias, check_activation,
                     glu_params, reference_group_sums, rows_group, run_glu, run_glu_backward)
from . import expert_weights as _ew


def check_variant(expert_bias: bool, activation: str, alpha: float, limit: float,
                  fp8_wgrad: bool = False) -> None:
    """A layer's expert options (MoEArgs.expert_bias, activation, swiglu_alpha, swiglu_limit;
    ``fp8_wgrad``: the FP8 wgrads are on): ValueError (TypeError for a non-bool expert_bias)
    before anything is built or runs."""
    if not isinstance(expert_bias, bool):
        raise TypeError(f"MoEArgs.expert_bias must be a bool, got {type(expert_bias).__name__}")
    check_activation(activation, alpha, limit)
    if fp8_wgrad and (expert_bias or activation != "swiglu"):
        raise ValueError(f"fp8_wgrad has no expert biases or activation {activation!r} yet: "
                         "leave it off for this layer")


def check_biases(op: str, biases, pool: ExpertPool, B: int, F: int, D: int, dtype, device
                 ) -> None:
    """``biases``: [] or [b1, b3 [B, F], b2 [B, D]] contiguous, in the weights' dtype, on their
    device, and the pool has bias slots for them."""
    if len(biases) not in (0, 3):
        raise ValueError(f"{op}: biases must be [] or [b1, b3, b2], got {len(biases)}")
    if biases and pool.b1 is None:
        raise ValueError(f"{op}: the pool has no bias slots (ExpertPool.add_bias_slots; "
                         "MoonEPMoE.bind adds them for a layer with expert_bias)")
    for name, b, shape in zip(("b1", "b3", "b2"), biases, ((B, F), (B, F), (B, D))):
        if not isinstance(b, Tensor) or tuple(b.shape) != shape or b.dtype != dtype:
            raise ValueError(f"{op}: bias {name} must be {list(shape)} {dtype} (the weights' B, "
                             f"F, D and dtype), got {getattr(b, 'shape', None)} "
                             f"{getattr(b, 'dtype', None)}")
        if b.device != device or not b.is_contiguous():
            raise ValueError(f"{op}: bias {name} must be contiguous on {device}")


def _check_ext(h, w_M, cu, etc, w1, w3, w2, biases, pool: ExpertPool, activation, alpha, limit,
               values: bool = True, **more) -> None:
    """Every check of both ops, before the pool's slots are written."""
    check_activation(activation, alpha, limit)
    y = more.pop("y", None)
    _check_expert_args(h, cu, etc, w1, w3, w2, pool, values=values, **more)
    B, F, D = w1.shape
    M = h.shape[0]
    if not isinstance(w_M, Tensor) or w_M.dtype != torch.float32 or tuple(w_M.shape) != (M,):
        raise ValueError(f"moe_experts_ext: row_weights must be [M={M}] float32, got "
                         f"{getattr(w_M, 'shape', None)} {getattr(w_M, 'dtype', None)}")
    if w_M.device != h.device:
        raise ValueError(f"moe_experts_ext: row_weights is on {w_M.device}, h on {h.device}")
    check_biases("moe_experts_ext", biases, pool, B, F, D, w1.dtype, h.device)
    if y is not None and (tuple(y.shape) != (M, D) or y.dtype != w1.dtype):
        raise ValueError(f"moe_experts_ext_backward: y must be [{M}, {D}] {w1.dtype}")


def _prefetch(p: ExpertPool, etc: Tensor, w1, w3, w2, biases) -> None:
    local = [w1, w3, w2] + list(biases)
    slots = [p.w1, p.w3, p.w2] + ([p.b1, p.b3, p.b2] if biases else [])
    _call("moonep::prefetch_weight", _backend(p).prefetch_weight, etc,
          [t.detach() for t in local], slots)


def group_biases(p: ExpertPool, biases):
    """[G, F] / [G, D] per-group biases: the home experts', then the slots' (None: no bias)."""
    if not biases:
        return None, None, None
    return tuple(torch.cat([b.detach(), s]) for b, s in zip(biases, (p.b1, p.b3, p.b2)))


def biased_y(y: Tensor, b2_G, cu: Tensor) -> Tensor:
    """fp32(y) + b2[grp] (fp32; y itself when fp32 without bias)."""
    yf = y.float() if y.dtype.itemsize != 4 else y
    return yf if b2_G is None else yf + _row_bias(b2_G, rows_group(cu, y.shape[0]))


def _rows_native(y: Tensor, b2_G, cu: Tensor, *more: Tensor) -> bool:
    bs = [b2_G] if b2_G is not None else []
    return (y.dim() == 2 and y.shape[1] % 8 == 0 and _native_ok(y, *bs, *more)
            and cu.is_contiguous() and cu.device == y.device)


def scale_rows_biased(y: Tensor, b2_G, cu: Tensor, w_M: Tensor) -> Tensor:
    """z = dtype((fp32(y) + b2[grp]) * w_M): the route-weight pass with the down bias; CUDA bf16:
    one kernel (csrc/swiglu.cu moonep_ep_bias_scale_rows, bitwise this formula)."""
    if not _rows_native(y, b2_G, cu) or not w_M.is_contiguous():
        return (biased_y(y, b2_G, cu) * w_M[:, None]).to(y.dtype)
    z = torch.empty_like(y)
    sms, stream = _launch_args(y)
    rc = call_on(y.device, native.ep().ep_bias_scale_rows,
                 y.data_ptr(), _ptr(b2_G), cu.data_ptr(), cu.shape[0], y.shape[1],
                 w_M.data_ptr(), z.data_ptr(), y.shape[0], sms, stream)
    if rc:
        native.ep_check(rc, "moonep bias scale rows")
    return z


def _row_tile_work(M: int, G: int, C: int, num_sums: int, row_dots: bool, device) -> Tensor:
    """The fp32 workspace of the row-tile kernels (csrc/swiglu.cu "Row tiles")."""
    n = native.ep().ep_row_tile_work(M, G, C, num_sums, int(row_dots))
    return torch.empty(n, dtype=torch.float32, device=device)


def scale_rows_biased_backward(dz: Tensor, y: Tensor, b2_G, cu: Tensor, w_M: Tensor
                               ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(dy = dtype(fp32(dz) * w_M), d_rows = sum_D fp32(dz) * (fp32(y) + b2[grp]) fp32, db2):
    db2 [G, D] fp32 each group's row sums of dy with b2 (the down bias's grad, not rounded),
    None without.  CUDA bf16: one pass (moonep_ep_bias_scale_rows_bwd: dy bitwise; d_rows and
    db2 summed in other orders than torch's, fixed ones)."""
    if not _rows_native(y, b2_G, cu, dz) or not w_M.is_contiguous():
        dzf = dz.float()
        dy = (dzf * w_M[:, None]).to(dz.dtype)
        return (dy, (dzf * biased_y(y, b2_G, cu)).sum(dim=1),
                reference_group_sums(dy, cu) if b2_G is not None else None)
    M, D, G = y.shape[0], y.shape[1], cu.shape[0]
    dy = torch.empty_like(dz)
    d_rows = torch.empty(M, dtype=torch.float32, device=dz.device)
    db2 = torch.empty(G, D, dtype=torch.float32, device=dz.device) if b2_G is not None else None
    work = _row_tile_work(M, G, D, int(b2_G is not None), True, dz.device)
    sms, stream = _launch_args(y)
    rc = call_on(y.device, native.ep().ep_bias_scale_rows_bwd,
                 dz.data_ptr(), y.data_ptr(), _ptr(b2_G), cu.data_ptr(), G, D, w_M.data_ptr(),
                 dy.data_ptr(), d_rows.data_ptr(), _ptr(db2), work.data_ptr(), M, sms, stream)
    if rc:
        native.ep_check(rc, "moonep bias scale rows backward")
    return dy, d_rows, db2


def glu_backward_sums(g: Tensor, u: Tensor, da: Tensor, b1_G, b3_G, cu: Tensor, alpha: float,
                      limit: float, offset: float) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """(dg, du, a, sums): the gated variant's backward (ops/swiglu.py ``run_glu_backward``'s
    values) and, with the biases b1_G, b3_G (both or neither), sums = [db1, db3] [G, F] fp32,
    each group's row sums of dg and du (the biases' grads, not rounded); [] without.  CUDA bf16:
    one pass (moonep_ep_glu_bwd_bias_grads: dg, du, a bitwise moonep_ep_glu_bwd's)."""
    if b1_G is None:
        return (*run_glu_backward(g, u, da, None, None, cu, alpha, limit, offset), [])
    if not _glu_native_ok(g, u, b1_G, b3_G, cu, da):
        dg, du, a = run_glu_backward(g, u, da, b1_G, b3_G, cu, alpha, limit, offset)
        return dg, du, a, [reference_group_sums(dg, cu), reference_group_sums(du, cu)]
    M, F, G = g.shape[0], g.shape[1], cu.shape[0]
    dg, du, a = (torch.empty_like(g) for _ in range(3))
    db1, db3 = (torch.empty(G, F, dtype=torch.float32, device=g.device) for _ in range(2))
    work = _row_tile_work(M, G, F, 2, False, g.device)
    sms, stream = _launch_args(g)
    rc = call_on(g.device, native.ep().ep_glu_bwd_bias_grads,
                 g.data_ptr(), u.data_ptr(), da.data_ptr(), b1_G.data_ptr(), b3_G.data_ptr(),
                 cu.data_ptr(), G, F, dg.data_ptr(), du.data_ptr(), a.data_ptr(), db1.data_ptr(),
                 db3.data_ptr(), work.data_ptr(), M, alpha, limit, offset, sms, stream)
    if rc:
        native.ep_check(rc, "moonep glu backward with bias grads")
    return dg, du, a, [db1, db3]


def moe_experts_ext_body(h: Tensor, row_weights: Tensor, cu_seqlens: Tensor,
                         experts_to_copy: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                         biases: list[Tensor], pool: str, activation: str, alpha: float,
                         limit: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    p = _pool(pool)
    checked("moe_experts_ext", p, _check_ext, h, row_weights, cu_seqlens, experts_to_copy, w1,
            w3, w2, biases, p, activation, alpha, limit)
    _prefetch(p, experts_to_copy, w1, w3, w2, biases)
    cu, mm = cu_seqlens, "moonep::grouped_mm"
    b1, b3, b2 = group_biases(p, biases)
    g = _call(mm, _gm.run_fwd, h, w1, p.w1, cu, -1, False)
    u = _call(mm, _gm.run_fwd, h, w3, p.w3, cu, -1, False)
    a = _call("moonep::swiglu", run_glu, g, u, b1, b3, cu, *glu_params(activation, alpha, limit))
    y = _call(mm, _gm.run_fwd, a, w2, p.w2, cu, -1, False)
    return _call("moonep::bias_scale_rows", scale_rows_biased, y, b2, cu, row_weights), g, u, y


_ext = torch.library.custom_op("moonep::moe_experts_ext", moe_experts_ext_body, mutates_args=())


@_ext.register_fake
def _(h, row_weights, cu_seqlens, experts_to_copy, w1, w3, w2, biases, pool, activation, alpha,
      limit):
    p = _pool(pool)
    checked("moe_experts_ext", p, _check_ext, h, row_weights, cu_seqlens, experts_to_copy, w1,
            w3, w2, biases, p, activation, alpha, limit, values=False)
    M, F, D = h.shape[0], w1.shape[1], w2.shape[1]
    return h.new_empty(M, D), h.new_empty(M, F), h.new_empty(M, F), h.new_empty(M, D)


def moe_experts_ext_backward_body(dz: Tensor, h: Tensor, row_weights: Tensor, g: Tensor,
                                  u: Tensor, y: Tensor, cu_seqlens: Tensor,
                                  experts_to_copy: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                                  biases: list[Tensor], pool: str, activation: str, alpha: float,
                                  limit: float, need_dh: bool = True
                                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    p = _pool(pool)
    checked("moe_experts_ext_backward", p, _check_ext, h, row_weights, cu_seqlens,
            experts_to_copy, w1, w3, w2, biases, p, activation, alpha, limit, dy=dz, g=g, u=u,
            y=y)
    _prefetch(p, experts_to_copy, w1, w3, w2, biases)   # slots may hold another layer by now
    cu, B = cu_seqlens, w1.shape[0]
    b1, b3, b2 = group_biases(p, biases)
    dy, dw_M, db2 = _call("moonep::bias_scale_rows_backward", scale_rows_biased_backward,
                          dz.contiguous(), y, b2, cu, row_weights)
    params = glu_params(activation, alpha, limit)
    sums = []                       # [db1, db3] from the activation's backward

    def act_backward(da):
        dg, du, a, s = glu_backward_sums(g, u, da, b1, b3, cu, *params)
        sums.extend(s)
        return dg, du, a

    dh, dg, du, d1, d3, d2 = expert_grads(p, dy, h, cu, w1, w3, w2, act_backward, need_dh)
    local, slots = [d1, d3, d2], [p.g1, p.g3, p.g2]
    dbiases = _call("moonep::bias_grads", bias_grads, p, sums + [db2], B, dy.dtype) \
        if biases else []
    if biases:
        local, slots = local + dbiases, slots + [p.gb1, p.gb3, p.gb2]
    if d1.dtype in _ew.GRAD_DTYPES:
        _call("moonep::reduce_grad", _backend(p).reduce_grad, experts_to_copy, local, slots)
    else:       # the op raises its dtype error, reaching the peers (checks.reject_call)
        torch.ops.moonep.reduce_grad(experts_to_copy, local, slots, p.backend_name)
    return dh, dw_M, d1, d3, d2, dbiases


_ext_backward = torch.library.custom_op("moonep::moe_experts_ext_backward",
                                        moe_experts_ext_backward_body, mutates_args=())


@_ext_backward.register_fake
def _(dz, h, row_weights, g, u, y, cu_seqlens, experts_to_copy, w1, w3, w2, biases, pool,
      activation, alpha, limit, need_dh=True):
    p = _pool(pool)
    checked("moe_experts_ext_backward", p, _check_ext, h, row_weights, cu_seqlens,
            experts_to_copy, w1, w3, w2, biases, p, activation, alpha, limit, values=False,
            dy=dz, g=g, u=u, y=y)
    return (h.new_empty(h.shape if need_dh else (0, h.shape[1])),
            row_weights.new_empty(row_weights.shape),
            w1.new_empty(w1.shape), w3.new_empty(w3.shape), w2.new_empty(w2.shape),
            [b.new_empty(b.shape) for b in biases])


def bias_grads(p: ExpertPool, sums: list[Tensor], B: int, dtype: torch.dtype) -> list[Tensor]:
    """The home experts' bias grads [db1, db3, db2] from ``sums``, the fp32 group sums [G, F],
    [G, F], [G, D] of dg, du, dy, each rounded once to ``dtype``; the slot groups' land in the
    pool's gb1, gb3, gb2.  Every slot row is written: an empty slot group sums to 0, so the slots
    stay zero outside a backward, as reduce_grad expects."""
    out = []
    for s, land in zip(sums, (p.gb1, p.gb3, p.gb2)):
        s = s.to(dtype)
        land.copy_(s[B:])
        out.append(s[:B])                   # (the first rows of a contiguous [G, C])
    return out


def _setup(ctx, inputs, output):
    h, w_M, cu, etc, w1, w3, w2, biases, pool, activation, alpha, limit = inputs
    _, g, u, y = output
    ctx.pool, ctx.act = pool, (activation, alpha, limit)
    ctx.save_for_backward(h, w_M, g, u, y, cu, etc, w1, w3, w2, *biases)
    # g, u, y are outputs for the backward's sake, never differentiated through: their grads
    # stay None instead of three [M, F] / [M, D] zero tensors (one memset pass each) per step
    ctx.set_materialize_grads(False)


def _backward(ctx, dz, _dg, _du, _dy):
    h, w_M, g, u, y, cu, etc, w1, w3, w2, *biases = ctx.saved_tensors
    if dz is None:                             # z unused: every grad is zero
        return (None,) * 7 + ([None] * len(biases),) + (None,) * 4
    need_dh = ctx.needs_input_grad[0]          # h detached (x needs no grad): no dgrad into it
    dh, dw_M, d1, d3, d2, db = torch.ops.moonep.moe_experts_ext_backward(
        dz.contiguous(), h, w_M, g, u, y, cu, etc, w1, w3, w2, biases, ctx.pool, *ctx.act,
        need_dh)
    return (dh if need_dh else None), dw_M, None, None, d1, d3, d2, list(db), None, None, None, \
        None


_ext.register_autograd(_backward, setup_context=_setup)


def moe_experts_ext(h, row_weights, cu_seqlens, experts_to_copy, w1, w3, w2, biases, pool: str,
                    activation: str = "swiglu", alpha: float = 1.0, limit: float = 1.0):
    """``torch.ops.moonep.moe_experts_ext(...)``."""
    return torch.ops.moonep.moe_experts_ext(h, row_weights, cu_seqlens, experts_to_copy, w1, w3,
                                            w2, list(biases), pool, activation, float(alpha),
                                            float(limit))


__all__ = ["moe_experts_ext"]
