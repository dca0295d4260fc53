"""Op family ``moonep::moe_experts`` / ``moonep::moe_experts_backward``: the routed SwiGLU
experts of one rank over its G = 2*B groups (B home experts, then B redundant slots), and the
``ExpertPool`` that holds the slots.

    y_MD, g_MF, u_MF = moe_experts(h_MD, cu_seqlens_G, experts_to_copy_RB, w1, w3, w2, pool)
        prefetch_weight (owners push the slot experts into the pool), then
        g = grouped_mm(h, w1, pool.w1), u = grouped_mm(h, w3, pool.w3),
        y = grouped_mm(swiglu(g, u), w2, pool.w2)
    dh, dw1, dw3, dw2 = moe_experts_backward(dy, h, g, u, cu, etc, w1, w3, w2, pool)
        re-prefetch (the slots may hold another layer's experts by now), dgrad of the three
        GEMMs, weight grads written once in the weights' dtype (home groups into fresh tensors,
        slot groups into the pool's grad landing), reduce_grad adds every slot's grad into its
        owner's in a fixed order and zeroes the consumed slots.

Expert weights (nn.Linear layout): w1 (gate) and w3 (up) [B, F, D], w2 (down) [B, D, F], this
rank's home experts.  The returned weight grads already hold every rank's contribution for them.
The pool never appears in an autograd graph: both ops take its registry name.

ExpertPool.  One per (Buffer, D, F, dtype), owned by the Buffer (``Buffer.expert_pool``) and freed
with it, shared by every layer of that shape:
    slot weights  3 * B * D * F * sizeof(dtype)
    slot grads    3 * B * D * F * sizeof(dtype)      (the reduce_grad landing area)
    bias slots    2 * B * (2F + D) * sizeof(dtype)   (weights and grads; only once a layer with
                                                      expert biases binds: add_bias_slots)
e.g. B = 48, D = 7168, F = 2048, bf16: 4.2 GB + 4.2 GB per process whatever the number of layers.
The slot grads are zero outside a backward (reduce_grad re-zeroes what it consumes), so empty slot
groups are never rewritten.
"""
from __future__ import annotations

import torch
from torch.autograd import _profiler_enabled
from torch.autograd.profiler import record_function
from torch import Tensor

from .. import registry
from ..backends.base import Backend
from . import grouped_mm as _gm  # noqa: F401  (registers moonep::grouped_mm*)
from . import expert_weights as _ew  # noqa: F401  (registers moonep::prefetch_weight, reduce_grad)
from . import fastpath
from .checks import (ARG_ERRORS, call_device, check_no_overlap, device_error, has_real_tensor,
                     mark_passed, on_device, passed, reject_call, signature)
from .quantize_fp8 import FP8_DTYPE, scale_cols
from .swiglu import run_swiglu, run_swiglu_backward


PRECISIONS = ("bf16", "fp8")


