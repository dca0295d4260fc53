"""The FP8 weight cache: a layer's e4m3 expert weights and their 128 x 128 block scales, in both
layouts the FP8 recipe reads, quantised once per parameter update instead of once per call.

    cache = FP8WeightCache(B, F, D, pow2_scales=False, device=...)   # an nn.Module of buffers
      forward layout   q1, q3 [B, F, D], q2 [B, D, F]  + s1, s3 [B, cF, cD], s2 [B, cD, cF]
      backward layout  t1, t3 [B, D, F], t2 [B, F, D]  + their scales transposed
                       (quantize_fp8_blocks(w, transpose=True): bitwise q(W)^T, docs/fp8.md)
    cache.weights(w1, w3, w2, transpose=False) -> [q1, s1, q3, s3, q2, s2] (or the t's)

The FP8 expert op (moe_experts_fp8.py) takes the cache's registry name and reads the home
experts' quantisation from it in its forward (W) and backward (W^T); ``prefetch_weight`` pushes
those same tensors into the pool's slots, so the slot experts are never quantised either (a slot
holds a donor rank's home expert, which its owner's cache already holds).  With gradient
accumulation over n micro-batches, the six 128 x 128-block passes of a step (0.6 ms each at
DeepSeek-V3 expert shapes, docs/fp8.md) run once per optimizer step instead of n times.

Memory, per layer (B home experts of [F, D] + [F, D] + [D, F]; cF = ceil(F/128), cD =
ceil(D/128)): 2 layouts x (3 B D F bytes of e4m3 + 12 B cF cD bytes of scales), i.e. the size of
the layer's bf16 expert weights (2 x 3 B D F bytes) plus 0.03 %: at DeepSeek-V3 (D 7168, F 2048)
84.02 MiB an expert, 2.63 GiB for 32 experts a rank (EP 8), 0.33 GiB for 4 (EP 64).  The pool's
slots are not duplicated (they are filled from the cache by prefetch, as before).
``FP8WeightCache.nbytes()`` reports it; ``MoEArgs(fp8_weight_cache=False)`` turns the cache off
(the layer then quantises on every call, as before, and holds none of it).

FRESHNESS: the cache follows the parameters' version counters, and that is why staleness is
impossible by construction in eager and compiled execution.
  * Every layout records, when it is computed, a key per weight: a weak reference to the
    parameter object, its ``_version`` and its ``data_ptr()``.  ``weights()`` (called in the
    consumer op's body) recomputes the layout when any key differs.  Every in-place update of a
    parameter bumps its version: optimizer steps (foreach, fused or for-loop), ``copy_`` /
    ``load_state_dict``, any ``p.mul_()`` under ``no_grad``; a new parameter object (re-binding,
    ``.to()``) or new storage (``p.data = t``) fails the reference or the pointer.  The weak
    reference also means a key can never match a different, later tensor that happens to reuse
    an address and a version number.
  * Why the version and not an explicit refresh alone: a refresh that the user (or a hook) must
    remember is exactly what makes a stale weight possible; the version is bumped by torch
    itself.  Why it works under torch.compile: a custom op's body runs at run time, outside the
    traced graph (no guard, no graph break), and torch.compile (aot_eager and inductor) hands it
    the parameter object itself, with its version counter (checked in tests/test_fp8_cache.py).
  * The one update torch does not count: writes through ``p.data`` (``p.data.add_(...)``) bypass
    the version counter, as they bypass autograd's own checks.  Call ``cache.invalidate()`` (or
    ``refresh``) after such a write.
CUDA GRAPHS: a captured graph replays its kernels with no host code, so no check can run at
replay.  Under capture ``weights()`` therefore does one of two things:
  * the cache is "refreshed by the step" (``cache.attach(optimizer, w1, w3, w2)``: a step
    post-hook that refreshes both layouts after every ``optimizer.step()``; or
    ``refresh_by_step(True)`` for a step function that calls ``refresh`` after its update,
    eagerly or inside the same compiled / captured step) and the layout is fresh (or was last
    written by such a refresh inside a compiled step, from the update's intermediates): the
    graph reads the buffers, which every refresh rewrites in place (static addresses);
  * otherwise (no step refresh, or weights changed since the last refresh) the graph captures
    the quantisation itself: every replay re-quantises, always fresh, no saving (warned once).
So a captured graph can read stale weights only when a step refresh is declared and the
parameters are then changed by something other than the step between replays: the one contract
the user keeps, and only under capture.
The refresh is ``moonep::fp8_weight_cache_refresh`` (quantises both layouts in place into the
buffers, one Triton kernel per weight and layout on CUDA): capturable, and traceable inside a
compiled training step.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from .. import registry
from . import quantize_fp8 as qf
from .quantize_fp8 import FP8_DTYPE, scale_cols

__all__ = ["FP8WeightCache", "cache_nbytes"]

_LAYOUTS = ("fwd", "bwd")
_NAMES = {"fwd": ("q1", "s1", "q3", "s3", "q2", "s2"),
          "bwd": ("t1", "ts1", "t3", "ts3", "t2", "ts2")}


def cache_nbytes(B: int, F: int, D: int) -> int:
    """Bytes of one layer's cache: both layouts, e4m3 weights and fp32 block scales."""
    return 2 * (3 * B * D * F + 3 * 4 * B * scale_cols(F) * scale_cols(D))


