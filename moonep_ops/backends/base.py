"""The backend contract: how one rank of an EP group moves token rows, expert weights and grads.

Every data-plane op (moonep_ops/ops/dispatch.py, expert_weights.py) validates its arguments,
looks up its group's backend by name (moonep_ops/registry.py) and calls ONE method below; the
backend sees tensors and Python ints only, every layout decision is the planner's.  The ops read
the same for every backend:

  op                              backend method       what it does
  moonep::dispatch                dispatch             exchange histograms and plan (the
                                                       backend's _plan), scatter rows
                                                       (its dispatch_with_plan)
  moonep::dispatch_with_plan      dispatch_with_plan   scatter rows with a saved plan
  moonep::dispatch_fp8            dispatch_fp8         dispatch of e4m3 rows with their scales
                                                       (capability supports_fp8_dispatch)
  moonep::combine                 combine              gather each token's K rows (times
                                                       their route weights: weighted), sum
                                                       in fp32
  moonep::prefetch_weight         prefetch_weight      owners push experts into the slots
  moonep::reduce_grad             reduce_grad          owners add the slots' grads, zero them

Lifecycle: a Buffer creates its backend, ``bind(spec)`` runs once on every rank (collective: the
ranks' GroupSpec fingerprints are compared and the same ValueError raised on every rank if they
differ, then per-group state is allocated), the ops run, ``release()`` ends it (Buffer.destroy).

Capabilities are declared class attributes, never probed:
  capturable      the methods never read device memory on the host (CUDA-graph capture safe);
  supports_async  the methods may run on a side stream (Buffer's async mode);
  supports_fp8_dispatch  ``dispatch_fp8`` is implemented (the base class raises
                  NotImplementedError naming this flag; moonep::dispatch_fp8 checks it first).

Implementations (moonep_ops/backends/):
  CollectiveBackend  (collective.py) every method from two primitives, all_gather and
    TorchDistBackend   all_to_all_v, split sizes read on the host; torch.distributed (gloo/NCCL)
    SingleRankBackend  R = 1, the primitives are copies
  SymmBackend        (symm.py) CUDA kernels over symmetric memory, planning on the device

Shapes (moonep_ops/geometry.py legend): s tokens, K top-k, N = s*K entries, D model dim,
M = nvs_s receive rows, R ranks, B = epn.
"""
from __future__ import annotations

import abc
from typing import ClassVar, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..geometry import GroupSpec, check_fingerprints, rejection


class DispatchResult(NamedTuple):
    """What ``Backend.dispatch`` returns (the outputs of moonep::dispatch, in schema order)."""
    h_MD: Tensor            # [nvs_s, D] token rows grouped by expert; padding rows zero
    w_M: Tensor             # [nvs_s] fp32 route weight of every row (zero where none)
    cu_seqlens_G: Tensor    # [G] int32 inclusive end offsets of the G segments
    dst_N: Tensor           # [N] int32 slot of every entry (moonep_ops/ops/plan.py encoding)
    experts_to_copy_RB: Tensor   # [R, B] int32, the global slot table
    zero_fill_G2: Tensor    # [G, 2] int32 padding ranges
    remote_stats_2: Tensor  # [2] int32


class DispatchFP8Result(NamedTuple):
    """What ``Backend.dispatch_fp8`` returns (the outputs of moonep::dispatch_fp8, in order)."""
    h_MD: Tensor            # [nvs_s, D] float8_e4m3fn rows grouped by expert; padding rows 0
    h_scale_MC: Tensor      # [nvs_s, ceil(D/128)] fp32 1x128-tile scales; padding rows 0
    w_M: Tensor             # [nvs_s] fp32 route weight of every row (zero where none)
    cu_seqlens_G: Tensor
    dst_N: Tensor
    experts_to_copy_RB: Tensor
    zero_fill_G2: Tensor
    remote_stats_2: Tensor