class ExpertPool:
    """Redundant-expert slots of one process for one (D, F, dtype, precision): weights and grad
    landing.  Built by ``Buffer.expert_pool``; the pool's tensors are symmetric on the CUDA
    backend (owners push weights into the slots and pull grads from them).

    precision "bf16": slot weights w1, w3 [B, F, D], w2 [B, D, F] in ``dtype``.
    precision "fp8" (moonep_ops/ops/moe_experts_fp8.py): the slot weights are e4m3 with their
    128 x 128 block scales s1, s3 [B, ceil(F/128), ceil(D/128)], s2 [B, ceil(D/128),
    ceil(F/128)] fp32.  The slot grads g1, g3, g2 are in ``dtype`` either way (weight grads
    stay in the weights' dtype)."""

    def __init__(self, backend, backend_name: str, D: int, F: int, dtype: torch.dtype,
                 precision: str = "bf16"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        B = backend.spec.epn
        self.backend_name = backend_name
        self.D, self.F, self.dtype, self.precision = D, F, dtype, precision
        z = backend.symmetric_zeros
        wdt = FP8_DTYPE if precision == "fp8" else dtype
        self.w1 = z((B, F, D), wdt)
        self.w3 = z((B, F, D), wdt)
        self.w2 = z((B, D, F), wdt)
        self.s1 = self.s3 = self.s2 = None
        self.b1 = self.b3 = self.b2 = self.gb1 = self.gb3 = self.gb2 = None
        if precision == "fp8":
            cF, cD = scale_cols(F), scale_cols(D)
            self.s1 = z((B, cF, cD), torch.float32)
            self.s3 = z((B, cF, cD), torch.float32)
            self.s2 = z((B, cD, cF), torch.float32)
        self.g1 = z((B, F, D), dtype)
        self.g3 = z((B, F, D), dtype)
        self.g2 = z((B, D, F), dtype)
        self.b1 = self.b3 = self.b2 = self.gb1 = self.gb3 = self.gb2 = None
        self._named = None
        self.name = registry.register(self, "pool")

    def add_bias_slots(self) -> None:
        """Slots for expert biases (moonep::moe_experts_ext), which travel with their weights:
        b1, b3 [B, F], b2 [B, D] and their grad landing gb1, gb3, gb2, in ``dtype``.  Made once,
        by the first biased layer's bind: collective on a symmetric backend, so every rank calls
        it at the same point (their layers bind in the same order)."""
        if self.b1 is not None:
            return
        z, (B, F, D) = _backend(self).symmetric_zeros, (self.w1.shape[0], self.F, self.D)
        self.b1, self.b3, self.b2 = z((B, F), self.dtype), z((B, F), self.dtype), z((B, D), self.dtype)
        self.gb1, self.gb3, self.gb2 = (z((B, F), self.dtype), z((B, F), self.dtype),
                                        z((B, D), self.dtype))
        self._named = None                  # named_tensors lists the bias slots from now on

    def slot_weights(self, transposed: bool = False) -> list[Tensor]:
        """What prefetch_weight fills: [w1, w3, w2], or fp8 [w1, s1, w3, s3, w2, s2].

        transposed (fp8 only): the same buffers viewed with their last two dims swapped,
        w1, w3 as [B, D, F], w2 as [B, F, D] and the scales as [B, ceil(D/128), ceil(F/128)] /
        [B, ceil(F/128), ceil(D/128)]: contiguous views of the same bytes (an expert's row is
        as long either way), for the FP8 backward's pool of transposed weights."""
        if self.precision == "fp8":
            ws = [self.w1, self.s1, self.w3, self.s3, self.w2, self.s2]
            if transposed:
                ws = [t.view(*t.shape[:-2], t.shape[-1], t.shape[-2]) for t in ws]
            return ws
        if transposed:
            raise ValueError("slot_weights(transposed=True) is for the fp8 pool only")
        return [self.w1, self.w3, self.w2]

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(getattr(self, n) for n in self.tensor_names())

    def tensor_names(self) -> tuple[str, ...]:
        w = ("w1", "s1", "w3", "s3", "w2", "s2") if self.precision == "fp8" else ("w1", "w3", "w2")
        bias = ("b1", "b3", "b2", "gb1", "gb3", "gb2") if self.b1 is not None else ()
        return w + ("g1", "g3", "g2") + bias

    def named_tensors(self) -> list[tuple[str, Tensor]]:
        """[("the pool's <name>", tensor)] of every pool tensor, as the overlap checks name
        them (built once: the pool's tensors are fixed until release)."""
        if self._named is None:
            self._named = [(f"the pool's {n}", t)
                           for n, t in zip(self.tensor_names(), self.tensors())]
        return self._named

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def release(self) -> None:
        registry.unregister(self.name)
        self.w1 = self.w3 = self.w2 = self.g1 = self.g3 = self.g2 = None
        self.s1 = self.s3 = self.s2 = None
        self.b1 = self.b3 = self.b2 = self.gb1 = self.gb3 = self.gb2 = None
        self._named = None


def _pool(name: str) -> ExpertPool:
    return registry.lookup(name, ExpertPool)


def _backend(pool: ExpertPool) -> Backend:
    return registry.lookup(pool.backend_name, Backend)


def _call(name: str, fn, *args):
    """``fn(*args)``, one of the bodies the expert ops call directly; while a profiler runs, in a
    range named like the op it used to be called through (``moonep::grouped_mm``, ...), so
    profiles still show the phases.  One C call otherwise."""
    if _profiler_enabled():
        with record_function(name):
            return fn(*args)
    return fn(*args)


def _prefetch(pool: ExpertPool, etc: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> None:
    """moonep::prefetch_weight's body, called directly: _check_expert_args made every check of
    that op (shapes, dtypes, devices, contiguity, experts_to_copy's values, the pool's slots
    against every input), so the nested dispatcher call and its checks are skipped."""
    _call("moonep::prefetch_weight", _backend(pool).prefetch_weight, etc,
          [w1.detach(), w3.detach(), w2.detach()], [pool.w1, pool.w3, pool.w2])


def check_expert_weights(w1, w3, w2, pool: ExpertPool, prefix: str = "") -> tuple[int, int, int]:
    """3-D w1, w3 [B, F, D] and w2 [B, D, F] of the pool's D, F and dtype, B = the Buffer's
    epn; returns (B, F, D).  ``prefix``: of the messages (the FP8 op's name)."""
    B, F, D = w1.shape
    if w3.shape != w1.shape or tuple(w2.shape) != (B, D, F):
        raise ValueError(f"{prefix}expert weights must be w1, w3 [B, F, D] and w2 [B, D, F]; "
                         f"got {tuple(w1.shape)}, {tuple(w3.shape)}, {tuple(w2.shape)}")
    if (D, F, w1.dtype) != (pool.D, pool.F, pool.dtype):
        raise ValueError(f"{prefix}weights (D={D}, F={F}, {w1.dtype}) do not match the pool "
                         f"(D={pool.D}, F={pool.F}, {pool.dtype})")
    if B != pool.w1.shape[0]:
        raise ValueError(f"{prefix}expert weights hold B={B} experts, the Buffer has epn="
                         f"{pool.w1.shape[0]}")
    return B, F, D


def _check_expert_args(h: Tensor, cu: Tensor, etc: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                       pool: ExpertPool, values: bool = True, precision: str = "bf16",
                       **more: Tensor) -> None:
    """Every check of moe_experts(_backward), before the first write (the pool's slots) and the
    first collective (prefetch_weight).  ``more``: the backward's dy [M, D], g and u [M, F].
    ``values``: real kernels only (cu_seqlens values, memory overlap, experts_to_copy values).
    The static checks run once per call signature (checks.signature): the pool (its name is
    never reused; its D, F, dtype, precision, slots and Buffer are fixed) and each tensor's
    type, shape, dtype, device and, for those that must be contiguous, contiguity."""
    key = None
    if values:
        key = signature((precision, pool.name, *more), (h, cu, etc, w1, w3, w2, *more.values()),
                        (cu, etc, w1, w3, w2))
    if not passed(key):
        _check_static(h, cu, etc, w1, w3, w2, pool, precision, more)
        mark_passed(key)
    if values:
        _gm._check_cu_values(cu, h.shape[0])
        check_no_overlap("moe_experts", pool.named_tensors(),
                         [("h", h), ("cu_seqlens", cu), ("experts_to_copy", etc), ("w1", w1),
                          ("w3", w3), ("w2", w2), *more.items()])
        _ew.check_etc_values(etc, _backend(pool))   # (prefetch_weight's: CPU by default)


def _check_static(h, cu, etc, w1, w3, w2, pool, precision, more) -> None:
    """_check_expert_args's checks that read no data."""
    named_t = dict(h=h, cu_seqlens=cu, experts_to_copy=etc, w1=w1, w3=w3, w2=w2, **more)
    for name, t in named_t.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"moe_experts: {name} must be a Tensor, got {type(t).__name__}")
    for name in ("w1", "w3", "w2"):
        if named_t[name].dim() != 3:
            raise ValueError(f"moe_experts: {name} must be 3-D, got {tuple(named_t[name].shape)}")
    if pool.precision != precision:
        raise ValueError(f"the pool holds {pool.precision} slots; this op needs a {precision} "
                         f"pool (Buffer.expert_pool(D, F, dtype, precision={precision!r}))")
    B, F, D = check_expert_weights(w1, w3, w2, pool)
    dev = call_device(h, pool.w1.device)       # the pool's, or meta for a shape-only call
    for name, t in named_t.items():
        if not on_device(t, dev):
            raise ValueError("moe_experts: " + device_error(name, t, dev, pool.w1.device, "h"))
        if name in ("w1", "w3", "w2", "experts_to_copy", "cu_seqlens") and not t.is_contiguous():
            # the weights are the prefetch's local tensors (read by row); etc and cu by pointer
            raise ValueError(f"moe_experts: {name} must be contiguous (got strides {t.stride()})")
    for name in ("w3", "w2"):
        if named_t[name].dtype != w1.dtype:
            raise TypeError(f"moe_experts: {name} is {named_t[name].dtype}, w1 {w1.dtype}: the "
                            "expert weights share one dtype")
    if h.dim() != 2 or h.shape[1] != D or h.dtype != w1.dtype:
        raise ValueError(f"h must be [M, D={D}] {w1.dtype}, got {tuple(h.shape)} {h.dtype}")
    M = h.shape[0]
    want = {"dy": (M, D), "g": (M, F), "u": (M, F)}
    for name, t in more.items():
        if tuple(t.shape) != want[name] or t.dtype != w1.dtype:
            raise ValueError(f"moe_experts_backward: {name} must be {list(want[name])} "
                             f"{w1.dtype}, got {list(t.shape)} {t.dtype}")
    be = _backend(pool)
    R = be.spec.R
    if etc.dtype != torch.int32 or tuple(etc.shape) != (R, B):
        raise ValueError(f"experts_to_copy must be int32 [R={R}, epn={B}], got "
                         f"{list(etc.shape)} {etc.dtype}")
    # cu_seqlens: dtype, [2*epn], device, and (_check_expert_args) its values, now: the grouped
    # GEMMs would check them only after prefetch_weight wrote the pool's slots.
    _gm._check_cu(cu, 2 * B, M, h.device, False)


def checked(op: str, pool: ExpertPool, check, *args, values: bool = True, **kw):
    """``check(*args, values=values, **kw)``, an expert op's argument checks; an error reaches
    the peers through prefetch_weight's collective, the op's first (checks.reject_call): in the
    real kernel (``values``), and in the fake kernel when real tensors reached it (a meta
    tensor among them routed an eager call there)."""
    try:
        return check(*args, values=values, **kw)
    except ARG_ERRORS as e:
        eager = values or has_real_tensor(*args, *kw.values())
        raise reject_call(registry.lookup(pool.backend_name, Backend), op, "prefetch_weight", e,
                          eager) from None


# Capturable when the Buffer's backend is (Backend.capturable); the host-reading backends raise
# under capture.
_TAGS = ()


def moe_experts_body(h: Tensor, cu_seqlens: Tensor, experts_to_copy: Tensor, w1: Tensor,
                     w3: Tensor, w2: Tensor, pool: str) -> tuple[Tensor, Tensor, Tensor]:
    """SwiGLU over 2*epn groups; stages the redundant slots first.  Returns (y, gate, up)."""
    p = _pool(pool)
    checked("moe_experts", p, _check_expert_args, h, cu_seqlens, experts_to_copy, w1, w3, w2, p)
    _prefetch(p, experts_to_copy, w1, w3, w2)
    # Rows past cu_seqlens[-1]: nothing reads them (combine gathers by the plan's rows, the
    # GEMMs and their backward read group rows only), so g, u, y leave them unwritten.  The
    # GEMMs and the SwiGLU run without their ops' checks: the arguments were checked above,
    # and g, u, a are made here with the shapes the next call needs.
    mm = "moonep::grouped_mm"
    g = _call(mm, _gm.run_fwd, h, w1, p.w1, cu_seqlens, -1, False)
    u = _call(mm, _gm.run_fwd, h, w3, p.w3, cu_seqlens, -1, False)
    a = _call("moonep::swiglu", run_swiglu, g, u)
    return _call(mm, _gm.run_fwd, a, w2, p.w2, cu_seqlens, -1, False), g, u


_moe_experts = torch.library.custom_op("moonep::moe_experts", moe_experts_body, mutates_args=(),
                                       tags=_TAGS)


@_moe_experts.register_fake
def _(h, cu_seqlens, experts_to_copy, w1, w3, w2, pool):
    p = _pool(pool)
    checked("moe_experts", p, _check_expert_args, h, cu_seqlens, experts_to_copy, w1, w3, w2, p,
            values=False)
    M, F = h.shape[0], w1.shape[1]
    return h.new_empty(M, w2.shape[1]), h.new_empty(M, F), h.new_empty(M, F)


def moe_experts_backward_body(dy: Tensor, h: Tensor, g: Tensor, u: Tensor, cu_seqlens: Tensor,
                              experts_to_copy: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                              pool: str, need_dh: bool = True
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dh, dw1, dw3, dw2) for this rank's home experts, every rank's slot grads included;
    without ``need_dh`` (h needs no grad) dh is [0, D] and its two dgrads are not run."""
    p = _pool(pool)
    checked("moe_experts_backward", p, _check_expert_args, h, cu_seqlens, experts_to_copy, w1,
            w3, w2, p, dy=dy, g=g, u=u)
    _prefetch(p, experts_to_copy, w1, w3, w2)         # slots may hold another layer by now
    cu = cu_seqlens
    dh, dg, du, d1, d3, d2 = expert_grads(p, dy.contiguous(), h, cu, w1, w3, w2,
                                          lambda da: run_swiglu_backward(g, u, da), need_dh)
    if d1.dtype in _ew.GRAD_DTYPES:
        _call("moonep::reduce_grad", _backend(p).reduce_grad, experts_to_copy, [d1, d3, d2],
              [p.g1, p.g3, p.g2])
    else:       # the op raises its dtype error, reaching the peers (checks.reject_call)
        torch.ops.moonep.reduce_grad(experts_to_copy, [d1, d3, d2], [p.g1, p.g3, p.g2],
                                     p.backend_name)
    return dh, d1, d3, d2


def expert_grads(p: ExpertPool, dy: Tensor, h: Tensor, cu: Tensor, w1: Tensor, w3: Tensor,
                 w2: Tensor, act_backward, need_dh: bool = True) -> tuple[Tensor, ...]:
    """The experts' backward after the prefetch, before reduce_grad: (dh, dg, du, dw1, dw3, dw2)
    with the slot groups' weight grads in the pool.  ``act_backward(da) -> (dg, du, a)``: the
    activation's backward (moonep::swiglu_backward's body, or the gated variant's).  The GEMMs
    run without their ops' checks (the caller made them for the inputs; the intermediates and
    grads are made here, in the shapes the calls need)."""
    dgrad, wgrad = "moonep::grouped_mm_dgrad", "moonep::grouped_mm_wgrad_into"
    da = _call(dgrad, _gm.run_dgrad, dy, w2, p.w2, cu, -1, False)   # tail unread
    dg, du, a = _call("moonep::swiglu_backward", act_backward, da)
    # One bf16 add (fp32 math, one rounding) of the two dgrads.  dh is h's gradient, zero past
    # the last group (its true value), so these two keep the zero tail.
    dh = (_call(dgrad, _gm.run_dgrad, dg, w1, p.w1, cu) + _call(dgrad, _gm.run_dgrad, du, w3,
                                                                p.w3, cu)) if need_dh else \
        h.new_empty(0, h.shape[1])
    # Weight grads written once in the weights' dtype (fp32 accumulation inside the GEMM); slot
    # grads land in the shared pool, whose slots are zero outside a backward (reduce_grad
    # re-zeroes what it consumes), so empty slot groups are not rewritten.  d1, d3, d2 are
    # fresh, and the pool's grads were checked against every input: no written tensor of the
    # wgrads or of reduce_grad can overlap another argument.
    d1, d3, d2 = (torch.empty_like(w) for w in (w1, w3, w2))
    _call(wgrad, _gm.run_wgrad_into, dg, h, cu, d1, p.g1)
    _call(wgrad, _gm.run_wgrad_into, du, h, cu, d3, p.g3)
    _call(wgrad, _gm.run_wgrad_into, dy, a, cu, d2, p.g2)
    return dh, dg, du, d1, d3, d2


_moe_experts_backward = torch.library.custom_op("moonep::moe_experts_backward",
                                                moe_experts_backward_body, mutates_args=(),
                                                tags=_TAGS)


@_moe_experts_backward.register_fake
def _(dy, h, g, u, cu_seqlens, experts_to_copy, w1, w3, w2, pool, need_dh=True):
    p = _pool(pool)
    checked("moe_experts_backward", p, _check_expert_args, h, cu_seqlens, experts_to_copy, w1,
            w3, w2, p, values=False, dy=dy, g=g, u=u)
    return h.new_empty(h.shape if need_dh else (0, h.shape[1])), w1.new_empty(w1.shape), \
        w3.new_empty(w3.shape), w2.new_empty(w2.shape)


def _experts_setup(ctx, inputs, output):
    h, cu, etc, w1, w3, w2, pool = inputs
    _, g, u = output
    ctx.pool = pool
    ctx.save_for_backward(h, g, u, cu, etc, w1, w3, w2)
    # g, u are outputs for the backward's sake, never differentiated through: their grads stay
    # None instead of two [M, F] zero tensors (one memset pass each) per step
    ctx.set_materialize_grads(False)


def _experts_backward(ctx, dy, _dg, _du):
    if dy is None:                             # y unused: every grad is zero
        return (None,) * 7
    h, g, u, cu, etc, w1, w3, w2 = ctx.saved_tensors
    need_dh = ctx.needs_input_grad[0]          # h detached (x needs no grad): no dgrad into it
    dh, d1, d3, d2 = moe_experts_backward(dy, h, g, u, cu, etc, w1, w3, w2, ctx.pool, need_dh)
    return dh if need_dh else None, None, None, d1, d3, d2, None


_ExpertsFn = fastpath.autograd(_moe_experts, "MoeExpertsFn", moe_experts_body, _experts_setup,
                               _experts_backward)


def moe_experts(h, cu_seqlens, experts_to_copy, w1, w3, w2, pool: str):
    """``torch.ops.moonep.moe_experts(...)``; in eager mode without the dispatcher (fastpath)."""
    return fastpath.call(torch.ops.moonep.moe_experts, moe_experts_body, _ExpertsFn, h,
                         cu_seqlens, experts_to_copy, w1, w3, w2, pool)


def moe_experts_backward(dy, h, g, u, cu_seqlens, experts_to_copy, w1, w3, w2, pool: str,
                         need_dh: bool = True):
    """``torch.ops.moonep.moe_experts_backward(...)``; in eager mode without the dispatcher."""
    return fastpath.call(torch.ops.moonep.moe_experts_backward, moe_experts_backward_body, None,
                         dy, h, g, u, cu_seqlens, experts_to_copy, w1, w3, w2, pool, need_dh)


