"""Op family ``moonep::moe_experts_fp8`` / ``moonep::moe_experts_fp8_backward``: the routed SwiGLU
experts of one rank in FP8 (the DeepSeek-V3 recipe), fed by ``moonep::dispatch_fp8``.

    z_MD, y_MD, g_MF, u_MF = moe_experts_fp8(h_MD e4m3, h_scale_MC, w_M, cu_G, etc_RB,
                                             w1, w3, w2, pool, x_sD, route_weights_sK, dst_N,
                                             total_num_tokens, pow2_scales)
      the home weights are quantised per 128 x 128 block (e4m3 + fp32 scales) and pushed into
      the pool's FP8 slots (prefetch_weight moves the e4m3 weights and their scales: 3*D*F +
      12*ceil(D/128)*ceil(F/128) bytes an expert instead of 6*D*F in bf16), then
        g = grouped_mm_fp8(h, w1),  u = grouped_mm_fp8(h, w3)           bf16 out
        a = swiglu_quantize_fp8(g, u)       silu(g) * u in fp32, straight to e4m3 1 x 128 tiles
        y = grouped_mm_fp8(a, w2)                                         bf16 out
        z = bf16(fp32(y) * w_M)              the route weight of each row (the bf16 layer's
                                             multiply, moved inside the op)
    backward (moe_experts_fp8_backward, one op like the bf16 one):
        the home weights quantised straight into the transposed layout (quantize_fp8_blocks
        transpose=True: w1^T, w3^T [B, D, F], w2^T [B, F, D], bitwise q(W)^T) and prefetched
        into the pool's slots viewed transposed (ExpertPool.slot_weights(transposed=True));
        each dgrad dy @ W_g is then the forward GEMM on W^T (K-major, no e4m3 transpose):
        dy = bf16(dz * w_M), dw_M = sum_D fp32(dz) * fp32(y)
        da = grouped_mm_fp8(q(dy), w2^T)       dy per 1 x 128 tile along D
        dg, du, a = swiglu_backward(g, u, da)  (a recomputed in bf16, as in the bf16 path)
        dh = grouped_mm_fp8(q(dg), w1^T) + grouped_mm_fp8(q(du), w3^T)
        wgrad in the weights' dtype, fp32 accumulation (grouped_mm_wgrad_into):
          dw1 = dg^T h_bf16, dw3 = du^T h_bf16   h_bf16 = bf16(h * h_scale): the dispatched rows
                                                 themselves (the bf16 rows never leave their
                                                 source rank in the FP8 path)
          dw2 = dy^T a                           a: the bf16 SwiGLU output (kept precision)
        reduce_grad of the slot grads (as the bf16 op), then
        (dx_sD, d_route_weights_sK) = combine(dh, dw_M, dst): dispatch's transpose, in the
        Buffer's dtype with fp32 accumulation.
      So quantisation is straight-through: the gradient of x and of the route weights is that
      of the bf16 layer evaluated at the FP8 forward's values.
    weight_cache (the registry name of an FP8WeightCache, ops/fp8_weight_cache.py; "" for
      none): the home experts' quantisation of both layouts is read from the cache instead of
      computed (it is recomputed there only when the parameters changed), so micro-batches
      between two optimizer steps quantise no weight.
    fp8_wgrad=True (the backward): the three wgrads in FP8 too (DeepSeek-V3's Wgrad), both
      operands quantised along each group's tokens (quantize_fp8_tokens.py) and multiplied by
      moonep::grouped_mm_fp8_wgrad_into (bf16 out, fp32 accumulation):
        q(dy) rows + tokens, d_rows = scale_rows_backward_fp8_tokens(dz, w_M, y)  (one read)
        q(dg), q(du) rows + tokens = quantize_fp8_rows_tokens(dg / du)           (one read each)
        h tokens = quantize_fp8_tokens(h, h_scale)   from the dispatched e4m3 rows, in fp32
        a tokens = quantize_fp8_tokens(a)            the recomputed bf16 SwiGLU output
        dw1 = dg^T h, dw3 = du^T h, dw2 = dy^T a     FP8 x FP8, per group over its tokens
      (no bf16 dy and no dequantised h_bf16 are made).  The bf16 wgrads above stay the
      default of the op (fp8_wgrad=False); the layer's MoEArgs choose.
    Elementwise passes fused (quantize_fp8.py's ops, one Triton kernel each on CUDA, bitwise
    the torch formulation written above; the torch formulation itself elsewhere):
      z                    moonep::scale_rows(y, w_M)
      dy, q(dy), dw_M      moonep::scale_rows_backward_fp8(dz, w_M, y)  (dw_M summed in the
                           kernel: the [M, D] fp32 products never reach memory)
      h_bf16               moonep::dequantize_fp8_rows(h, h_scale)

Why one node carries dispatch's transpose: the rows reach the experts as e4m3 tensors, and an
e4m3 tensor cannot carry a bf16 gradient through autograd (the engine casts a gradient to its
tensor's dtype).  So ``moonep::dispatch_fp8`` is not differentiable, and this op takes the
source rank's ``x_sD`` and ``route_weights_sK`` (read by nothing but autograd) plus the plan's
``dst_N``, and returns their gradients from its backward's combine.

Shapes (docs/architecture.md, "Shape legend"): h [M, D] e4m3, h_scale [M, ceil(D/128)] fp32,
w_M [M] fp32, w1, w3 [B, F, D], w2 [B, D, F] bf16 (the layer's weights), x [s, D] bf16,
route_weights [s, K] fp32, dst [s*K] int32; D and F multiples of 16 (grouped_mm_fp8).  The
pool is the Buffer's precision "fp8" ExpertPool (``Buffer.expert_pool(D, F, torch.bfloat16,
"fp8")``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import registry
from ..backends.base import Backend
from . import dispatch as _dispatch  # noqa: F401  (registers moonep::combine)
from . import expert_weights as _ew  # noqa: F401  (registers moonep::prefetch_weight, reduce_grad)
from . import grouped_mm as _gm
from . import grouped_mm_fp8 as g8
from . import grouped_mm_fp8_wgrad as _gw  # noqa: F401  (registers the FP8 wgrad ops)
from . import quantize_fp8 as qf
from . import quantize_fp8_tokens as _qt  # noqa: F401  (registers the token quantisers)
from .fp8_weight_cache import FP8WeightCache
from .checks import call_device, check_no_overlap, device_error, on_device
from .moe_experts import ExpertPool, check_expert_weights, checked
from .moe_experts_ext import (bias_grads, check_biases, glu_backward_sums, group_biases,
                              scale_rows_biased, scale_rows_biased_backward)
from .swiglu import check_activation, glu_fp32, glu_params, swiglu_backward

DTYPE = torch.bfloat16        # the recipe's activations, outputs and weights

__all__ = ["quantised_weights"]


def _pool(name: str) -> ExpertPool:
    return registry.lookup(name, ExpertPool)


def quantised_weights(w1: Tensor, w3: Tensor, w2: Tensor, pow2: bool,
                      transpose: bool = False) -> list[Tensor]:
    """[w1q, s1, w3q, s3, w2q, s2]: the home experts per 128 x 128 block (prefetch's order);
    transpose: those of w1^T, w3^T [B, D, F] and w2^T [B, F, D], scale grids transposed (one
    pass over each bf16 weight, quantize_fp8.py)."""
    out = []
    for w in (w1, w3, w2):
        out += list(qf.blocks_fp8(w.detach(), pow2, transpose))
    return out


def _home_weights(cache: str, w1: Tensor, w3: Tensor, w2: Tensor, pow2: bool,
                  transpose: bool = False) -> list[Tensor]:
    """The home experts' quantisation: from the layer's FP8WeightCache (fresh by its version
    keys, ops/fp8_weight_cache.py) when it has one, else computed now."""
    if cache:
        return registry.lookup(cache, FP8WeightCache).weights(w1, w3, w2, transpose)
    return quantised_weights(w1, w3, w2, pow2, transpose)


def _check_cache(op: str, cache, B: int, F: int, D: int, pow2: bool, device) -> None:
    if not isinstance(cache, str):
        raise qf.FP8ArgumentError(f"{op}: weight_cache must be a str (a cache's name, or \"\")")
    if not cache:
        return
    c = registry.lookup(cache, FP8WeightCache)
    if (c.B, c.F, c.D) != (B, F, D):
        raise ValueError(f"{op}: the weight cache holds B={c.B}, F={c.F}, D={c.D}; the weights "
                         f"are B={B}, F={F}, D={D}")
    if c.pow2_scales != pow2:
        raise ValueError(f"{op}: the weight cache quantises with pow2_scales={c.pow2_scales}, "
                         f"the call passes {pow2}")
    if device.type != "meta" and c.q1.device != device:
        raise ValueError(f"{op}: the weight cache is on {c.q1.device}, the weights on {device}")


@qf.fp8_checks
def _check(op: str, pool: ExpertPool, h, hs, wM, cu, etc, w1, w3, w2, pow2, values=True,
           x=None, rw=None, dst=None, total=None, cache="", fp8_wgrad=False, biases=None,
           activation="swiglu", alpha=1.0, limit=1.0, **more) -> tuple[int, int, int, int]:
    """Every check of the two ops, before the first write (the pool's slots) and the first
    collective (prefetch_weight).  Returns (B, F, D, M)."""
    if pool.precision != "fp8":
        raise ValueError(f"{op}: the pool holds {pool.precision} slots; this op needs the "
                         "Buffer's fp8 pool (Buffer.expert_pool(D, F, dtype, precision='fp8'))")
    named_t = dict(h_scale=hs, row_weights=wM, cu_seqlens=cu, experts_to_copy=etc, w1=w1,
                   w3=w3, w2=w2, **more)
    if x is not None:
        named_t.update(x=x, route_weights=rw)
    if dst is not None:                  # the backward's too: combine reads it
        named_t["dst"] = dst
    for name, t in named_t.items():
        if not isinstance(t, Tensor):
            raise qf.FP8ArgumentError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
    if not isinstance(pow2, bool):
        raise qf.FP8ArgumentError(f"{op}: pow2_scales must be a bool, got {type(pow2).__name__}")
    for name in ("w1", "w3", "w2"):
        t = named_t[name]
        if t.dim() != 3:
            raise ValueError(f"{op}: {name} must be 3-D, got {tuple(t.shape)}")
        if t.dtype != DTYPE:
            raise qf.FP8ArgumentError(f"{op}: {name} must be {DTYPE} (the FP8 recipe's weights), got "
                            f"{t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (got strides {t.stride()})")
    B, F, D = check_expert_weights(w1, w3, w2, pool, f"{op}: ")
    g8._check_align(op, F, D, names=("F", "D"))
    if not isinstance(fp8_wgrad, bool):
        raise qf.FP8ArgumentError(f"{op}: fp8_wgrad must be a bool, got {type(fp8_wgrad).__name__}")
    _check_cache(op, cache, B, F, D, pow2, w1.device)
    M, _ = qf.check_rows_fp8(op, "h", h, hs, cols=D)
    if wM.dtype != torch.float32 or tuple(wM.shape) != (M,):
        raise ValueError(f"{op}: row_weights must be [M={M}] float32, got {list(wM.shape)} "
                         f"{wM.dtype}")
    want = {"dz": (M, D), "y": (M, D), "g": (M, F), "u": (M, F)}
    for name, t in more.items():
        if tuple(t.shape) != want[name] or t.dtype != DTYPE:
            raise ValueError(f"{op}: {name} must be {list(want[name])} {DTYPE}, got "
                             f"{list(t.shape)} {t.dtype}")
    be = registry.lookup(pool.backend_name, Backend)
    R, K = be.spec.R, be.spec.K
    if etc.dtype != torch.int32 or tuple(etc.shape) != (R, B):
        raise ValueError(f"{op}: experts_to_copy must be int32 [R={R}, epn={B}], got "
                         f"{list(etc.shape)} {etc.dtype}")
    if dst is not None and (dst.dtype != torch.int32 or dst.dim() != 1 or dst.shape[0] % K):
        raise ValueError(f"{op}: dst must be int32 [s*K] (the plan's), got {list(dst.shape)} "
                         f"{dst.dtype}")
    if x is not None:
        s = dst.shape[0] // K
        if x.dim() != 2 or tuple(x.shape) != (s, D) or x.dtype != be.spec.dtype:
            raise ValueError(f"{op}: x must be the source tokens [s={s}, D={D}] "
                             f"{be.spec.dtype}, got {list(x.shape)} {x.dtype}")
        if rw.dtype != torch.float32 or tuple(rw.shape) != (s, K):
            raise ValueError(f"{op}: route_weights must be [s={s}, K={K}] float32, got "
                             f"{list(rw.shape)} {rw.dtype}")
    if be.spec.dtype != DTYPE:
        raise qf.FP8ArgumentError(f"{op}: the Buffer's dtype is {be.spec.dtype}; the FP8 path combines "
                        f"in {DTYPE}")
    if total is not None and not isinstance(total, (int, torch.SymInt)):
        raise qf.FP8ArgumentError(f"{op}: total_num_tokens must be an int")
    dev = call_device(h, pool.w1.device)       # the pool's, or meta for a shape-only call
    for name, t in list(named_t.items()) + [("h", h)]:
        if not on_device(t, dev):
            raise ValueError(f"{op}: " + device_error(name, t, dev, pool.w1.device, "h"))
        if name in ("experts_to_copy", "cu_seqlens", "row_weights", "dst") \
                and not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (got strides {t.stride()})")
    _gm._check_cu(cu, 2 * B, M, h.device, values)
    check_activation(activation, alpha, limit)
    check_biases(op, biases or [], pool, B, F, D, DTYPE, h.device)
    if fp8_wgrad and (biases or activation != "swiglu"):
        raise ValueError(f"{op}: fp8_wgrad has no expert biases or activation {activation!r} yet")
    if values:
        check_no_overlap(op, pool.named_tensors(), list(named_t.items()) + [("h", h)])
    return B, F, D, M


def _prefetch(pool: ExpertPool, etc: Tensor, local: list[Tensor], transposed: bool = False,
              biases=None) -> list[Tensor]:
    """Push the quantised home experts (and their biases, in their own dtype, into the pool's
    bias slots) into the pool's slots and return the weight slots as filled; transposed:
    ``local`` holds the transposed layout and lands in the slots viewed the same way
    (pool.slot_weights)."""
    slots = pool.slot_weights(transposed)
    extra = [pool.b1, pool.b3, pool.b2] if biases else []
    torch.ops.moonep.prefetch_weight(etc, local + [b.detach() for b in biases or []],
                                     slots + extra, pool.backend_name)
    return slots


_TAGS = ()   # capturable when the Buffer's backend is (as moe_experts)

# expert biases [b1, b3, b2] (bf16, added in fp32) and the gated activation (ops/swiglu.py),
# as moonep::moe_experts_ext; off by default (the fused SwiGLU-quantise and scale-rows passes)
_VARIANT = (", Tensor[]? biases=None, str activation=\"swiglu\", float alpha=1.0, "
            "float limit=1.0")
_FWD_SCHEMA = ("(Tensor h, Tensor h_scale, Tensor row_weights, Tensor cu_seqlens, "
               "Tensor experts_to_copy, Tensor w1, Tensor w3, Tensor w2, str pool, Tensor x, "
               "Tensor route_weights, Tensor dst, int total_num_tokens, bool pow2_scales=False, "
               "str weight_cache=\"\", bool fp8_wgrad=False" + _VARIANT + ") -> (Tensor, Tensor, "
               "Tensor, Tensor)")
_BWD_SCHEMA = ("(Tensor dz, Tensor h, Tensor h_scale, Tensor row_weights, Tensor y, Tensor g, "
               "Tensor u, Tensor cu_seqlens, Tensor experts_to_copy, Tensor w1, Tensor w3, "
               "Tensor w2, str pool, Tensor dst, int total_num_tokens, bool pow2_scales=False, "
               "str weight_cache=\"\", bool fp8_wgrad=False" + _VARIANT + ", bool need_dx=True)"
               " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor[])")


@torch.library.custom_op("moonep::moe_experts_fp8", mutates_args=(), schema=_FWD_SCHEMA,
                         tags=_TAGS)
def _moe_experts_fp8(h, h_scale, row_weights, cu_seqlens, experts_to_copy, w1, w3, w2, pool, x,
                     route_weights, dst, total_num_tokens, pow2_scales=False, weight_cache="",
                     fp8_wgrad=False, biases=None, activation="swiglu", alpha=1.0, limit=1.0):
    p = _pool(pool)
    checked("moe_experts_fp8", p, _check, "moe_experts_fp8", p, h, h_scale, row_weights,
            cu_seqlens, experts_to_copy, w1, w3, w2, pow2_scales, x=x, rw=route_weights, dst=dst,
            total=total_num_tokens, cache=weight_cache, fp8_wgrad=fp8_wgrad, biases=biases,
            activation=activation, alpha=alpha, limit=limit)
    q1, s1, q3, s3, q2, s2 = _home_weights(weight_cache, w1, w3, w2, pow2_scales)
    _prefetch(p, experts_to_copy, [q1, s1, q3, s3, q2, s2], biases=biases)
    cu = cu_seqlens
    mm = torch.ops.moonep.grouped_mm_fp8
    # zero_tail=False: nothing reads the rows past cu[-1] (combine gathers the plan's rows)
    g = mm(h, h_scale, q1, s1, p.w1, p.s1, cu, False)
    u = mm(h, h_scale, q3, s3, p.w3, p.s3, cu, False)
    if biases or activation != "swiglu":
        # the gated variant: biases added and the activation taken in fp32, quantised from
        # fp32 like swiglu_quantize_fp8 (torch passes, not fused yet)
        b1, b3, b2 = group_biases(p, biases)
        a32 = glu_fp32(g, u, b1, b3, cu, *glu_params(activation, alpha, limit))
        aq, as_ = qf.quantize_rows_from_fp32(a32, pow2_scales)
        y = mm(aq, as_, q2, s2, p.w2, p.s2, cu, False)
        return scale_rows_biased(y, b2, cu, row_weights), y, g, u   # b2 in the fp32 epilogue
    aq, as_ = torch.ops.moonep.swiglu_quantize_fp8(g, u, pow2_scales)
    y = mm(aq, as_, q2, s2, p.w2, p.s2, cu, False)
    z = torch.ops.moonep.scale_rows(y, row_weights)     # bf16(fp32(y) * w_M), one pass
    return z, y, g, u


@_moe_experts_fp8.register_fake
def _(h, h_scale, row_weights, cu_seqlens, experts_to_copy, w1, w3, w2, pool, x, route_weights,
      dst, total_num_tokens, pow2_scales=False, weight_cache="", fp8_wgrad=False, biases=None,
      activation="swiglu", alpha=1.0, limit=1.0):
    p = _pool(pool)
    B, F, D, M = checked("moe_experts_fp8", p, _check, "moe_experts_fp8", p, h, h_scale,
                         row_weights, cu_seqlens, experts_to_copy, w1, w3, w2, pow2_scales,
                         values=False, x=x, rw=route_weights, dst=dst, total=total_num_tokens,
                         cache=weight_cache, fp8_wgrad=fp8_wgrad, biases=biases,
                         activation=activation, alpha=alpha, limit=limit)
    return (w1.new_empty((M, D)), w1.new_empty((M, D)), w1.new_empty((M, F)),
            w1.new_empty((M, F)))


@torch.library.custom_op("moonep::moe_experts_fp8_backward", mutates_args=(), schema=_BWD_SCHEMA,
                         tags=_TAGS)
def _moe_experts_fp8_backward(dz, h, h_scale, row_weights, y, g, u, cu_seqlens, experts_to_copy,
                              w1, w3, w2, pool, dst, total_num_tokens, pow2_scales=False,
                              weight_cache="", fp8_wgrad=False, biases=None, activation="swiglu",
                              alpha=1.0, limit=1.0, need_dx=True):
    p = _pool(pool)
    checked("moe_experts_fp8_backward", p, _check, "moe_experts_fp8_backward", p, h, h_scale,
            row_weights, cu_seqlens, experts_to_copy, w1, w3, w2, pow2_scales, dst=dst,
            total=total_num_tokens, cache=weight_cache, fp8_wgrad=fp8_wgrad, biases=biases,
            activation=activation, alpha=alpha, limit=limit, dz=dz, y=y, g=g, u=u)
    # The dgrads dy @ W_g are forward GEMMs on W^T (K-major, as the sm90 FP8 MMA wants): the
    # home weights are quantised straight into the transposed layout (bitwise quantise(W)^T)
    # and pushed into the slots viewed transposed, so no e4m3 tensor is ever transposed.
    # The slots may hold another layer's (or the forward's) experts: re-prefetch.
    q1, s1, q3, s3, q2, s2 = _home_weights(weight_cache, w1, w3, w2, pow2_scales,
                                           transpose=True)
    t1, ts1, t3, ts3, t2, ts2 = _prefetch(p, experts_to_copy, [q1, s1, q3, s3, q2, s2],
                                          transposed=True, biases=biases)
    cu = cu_seqlens
    if fp8_wgrad:
        return _backward_fp8_wgrad(p, dz, h, h_scale, row_weights, y, g, u, cu, experts_to_copy,
                                   w1, w3, w2, dst, total_num_tokens, pow2_scales,
                                   (q1, s1, q3, s3, q2, s2), (t1, ts1, t3, ts3, t2, ts2),
                                   need_dx)
    variant = bool(biases) or activation != "swiglu"
    quant = torch.ops.moonep.quantize_fp8_rows
    mm = torch.ops.moonep.grouped_mm_fp8
    if variant:                 # the forward's formulas (b2 in d_rows), torch passes
        b1, b3, b2 = group_biases(p, biases)
        dy, d_rows, db2 = scale_rows_biased_backward(dz, y, b2, cu, row_weights)
        dyq, dys = quant(dy, pow2_scales)
    else:
        # One pass over dz and y: dy = bf16(fp32(dz) * w_M), its 1 x 128 tiles, and the grad
        # of row_weights d_rows = sum_D fp32(dz) * fp32(y) (fp32, summed in the kernel).
        dy, dyq, dys, d_rows = torch.ops.moonep.scale_rows_backward_fp8(dz, row_weights, y,
                                                                        pow2_scales)
    # zero_tail=False: da and dh are read at the plan's rows only (dh by the combine below)
    da = mm(dyq, dys, q2, s2, t2, ts2, cu, False)               # dy @ w2_g  [M, F]
    if variant:
        # with the biases, their grads db1, db3 summed in the same pass (as the bf16 op)
        dg, du, a, sums = glu_backward_sums(g, u, da, b1, b3, cu,
                                            *glu_params(activation, alpha, limit))
    else:
        dg, du, a = swiglu_backward(g, u, da)
    # [M, D]; x needs no grad: zeros (the combine below still gathers the route weights' grad)
    dh = mm(*quant(dg, pow2_scales), q1, s1, t1, ts1, cu, False) \
        + mm(*quant(du, pow2_scales), q3, s3, t3, ts3, cu, False) if need_dx else \
        dz.new_zeros(dz.shape)
    h_bf = torch.ops.moonep.dequantize_fp8_rows(h, h_scale)     # bf16(h * h_scale), one pass:
                                                                # the rows the forward used
    d1, d3, d2 = (torch.empty_like(w) for w in (w1, w3, w2))
    torch.ops.moonep.grouped_mm_wgrad_into(dg, h_bf, cu, d1, p.g1)
    torch.ops.moonep.grouped_mm_wgrad_into(du, h_bf, cu, d3, p.g3)
    torch.ops.moonep.grouped_mm_wgrad_into(dy, a, cu, d2, p.g2)
    dbiases = bias_grads(p, sums + [db2], w1.shape[0], dy.dtype) if biases else []
    torch.ops.moonep.reduce_grad(experts_to_copy, [d1, d3, d2] + dbiases,
                                 [p.g1, p.g3, p.g2] + ([p.gb1, p.gb3, p.gb2] if biases else []),
                                 p.backend_name)
    dx, drw = torch.ops.moonep.combine(dh, d_rows, dst, p.backend_name, total_num_tokens)
    return dx, drw, d1, d3, d2, dbiases


def _backward_fp8_wgrad(p, dz, h, h_scale, row_weights, y, g, u, cu, etc, w1, w3, w2, dst,
                        total_num_tokens, pow2, home, slots, need_dx=True):
    """The backward with the wgrads in FP8 (the docstring's fp8_wgrad=True): each operand is
    quantised once per layout it feeds (rows for the dgrads, tokens for the wgrads)."""
    q1, s1, q3, s3, q2, s2 = home
    t1, ts1, t3, ts3, t2, ts2 = slots
    mm = torch.ops.moonep.grouped_mm_fp8
    # one pass over dz and y: q(dy) by rows and by tokens, and d_rows (no bf16 dy)
    dyq, dys, dyT, dyTs, d_rows = torch.ops.moonep.scale_rows_backward_fp8_tokens(
        dz, row_weights, y, cu, pow2)
    da = mm(dyq, dys, q2, s2, t2, ts2, cu, False)                  # dy @ w2_g  [M, F]
    dg, du, a = swiglu_backward(g, u, da)
    rt = torch.ops.moonep.quantize_fp8_rows_tokens
    gq, gs_, gT, gTs = rt(dg, cu, pow2)                            # one pass over dg
    uq, us_, uT, uTs = rt(du, cu, pow2)                            # one pass over du
    dh = mm(gq, gs_, q1, s1, t1, ts1, cu, False) + mm(uq, us_, q3, s3, t3, ts3, cu, False) \
        if need_dx else dz.new_zeros(dz.shape)
    tok = torch.ops.moonep.quantize_fp8_tokens
    hT, hTs = tok(h, cu, h_scale, pow2)                            # the forward's rows, in fp32
    aT, aTs = tok(a, cu, None, pow2)
    d1, d3, d2 = (torch.empty_like(w) for w in (w1, w3, w2))
    wg = torch.ops.moonep.grouped_mm_fp8_wgrad_into
    wg(gT, gTs, hT, hTs, cu, d1, p.g1)
    wg(uT, uTs, hT, hTs, cu, d3, p.g3)
    wg(dyT, dyTs, aT, aTs, cu, d2, p.g2)
    torch.ops.moonep.reduce_grad(etc, [d1, d3, d2], [p.g1, p.g3, p.g2], p.backend_name)
    dx, drw = torch.ops.moonep.combine(dh, d_rows, dst, p.backend_name, total_num_tokens)
    return dx, drw, d1, d3, d2, []


@_moe_experts_fp8_backward.register_fake
def _(dz, h, h_scale, row_weights, y, g, u, cu_seqlens, experts_to_copy, w1, w3, w2, pool, dst,
      total_num_tokens, pow2_scales=False, weight_cache="", fp8_wgrad=False, biases=None,
      activation="swiglu", alpha=1.0, limit=1.0, need_dx=True):
    p = _pool(pool)
    checked("moe_experts_fp8_backward", p, _check, "moe_experts_fp8_backward", p, h, h_scale,
            row_weights, cu_seqlens, experts_to_copy, w1, w3, w2, pow2_scales, values=False,
            dst=dst, total=total_num_tokens, cache=weight_cache, fp8_wgrad=fp8_wgrad,
            biases=biases, activation=activation, alpha=alpha, limit=limit, dz=dz, y=y, g=g,
            u=u)
    be = registry.lookup(p.backend_name, Backend)
    K, D = be.spec.K, w1.shape[2]
    s = dst.shape[0] // K
    return (w1.new_empty((s, D)), w1.new_empty((s, K), dtype=torch.float32),
            w1.new_empty(w1.shape), w3.new_empty(w3.shape), w2.new_empty(w2.shape),
            [b.new_empty(b.shape) for b in biases or []])


def _setup(ctx, inputs, output):
    (h, hs, wM, cu, etc, w1, w3, w2, pool, x, rw, dst, total, pow2, cache, fp8_wgrad, biases,
     activation, alpha, limit) = inputs
    _, y, g, u = output
    ctx.pool, ctx.total, ctx.pow2 = pool, total, pow2
    ctx.cache, ctx.fp8_wgrad = cache, fp8_wgrad
    ctx.variant, ctx.has_biases = (activation, alpha, limit), biases is not None
    ctx.save_for_backward(h, hs, wM, y, g, u, cu, etc, w1, w3, w2, dst, *(biases or []))
    # y, g, u are outputs for the backward's sake, never differentiated through: their grads
    # stay None instead of three zero tensors of the buffer's size per step
    ctx.set_materialize_grads(False)


def _backward(ctx, dz, _dy, _dg, _du):
    if dz is None:                          # z unused: every grad is zero
        return (None,) * len(ctx.needs_input_grad)
    h, hs, wM, y, g, u, cu, etc, w1, w3, w2, dst, *biases = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[9]       # x: without its grad the two dgrads into h are skipped
    dx, drw, d1, d3, d2, db = torch.ops.moonep.moe_experts_fp8_backward(
        dz.contiguous(), h, hs, wM, y, g, u, cu, etc, w1, w3, w2, ctx.pool, dst, ctx.total,
        ctx.pow2, ctx.cache, ctx.fp8_wgrad, biases if ctx.has_biases else None, *ctx.variant,
        need_dx)
    grads = (None, None, None, None, None, d1, d3, d2, None, dx if need_dx else None, drw,
             None, None, None, None,
             None, list(db) if ctx.has_biases else None, None, None, None)
    # one per input the call passed: the dispatcher drops trailing arguments equal to their
    # defaults, and with a Tensor[] in the schema torch checks the count
    return grads[:len(ctx.needs_input_grad)]


_moe_experts_fp8.register_autograd(_backward, setup_context=_setup)