class Backend(abc.ABC):
    """One rank's data plane of one EP group (see the module docstring)."""

    kind: ClassVar[str]                 # the Buffer(backend=...) name: "torch", "single", "symm"
    capturable: ClassVar[bool] = False
    supports_async: ClassVar[bool] = False
    supports_fp8_dispatch: ClassVar[bool] = False

    rank: int
    world_size: int
    device: torch.device
    # The torch process group of the EP group (router / shared-expert grads and Quantile
    # Balancing reduce over it), None when there is none (one process, virtual ranks).
    group: Optional[object] = None
    spec: Optional[GroupSpec] = None

    # -- lifecycle ----------------------------------------------------------------------------
    def bind(self, spec: GroupSpec) -> None:
        """Collective, once: check that every rank has the same spec, then allocate.

        The fingerprint exchange is the first collective of a Buffer (before any tensor
        collective or symmetric allocation), and every rank takes part in it even when its
        own arguments are bad, so a mismatch raises a ValueError on every rank and leaves the
        process group usable."""
        reason = ""
        if self.spec is not None:
            reason = (f"this {type(self).__name__} is already bound to a Buffer; create one "
                      "backend per Buffer")
        elif spec.R != self.world_size:
            reason = f"spec.R={spec.R} but the backend has {self.world_size} ranks"
        fingerprints = self.exchange_fingerprints(rejection(reason) if reason
                                                  else spec.fingerprint())
        if reason:
            raise ValueError(reason)
        check_fingerprints(fingerprints)
        self.spec = spec
        self._allocate(spec)

    def reject_bind(self, error: BaseException) -> None:
        """Collective, in place of ``bind`` on a rank whose Buffer arguments failed a local
        check (``error``): send a rejection through the fingerprint exchange, so that every peer
        raises a ValueError naming this rank instead of waiting for it.  The caller then
        raises ``error``."""
        self.exchange_fingerprints(rejection(f"{type(error).__name__}: {error}"))

    def reject(self, op: str, reason: str) -> None:
        """Collective where the backend's ops start with a host collective: in place of ``op``
        (a method name below) on a rank whose arguments failed a check, take part in that op's
        first collective with a rejection flag, so that every peer raises a ValueError naming
        this rank and ``reason`` instead of waiting in it; then return (the caller raises its
        own error).  Nothing is written.  This default does nothing: a backend whose ops start
        on the device (SymmBackend) cannot tell its peers on the host; their barriers time out
        and the error word names the op and this rank (Buffer.check_errors)."""

    @abc.abstractmethod
    def exchange_fingerprints(self, fingerprint: tuple) -> list:
        """Collective (host, set-up only): every rank's fingerprint, in rank order."""

    @abc.abstractmethod
    def _allocate(self, spec: GroupSpec) -> None:
        """Per-group state (landing areas, symmetric regions), after the fingerprint check."""

    @abc.abstractmethod
    def release(self) -> None:
        """Drop the per-group state (idempotent).  Every rank, after its last op."""

    @abc.abstractmethod
    def symmetric_zeros(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """Collective: a zeroed tensor the peers can address (ExpertPool slot weights and
        grads).  A plain tensor on backends that move data by messages."""

    def error_word(self) -> int:
        """Error bits a device kernel set (0: none).  Host backends raise eagerly instead and
        return 0; a device backend's read is a host sync."""
        return 0

    def error_details(self) -> tuple[int, str, int]:
        """(error word, the op of the first barrier timeout or "", the rank it waited for or
        -1).  Host backends: (0, "", -1)."""
        return 0, "", -1

    def clear_errors(self) -> None:
        """Reset the error word (device backends)."""

    # -- the data plane -----------------------------------------------------------------------
    @abc.abstractmethod
    def _plan(self, x_sD: Tensor, topk_sK: Tensor, total: int,
              reject: str) -> tuple[tuple[Tensor, ...], int]:
        """The first half of ``dispatch`` and ``dispatch_fp8``: exchange the [E] histograms and
        plan (policy spec.policy); raise on a rejection (see ``dispatch``).  Returns the
        planner's five tensors (dst, cu_seqlens, experts_to_copy, zero_fill, remote_stats) and
        nvs_s, the rows this rank receives."""

    def dispatch(self, x_sD: Tensor, topk_sK: Tensor, w_sK: Optional[Tensor], total: int,
                 reject: str) -> DispatchResult:
        """Exchange the [E] histograms, plan (policy spec.policy), scatter: ``_plan``, then
        ``dispatch_with_plan`` with that plan.  ``total``: the group's token count, -1 when
        every rank passes the same s.  ``reject``: a non-empty message when this rank's input
        failed a host check; the backend then raises a ValueError on this rank and, where it
        can, on every rank, before anything is written."""
        (dst, cu, etc, zf, stats), nvs_s = self._plan(x_sD, topk_sK, total, reject)
        h, w = self.dispatch_with_plan(x_sD, w_sK, dst, nvs_s)
        return DispatchResult(h, w, cu, dst, etc, zf, stats)

    @abc.abstractmethod
    def dispatch_with_plan(self, x_sD: Tensor, w_sK: Optional[Tensor], dst_N: Tensor,
                           nvs_s: int) -> tuple[Tensor, Tensor]:
        """Scatter with a saved plan: every entry's row x[n // K] and weight w[n] to its slot.
        Returns fresh (h [nvs_s, D], w [nvs_s] fp32); rows and weights no entry names are zero.
        Duplicate entries (same token, same destination) reuse their primary's row."""

    def dispatch_fp8(self, xq_sD: Tensor, xs_sC: Tensor, topk_sK: Tensor, w_sK: Optional[Tensor],
                     total: int, reject: str, pow2_scales: bool = False) -> DispatchFP8Result:
        """``dispatch`` of rows quantised on this rank: ``xq_sD`` float8_e4m3fn [s, D] and its
        1x128-tile scales ``xs_sC`` fp32 [s, ceil(D/128)] travel together, D + 4*ceil(D/128)
        bytes a row (2*D in bf16), into the same expert-grouped layout as ``dispatch`` (the same
        plan, the same slots; duplicates copied on the destination; padding rows and their
        scales zero).  Every received row and scale is bitwise the source's.  ``pow2_scales``:
        how the rows were quantised, for a backend that checks that every rank sends rows of
        one format.  Only backends that declare ``supports_fp8_dispatch``."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement dispatch_fp8 (its capability "
            "supports_fp8_dispatch is False)")

    @abc.abstractmethod
    def combine(self, h_MD: Tensor, w_M: Optional[Tensor], dst_N: Tensor,
                weighted: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        """y[t] = sum_k h[slot(t, k)], accumulated in fp32 (fp64 for fp64 h) in the order
        k = 0..K-1, rounded once to h's dtype ([s, D]); and w_sK[t, k] = w[slot(t, k)] when w is
        given.  ``weighted`` (w given): the terms are h[slot(t, k)] * w[slot(t, k)], each
        product in the accumulation type (the first term starts the sum: no 0 + x).
        ``h_MD`` has nvs_s or NvS rows."""

    @abc.abstractmethod
    def prefetch_weight(self, etc_RB: Tensor, local: Sequence[Tensor],
                        slots: Sequence[Tensor]) -> None:
        """slots[i][b] on rank d = owner's local[i][e % B] for e = etc[d, b] >= 0 (bitwise)."""

    @abc.abstractmethod
    def reduce_grad(self, etc_RB: Tensor, local: Sequence[Tensor],
                    slots: Sequence[Tensor]) -> None:
        """local[i][le] += the slot grads of expert rank*B + le on every rank, added one by one
        in ascending (src*B + b) in fp32 (bf16 grads: one rounding at the end); then zero this
        rank's consumed slots."""