def _shapes(B: int, F: int, D: int, layout: str) -> list[tuple[int, ...]]:
    cF, cD = scale_cols(F), scale_cols(D)
    if layout == "fwd":
        return [(B, F, D), (B, cF, cD), (B, F, D), (B, cF, cD), (B, D, F), (B, cD, cF)]
    return [(B, D, F), (B, cD, cF), (B, D, F), (B, cD, cF), (B, F, D), (B, cF, cD)]


def _key(ws: Sequence[Tensor]) -> tuple:
    return tuple((weakref.ref(w), w._version, w.data_ptr()) for w in ws)


def _matches(key: Optional[tuple], ws: Sequence[Tensor]) -> bool:
    if key is None:
        return False
    return all(ref() is w and ver == w._version and ptr == w.data_ptr()
               for (ref, ver, ptr), w in zip(key, ws))


def _capturing(t: Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class FP8WeightCache(nn.Module):
    """Both FP8 layouts of one layer's home experts (see the module docstring).  An nn.Module of
    non-persistent buffers, so that it moves with its layer (``.to``), stays out of
    ``state_dict``, and torch.compile treats the buffers as module state (static addresses in
    CUDA graphs).  Registered by name (``self.name``) for the ops."""

    def __init__(self, B: int, F: int, D: int, *, pow2_scales: bool = False, device=None):
        super().__init__()
        for name, v in (("B", B), ("F", F), ("D", D)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"FP8WeightCache: {name} must be a positive int, got {v!r}")
        if not isinstance(pow2_scales, bool):
            raise TypeError(f"FP8WeightCache: pow2_scales must be a bool, got "
                            f"{type(pow2_scales).__name__}")
        self.B, self.F, self.D, self.pow2_scales = B, F, D, pow2_scales
        for layout in _LAYOUTS:
            for i, (n, shape) in enumerate(zip(_NAMES[layout], _shapes(B, F, D, layout))):
                dt = FP8_DTYPE if i % 2 == 0 else torch.float32
                self.register_buffer(n, torch.zeros(shape, dtype=dt, device=device),
                                     persistent=False)
        # per layout: None (not computed), ("live", key) or ("step",): refreshed from tensors
        # that are not the bound parameters (an update's intermediates in a compiled step)
        self._keys: dict[str, Optional[tuple]] = {k: None for k in _LAYOUTS}
        self._params: Optional[tuple] = None
        self._step_refresh = False
        self._hooks: list = []
        self.refreshes = {k: 0 for k in _LAYOUTS}     # how many times each layout was computed
        self._warned = False
        self.name = registry.register(self, "fp8cache")

    # -- the tensors ------------------------------------------------------------------------
    def tensors(self, transpose: bool = False) -> list[Tensor]:
        """[q1, s1, q3, s3, q2, s2] of the forward layout, or of the backward one (transpose)."""
        return [getattr(self, n) for n in _NAMES["bwd" if transpose else "fwd"]]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def _check_weights(self, ws: Sequence[Tensor]) -> None:
        want = [(self.B, self.F, self.D), (self.B, self.F, self.D), (self.B, self.D, self.F)]
        for n, w, shape in zip(("w1", "w3", "w2"), ws, want):
            if not isinstance(w, Tensor) or tuple(w.shape) != shape:
                got = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
                raise ValueError(f"FP8WeightCache: {n} must be {list(shape)}, got {got}")
            if w.device != self.q1.device:
                raise ValueError(f"FP8WeightCache: {n} is on {w.device}, the cache on "
                                 f"{self.q1.device}")

    def _quantise(self, ws: Sequence[Tensor], layout: str) -> None:
        outs = self.tensors(layout == "bwd")
        transpose = layout == "bwd"
        for i, w in enumerate(ws):
            q, s = outs[2 * i], outs[2 * i + 1]
            k = qf._kernels(w)
            w = w.detach()
            if k is not None:
                k.quantize_blocks(w, self.pow2_scales, transpose, out=(q, s))
            else:
                rq, rs = qf.quantize_blocks_from_float(w, self.pow2_scales, transpose)
                q.copy_(rq)
                s.copy_(rs)
        self.refreshes[layout] += 1

    # -- what the ops call -------------------------------------------------------------------
    def bind(self, w1: Tensor, w3: Tensor, w2: Tensor) -> None:
        """The layer's parameters (weak references): a refresh given other tensors (an update's
        intermediates inside a compiled step) is then known to be a step refresh."""
        self._check_weights((w1, w3, w2))
        self._params = tuple(weakref.ref(w) for w in (w1, w3, w2))

    def _is_params(self, ws: Sequence[Tensor]) -> bool:
        return self._params is not None and all(r() is w for r, w in zip(self._params, ws))

    def weights(self, w1: Tensor, w3: Tensor, w2: Tensor, transpose: bool = False
                ) -> list[Tensor]:
        """The layout the op needs, fresh: recomputed in place when the parameters changed since
        it was computed (eager, compiled); under CUDA-graph capture see the module docstring.
        Called in op bodies only (real tensors)."""
        ws = (w1, w3, w2)
        layout = "bwd" if transpose else "fwd"
        key = self._keys[layout]
        fresh = key is not None and key[0] == "live" and _matches(key[1], ws)
        if _capturing(w1):
            # Nothing on the host runs at replay: read the buffers only when a step refresh
            # keeps them fresh (and they hold this layer's weights, fresh or step-refreshed);
            # otherwise the quantisation itself is captured (always fresh, no saving).
            if self._step_refresh and (fresh or key == ("step",)):
                return self.tensors(transpose)
            if not self._warned:
                why = ("without a step refresh (cache.attach(optimizer) or refresh_by_step(True))"
                       if not self._step_refresh else "with weights changed since the last refresh")
                warnings.warn(f"FP8WeightCache: captured in a CUDA graph {why}: the graph "
                              "re-quantises the weights on every replay", stacklevel=3)
                self._warned = True
            self._check_weights(ws)
            self._quantise(ws, layout)
            return self.tensors(transpose)
        if not fresh:
            self._check_weights(ws)
            self._quantise(ws, layout)
            self._keys[layout] = ("live", _key(ws))
        return self.tensors(transpose)

    def is_fresh(self, w1: Tensor, w3: Tensor, w2: Tensor, transpose: bool = False) -> bool:
        """Whether ``weights`` would return the layout without recomputing it (host check)."""
        key = self._keys["bwd" if transpose else "fwd"]
        return key is not None and key[0] == "live" and _matches(key[1], (w1, w3, w2))

    # -- refresh ------------------------------------------------------------------------------
    def refresh(self, w1: Tensor, w3: Tensor, w2: Tensor) -> None:
        """Quantise both layouts now, in place (``moonep::fp8_weight_cache_refresh``; traceable
        and capturable)."""
        torch.ops.moonep.fp8_weight_cache_refresh(w1, w3, w2, self.tensors(False)
                                                  + self.tensors(True), self.name,
                                                  self.pow2_scales)

    def invalidate(self) -> None:
        """Forget both layouts: the next call recomputes them (after writes through ``.data``)."""
        self._keys = {k: None for k in _LAYOUTS}

    def refresh_by_step(self, on: bool = True) -> None:
        """Declare that ``refresh`` runs after every parameter update (by a step function that
        calls it after its update, possibly inside the same captured graph): CUDA-graph captures
        then read the buffers instead of capturing the quantisation."""
        self._step_refresh = bool(on)

    def attach(self, optimizer: torch.optim.Optimizer, w1: Tensor, w3: Tensor, w2: Tensor):
        """Refresh both layouts after every ``optimizer.step()`` (a step post-hook), and declare
        the step refresh (``refresh_by_step``).  Returns the hook's handle."""
        wr = [weakref.ref(w) for w in (w1, w3, w2)]
        me = weakref.ref(self)

        def hook(opt, args, kwargs):
            cache, ws = me(), [r() for r in wr]
            if cache is not None and all(w is not None for w in ws):
                with torch.no_grad():
                    cache.refresh(*ws)

        handle = optimizer.register_step_post_hook(hook)
        self._hooks.append(handle)
        self.refresh_by_step(True)
        return handle

    def extra_repr(self) -> str:
        return (f"B={self.B}, F={self.F}, D={self.D}, pow2_scales={self.pow2_scales}, "
                f"{self.nbytes() / 2**20:.1f} MiB")


def _lookup(name: str) -> FP8WeightCache:
    return registry.lookup(name, FP8WeightCache)


def _check_refresh(w1, w3, w2, cache, name, pow2) -> None:
    op = "fp8_weight_cache_refresh"
    for n, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if not isinstance(w, Tensor) or w.dim() != 3 or not w.dtype.is_floating_point:
            raise ValueError(f"{op}: {n} must be a 3-D floating Tensor")
    B, F, D = w1.shape
    if tuple(w3.shape) != (B, F, D) or tuple(w2.shape) != (B, D, F):
        raise ValueError(f"{op}: weights must be w1, w3 [B, F, D] and w2 [B, D, F]; got "
                         f"{tuple(w1.shape)}, {tuple(w3.shape)}, {tuple(w2.shape)}")
    want = _shapes(B, F, D, "fwd") + _shapes(B, F, D, "bwd")
    if len(cache) != 12 or any(tuple(t.shape) != s for t, s in zip(cache, want)):
        raise ValueError(f"{op}: cache must be the 12 tensors of FP8WeightCache.tensors() for "
                         f"B={B}, F={F}, D={D}")
    if not isinstance(pow2, bool):
        raise TypeError(f"{op}: pow2_scales must be a bool")


@torch.library.custom_op("moonep::fp8_weight_cache_refresh", mutates_args=("cache",),
                         schema="(Tensor w1, Tensor w3, Tensor w2, Tensor(a!)[] cache, str name, "
                                "bool pow2_scales=False) -> ()")
def _refresh_op(w1, w3, w2, cache, name, pow2_scales=False):
    _check_refresh(w1, w3, w2, cache, name, pow2_scales)
    c = _lookup(name)
    if c.pow2_scales != pow2_scales:
        raise ValueError(f"fp8_weight_cache_refresh: the cache {name} holds pow2_scales="
                         f"{c.pow2_scales}, the call passes {pow2_scales}")
    ws = (w1, w3, w2)
    for layout, part in (("fwd", cache[:6]), ("bwd", cache[6:])):
        for i, w in enumerate(ws):
            q, s = part[2 * i], part[2 * i + 1]
            k = qf._kernels(w)
            if k is not None:
                k.quantize_blocks(w.detach(), pow2_scales, layout == "bwd", out=(q, s))
            else:
                rq, rs = qf.quantize_blocks_from_float(w.detach(), pow2_scales, layout == "bwd")
                q.copy_(rq)
                s.copy_(rs)
        c.refreshes[layout] += 1
        # The parameters themselves (eager: a step hook, a call after the update): a live key.
        # Other tensors (the update's intermediates inside a compiled step, whose result the
        # graph copies into the parameters afterwards): a step refresh, which a captured
        # graph trusts when the step refresh is declared and an eager call recomputes.
        c._keys[layout] = ("live", _key(ws)) if c._is_params(ws) else ("step",)


@_refresh_op.register_fake
def _(w1, w3, w2, cache, name, pow2_scales=False):
    _check_refresh(w1, w3, w2, cache, name, pow2_scales)
