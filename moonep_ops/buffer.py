"""``Buffer``: one EP group's state and the Python API of its data plane.

A Buffer is created once per EP group, collectively: every rank builds one with the same
arguments, in the same order.  Construction compares the ranks' settings (R, E, S, K, D,
token_padding, dtype, policy, backend, and policy "cost"'s slack and replica cost) and raises the same ValueError on every rank, naming the
field, when they differ.  The Buffer owns

  its backend (moonep_ops/backends/): the landing areas or symmetric regions of the data plane,
      sized for a rank's cap NvS = align_up(S*K + (tp-1)*2*epn, tp) rows, never R*S*K (with
      policy "cost"'s slack eps: ceil(S*K*(1+eps)) in place of S*K);
  its ExpertPools (``expert_pool``): the redundant slots' weights and grads, one per
      (D, F, dtype), shared by every MoE layer of that shape;

and ``destroy()`` frees them all (dropping the last reference to the Buffer does too); a
destroyed Buffer's methods raise ValueError.  The custom ops never see the Buffer: they take the
registered name of its backend (``Buffer.name``) and plain ints, so they trace under
``torch.compile(fullgraph=True)``.

Bad arguments reach every rank.  The methods below are collectives; an argument that fails a
check on one rank (here or in the op: a wrong dtype, shape or device, a meta tensor among real
ones, a plan of another Buffer) makes that rank raise its own error (TypeError or ValueError,
naming the argument, the op and the rank) and, on the backends whose ops start with a host
collective, take part in the op's first collective flagged, so every peer raises a ValueError
naming that rank and its reason instead of waiting (moonep_ops/ops/checks.py ``reject_call``,
``Backend.reject``).  ``expert_pool`` compares the pools' (D, F, dtype, precision, pow2 scales)
over the group, so ranks whose layers differ in precision raise the same ValueError when the
layers bind, before any row moves.

Usage (every rank)::

    buf = Buffer(S, D, K, E, group=pg, token_padding=8)
    h, w, cu_seqlens, plan = buf.dispatch(x, topk_ids, route_weights)   # [nvs_s,D] [nvs_s] [G]
    buf.prefetch_weight(plan, local_weights=[w1], slot_weights=[w1_slots])
    z = expert_ffn(h, cu_seqlens) * w[:, None]                            # caller applies weights
    y, _ = buf.combine(plan, z)                                           # [s, D]
    ...backward...
    buf.reduce_grad(plan, local_grads=[g1], slot_grads=[g1_slots])

Async mode (backends with ``supports_async``, the CUDA symmetric-memory one; eager only;
moonep_ops/comm_stream.py): every method above takes ``async_op=True`` (and optionally
``previous_event=``) to run its kernels on the Buffer's comm stream and return an extra
trailing ``EventHandle``::

    h, w, cu_seqlens, plan, ev = buf.dispatch(x, topk_ids, route_weights, async_op=True)
    other = overlapped_compute()            # current stream, runs while the data moves
    ev.wait()                               # current stream waits on the device, no host sync
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import native, registry
from .backends import Backend, make_backend
from .comm_stream import EventHandle, StreamOrder, check_async_args, check_comm_stream
from .geometry import (PPM, GroupSpec, check_cost_args, check_pool_fingerprints, pool_fingerprint,
                       rejection, slack_to_ppm)
from .gemm import plan_cost
from .ops import dispatch as _dispatch_ops  # moonep::dispatch, combine and their eager entries
from .ops.checks import ARG_ERRORS, reject_call
from .ops.moe_experts import PRECISIONS, ExpertPool
from .ops.quantize_fp8 import FP8ArgumentError
from .planner import POLICIES, Plan, make_plan


def _of_spec(name: str) -> property:
    """A read-only Buffer attribute: the field ``name`` of its GroupSpec (a lambda, not an
    attrgetter: torch.compile traces the one, not the other)."""
    return property(lambda self: getattr(self.spec, name))


class Buffer:
    """One EP group's state (see the module docstring).

    Args:
      S: capacity, the most tokens any rank passes to one ``dispatch`` (int >= 1).
      D: model dim of the token rows (int >= 1).
      K: top-k: expert ids per token (1 <= K <= 127).
      E: routed experts of the group, a multiple of the group size R.
      group: the torch.distributed process group of the EP ranks (None: the default group when
        torch.distributed is initialised, else one rank).
      token_padding: every expert segment of the receive buffer is padded to a multiple of it
        (GEMM tile alignment; 128 for the CUDA grouped GEMM's tiles).
      dtype: token-row dtype (bfloat16, float16, float32, float64).
      device: where the Buffer's tensors live (default: the current GPU for an NCCL group, else
        the CPU).
      policy: planner policy, one of ``POLICIES`` (``"moonep"``: exact MoonEP; ``"cost"``: caps
        with ``slack``, moves chosen by a predicted cost, docs/planner.md).
      slack: policy "cost": eps in [0, 1]; a rank receives at most ceil(ceil(T/R) * (1 + eps))
        token copies (NvS grows by the same factor).  0: exact caps (the plan is MoonEP's).
      expert_dim: policy "cost": the experts' FFN dim F, for the GEMM cost model (the MoE layer
        passes its hidden_dim).  Needed unless ``replica_cost`` is given.
      link_gbps: policy "cost": GB/s of one GPU's link per direction (default
        moonep_ops.gemm.links.LINK_GBPS, the H200's NVLink 4 datasheet figure).
      replica_cost: policy "cost": one replica's transfer time in token copies, overriding the
        one derived from expert_dim and link_gbps (moonep_ops.gemm.plan_cost.replica_cost);
        0 makes replication free (the plan is MoonEP's).
      backend: ``"auto"``, ``"symm"``, ``"torch"``, ``"single"`` or a ``Backend`` instance not
        yet bound (moonep_ops/backends/).
      comm_stream: async mode: None (a stream is created at the first ``async_op=True`` call),
        True (created now) or a CUDA stream of the Buffer's device.
    """

    def __init__(self, S: int, D: int, K: int, E: int, *,
                 group: Optional[dist.ProcessGroup] = None, token_padding: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device=None, policy: str = "moonep",
                 backend: str | Backend = "auto", comm_stream=None, slack: float = 0.0,
                 expert_dim: Optional[int] = None, link_gbps: Optional[float] = None,
                 replica_cost: Optional[int] = None):
        if isinstance(backend, Backend):
            be = backend
        elif isinstance(backend, str):
            be = make_backend(backend, group, device)
        else:
            raise TypeError(f"backend must be a str or a Backend, got {type(backend).__name__}")
        # Every check of this rank's arguments runs before the (collective) fingerprint
        # exchange, and a rank whose arguments fail still takes part in it (reject_bind): so
        # every rank raises, and no peer is left waiting in a collective.
        try:
            if isinstance(backend, Backend) and device is not None \
                    and torch.device(device) != be.device:
                raise ValueError(f"the backend lives on {be.device} but device={device} was given")
            if not (comm_stream is None or isinstance(comm_stream, bool)
                    or isinstance(comm_stream, (torch.Stream, torch.cuda.Stream))):
                raise TypeError("comm_stream must be None, True or a torch.cuda.Stream on the "
                                f"Buffer's device, got {type(comm_stream).__name__}")
            if not isinstance(policy, str) or policy not in POLICIES:
                raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
            slack_ppm, rc = cost_inputs(policy, slack, expert_dim, link_gbps, replica_cost,
                                        R=be.world_size, E=E, S=S, K=K,
                                        token_padding=token_padding, D=D, dtype=dtype)
            spec = GroupSpec(R=be.world_size, E=E, S=S, K=K, token_padding=token_padding, D=D,
                             dtype=dtype, policy=policy, backend=be.kind, slack_ppm=slack_ppm,
                             replica_cost=rc)
            # async mode: the comm stream (created now for True, at the first async op for None)
            order = StreamOrder(be.device, check_comm_stream(comm_stream, be.device, be))
        except (TypeError, ValueError) as e:
            be.reject_bind(e)
            raise
        self.spec = spec
        self.backend = be
        self.device = be.device
        self._order = order
        be.bind(self.spec)                  # collective: fingerprints compared, state allocated
        self.name = registry.register(be, "backend")
        self._pools: dict[tuple, ExpertPool] = {}
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            # The zero fills of the set-up ran on the current stream; the ops may later run on
            # other streams (a comm stream, a virtual rank's stream), which never wait for this
            # one.  A recycled block still holding an old Buffer's barrier counter then let a
            # barrier pass early.  Set-up only, once per Buffer.
            torch.cuda.current_stream(self.device).synchronize()

    # -- geometry: the spec's, read-only (Python ints, the dtype, the policy and its inputs) ---
    R, E, S, K, D, epn, G, NvS = map(_of_spec, ("R", "E", "S", "K", "D", "epn", "G", "NvS"))
    token_padding, dtype, policy, slack_ppm, replica_cost = map(
        _of_spec, ("token_padding", "dtype", "policy", "slack_ppm", "replica_cost"))
    slack = property(lambda self: self.spec.slack_ppm / PPM)
    rank = property(lambda self: self.backend.rank)
    group = property(lambda self: self.backend.group)

    def nvs_s(self, s, total_num_tokens: Optional[int] = -1):
        """Receive rows this call (works on SymInts)."""
        return self.spec.nvs_s(s, total_num_tokens)

    @property
    def capturable(self) -> bool:
        """True when the data plane never reads device memory on the host (CUDA graphs)."""
        return self.backend.capturable

    @property
    def comm_stream(self):
        """The stream async ops run on (None until the first ``async_op=True`` call unless the
        Buffer was created with ``comm_stream=``)."""
        return self._order.comm

    def capture(self) -> EventHandle:
        """An EventHandle recorded now on the current stream (for ``previous_event=``)."""
        check_async_args(self, True, None)
        cur = torch.cuda.current_stream(self.device)
        ev = torch.cuda.Event()
        ev.record(cur)
        return EventHandle(ev, cur)

    def symmetric_zeros(self, shape, dtype: torch.dtype) -> Tensor:
        """Collective: a zeroed tensor the peers can address (slot weights / slot grads for
        prefetch_weight / reduce_grad).  A plain tensor on backends that need none."""
        self._check_live("symmetric_zeros")
        return self.backend.symmetric_zeros(shape, dtype)

    def expert_pool(self, D: int, F: int, dtype: torch.dtype, precision: str = "bf16",
                    pow2_scales: bool = False, expert_settings: tuple = ()) -> ExpertPool:
        """Collective, every call (every rank calls it in the same order with the same
        arguments, as its layers bind): this Buffer's redundant-slot pool for experts of model
        dim D and FFN dim F (built once per (D, F, dtype, precision), shared by every layer of
        that shape, freed by ``destroy``).  ``precision`` "fp8": the slots hold e4m3 weights and
        their 128 x 128 block scales (moonep_ops/ops/moe_experts_fp8.py); the slot grads stay
        in ``dtype``.  ``pow2_scales``: the layer's FP8 scale rounding (fp8_pow2_scales).
        ``expert_settings``: the layer's (expert_bias, activation, swiglu_alpha, swiglu_limit,
        fp8_wgrad), compared only (geometry.EXPERT_SETTINGS says why).

        The ranks' (D, F, dtype, precision, pow2_scales, expert_settings) are compared first (one host exchange,
        set-up only): ranks whose layers differ (one misconfigured launch) raise the same
        ValueError, naming the field and every rank's value, instead of moving rows and slot
        weights of different bytes later (gloo aborts the process on such an all-to-all; the
        CUDA backend would read garbage).  A rank whose own arguments are invalid still takes
        part (its peers raise a ValueError naming it)."""
        self._check_live("expert_pool")
        try:
            for name, v in (("D", D), ("F", F)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"expert_pool: {name} must be a positive int, got {v!r}")
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise TypeError(f"expert_pool: dtype must be a floating torch.dtype, got {dtype!r}")
            if precision not in PRECISIONS:
                raise ValueError(f"expert_pool: precision must be one of {PRECISIONS}, got "
                                 f"{precision!r}")
            if not isinstance(pow2_scales, bool):
                raise TypeError(f"expert_pool: pow2_scales must be a bool, got "
                                f"{type(pow2_scales).__name__}")
        except ARG_ERRORS as e:
            self.reject_expert_pool(e)
            raise type(e)(f"{e} (rank {self.rank})").with_traceback(e.__traceback__) from None
        check_pool_fingerprints(self.backend.exchange_fingerprints(
            pool_fingerprint(D, F, dtype, precision, pow2_scales, expert_settings)))
        key = (D, F, dtype, precision)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = ExpertPool(self.backend, self.name, D, F, dtype, precision)
        return pool

    def reject_expert_pool(self, error: BaseException) -> None:
        """Collective, in place of ``expert_pool`` on a rank whose arguments (or whose layer's
        settings) failed a local check: it sends a rejection through the pools' exchange, so
        every peer raises a ValueError naming this rank and ``error`` instead of waiting in
        it.  The caller then raises its own error."""
        self._check_live("expert_pool")
        self.backend.exchange_fingerprints(rejection(f"{type(error).__name__}: {error}"))

    def check_errors(self) -> None:
        """Raise if a device kernel flagged an error: ``native.DataPlaneTimeout`` (a
        ``TimeoutError``) naming the op and the rank it waited for when a cross-rank barrier
        timed out, else ``native.DataPlaneError`` (bad ids, histograms that disagree, plan
        overflow).  Reads the device: a host sync, so call it at logging points, not inside
        captured code.  Host backends raise eagerly and have no error word."""
        self._order.drain()                   # async ops in flight write the error word too
        word, op, peer = self.backend.error_details()
        if not word:
            return
        msg = (f"moonep data plane error on rank {self.rank}: {native.describe_errors(word)} "
               f"(error word {word:#x})")
        if word & native.ERR_TIMEOUT:
            msg += (f"; the first timeout was in {op or 'an unknown op'}, waiting for rank {peer} "
                    f"(timeout {self.backend.timeout_ns / 1e9:g} s): rank {peer} did not reach the "
                    "same op, or died")
            raise native.DataPlaneTimeout(msg, word, op, peer)
        raise native.DataPlaneError(msg, word)

    @property
    def alive(self) -> bool:
        return self.name is not None

    def _check_live(self, op: str) -> None:
        # A ValueError, the misuse type of every other argument check (a destroyed Buffer is a
        # bad argument of the call); raised here only, no peer is told (a peer may have
        # destroyed its Buffer too: a collective could wait forever).
        if self.name is None:
            raise ValueError(f"Buffer.{op}: this moonep Buffer (rank {self.rank}) was destroyed; "
                             "build a new one")

    def destroy(self) -> None:
        """Free the Buffer's pools and backend state and unregister it (idempotent).  Every rank,
        after its last op: until then a peer may still read them."""
        if self.name is None:
            return
        if self._order.active and torch.cuda.is_available():
            self._order.drain()               # later frees on this stream follow async ops
        for pool in self._pools.values():
            pool.release()
        self._pools.clear()
        registry.unregister(self.name)
        self.backend.release()
        self.name = None

    def __repr__(self):
        return (f"Buffer(R={self.R}, E={self.E}, S={self.S}, K={self.K}, D={self.D}, "
                f"tp={self.token_padding}, NvS={self.NvS}, dtype={self.dtype}, "
                f"backend={type(self.backend).__name__}, name={self.name!r})")

    # -- plan checks ---------------------------------------------------------------------------
    def _check_plan(self, plan) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a moonep_ops.Plan, got {type(plan).__name__}")
        spec = self.spec                # its fields, not the Buffer's properties: per call
        mine = (self.backend.rank, spec.R, spec.E, spec.S, spec.K, spec.token_padding, spec.NvS,
                spec.slack_ppm)
        theirs = (plan.rank, plan.R, plan.E, plan.S, plan.K, plan.token_padding, plan.NvS,
                  plan.slack_ppm)
        if mine != theirs:
            raise ValueError(
                "the plan was made for another Buffer or rank: (rank, R, E, S, K, token_padding, "
                f"NvS, slack_ppm) = {theirs}, this Buffer has {mine}")
        if plan.nvs_s != spec.nvs_s(plan.s, plan.total_num_tokens):
            raise ValueError(f"plan.nvs_s={plan.nvs_s} is inconsistent with s={plan.s}, "
                             f"total_num_tokens={plan.total_num_tokens}")

    # -- the data plane -----------------------------------------------------------------------
    def _refuse(self, op: str, first: str, error: BaseException) -> BaseException:
        """A Buffer method's argument error (checked before the op): reaches the peers through
        the op's first collective (ops/checks.py reject_call); the exception to raise here."""
        return reject_call(self.backend, op, first, error)

    def _run(self, launch, inputs, async_op: bool, previous_event, mutated=()):
        """launch() on the current stream, or (async_op) on the comm stream -> (result, handle).
        The synchronous path is the plain call for Buffers that never used the async mode, and
        always under torch.compile (nothing here is traced then)."""
        if async_op:
            return self._order.run_async(launch, inputs, previous_event, mutated)
        if not torch.compiler.is_compiling() and self._order.active:
            self._order.before_sync()           # after this Buffer's async ops in flight
            result = launch()
            self._order.after_sync()
            return result, None
        return launch(), None

    def dispatch(self, x_sD: Tensor, topk_ids_sK: Optional[Tensor] = None,
                 route_weights_sK: Optional[Tensor] = None, *,
                 total_num_tokens: Optional[int] = None, plan: Optional[Plan] = None,
                 async_op: bool = False, previous_event=None):
        """Scatter this rank's tokens to their experts' slots (collective).

        Fresh form: ``dispatch(x, topk_ids, route_weights=None, total_num_tokens=None)``
        all-gathers the [E] histograms, plans, and scatters.  Reuse form:
        ``dispatch(x, route_weights_sK=None, plan=plan)`` scatters with a saved plan (x must
        have the plan's s rows).  Returns ``(h [nvs_s, D], w [nvs_s] fp32 or None,
        cu_seqlens [2*epn] int32, plan)``; padding rows/weights and rows past cu_seqlens[-1]
        are zero.  Differentiable in x and route_weights.

        ``async_op=True`` (CUDA symmetric-memory backend, eager): the kernels run on the
        Buffer's comm stream after ``previous_event`` (default: after the current stream), and
        an ``EventHandle`` is appended to the result; wait on it before using the outputs.
        """
        self._check_live("dispatch")
        try:
            if async_op is not False or previous_event is not None:
                check_async_args(self, async_op, previous_event)
            if plan is not None:
                if topk_ids_sK is not None or total_num_tokens is not None:
                    raise ValueError("dispatch with plan= takes neither topk_ids nor "
                                     "total_num_tokens")
                self._check_plan(plan)
                if isinstance(x_sD, Tensor) and x_sD.dim() >= 1 and x_sD.shape[0] != plan.s:
                    raise ValueError(f"the plan was made for s={plan.s} tokens but x has "
                                     f"{x_sD.shape[0]}: a plan can only be reused with the "
                                     "same s")
            else:
                if topk_ids_sK is None:
                    raise ValueError("dispatch needs topk_ids (or plan= to reuse a plan)")
                tot = _total(total_num_tokens)
        except ARG_ERRORS as e:
            raise self._refuse("dispatch", "dispatch" if plan is None else "dispatch_with_plan",
                               e) from None
        if plan is not None:

            def reuse():
                return _dispatch_ops.dispatch_with_plan(x_sD, route_weights_sK, plan.dst,
                                                        self.name, plan.total_num_tokens)

            (h, w), ev = self._run(reuse, (x_sD, route_weights_sK, plan.dst), async_op,
                                   previous_event)
            out = (h, (w if route_weights_sK is not None else None), plan.cu_seqlens, plan)
            return out + (ev,) if async_op else out

        return self._fresh(lambda: _dispatch_ops.dispatch(x_sD, topk_ids_sK, route_weights_sK,
                                                          self.name, tot),
                           (x_sD, topk_ids_sK, route_weights_sK), route_weights_sK, tot,
                           async_op, previous_event)

    def _fresh(self, launch, inputs, route_weights_sK, tot: int, async_op: bool, previous_event):
        """The fresh dispatch of every precision: run the op, then its plan tensors (the op's
        last five outputs) and this Buffer's ints make the Plan (planner.make_plan, the one
        constructor).  Returns (the rows' outputs..., w or None, cu_seqlens, plan[, handle])."""
        outs, ev = self._run(launch, inputs, async_op, previous_event)
        rows, w = outs[:-6], outs[-6]
        cu, dst, etc, zf, stats = outs[-5:]
        p = make_plan((dst, cu, etc, zf, stats), self.spec, self.rank, inputs[0].shape[0], tot)
        out = (*rows, (w if route_weights_sK is not None else None), cu, p)
        return out + (ev,) if async_op else out

    def dispatch_fp8(self, x_sD: Tensor, topk_ids_sK: Tensor,
                     route_weights_sK: Optional[Tensor] = None, *,
                     total_num_tokens: Optional[int] = None, pow2_scales: bool = False,
                     async_op: bool = False, previous_event=None):
        """``dispatch`` with the rows in FP8 (collective; moonep::dispatch_fp8).

        ``x`` is quantised once on this rank, one fp32 scale per 1 x 128 tile of a row (rounded
        up to a power of two with ``pow2_scales``), and each e4m3 row travels with its scales:
        D + 4*ceil(D/128) bytes a row instead of D*sizeof(dtype).  Returns ``(h [nvs_s, D]
        float8_e4m3fn, h_scale [nvs_s, ceil(D/128)] fp32, w [nvs_s] fp32 or None,
        cu_seqlens [G] int32, plan)``: the slots, plan and padding of ``dispatch`` (padding
        rows and their scales zero).  Not differentiable (``x`` and the route weights are
        detached); the plan serves ``combine`` and ``dispatch(plan=...)`` as usual.
        ``async_op=True``: as in ``dispatch``.  Needs a backend with ``supports_fp8_dispatch``.
        """
        self._check_live("dispatch_fp8")
        try:
            if async_op is not False or previous_event is not None:
                check_async_args(self, async_op, previous_event)
            tot = _total(total_num_tokens)
            if not isinstance(pow2_scales, bool):   # the op's schema would coerce an int silently
                raise FP8ArgumentError(f"dispatch_fp8: pow2_scales must be a bool, got "
                                       f"{type(pow2_scales).__name__}")
        except ARG_ERRORS as e:
            raise self._refuse("dispatch_fp8", "dispatch_fp8", e) from None
        x_in = x_sD.detach() if isinstance(x_sD, Tensor) else x_sD
        w_in = route_weights_sK.detach() if isinstance(route_weights_sK, Tensor) else route_weights_sK

        return self._fresh(lambda: torch.ops.moonep.dispatch_fp8(x_in, topk_ids_sK, w_in,
                                                                 self.name, tot, pow2_scales),
                           (x_in, topk_ids_sK, w_in), route_weights_sK, tot, async_op,
                           previous_event)

    def combine(self, plan: Plan, h_MD: Tensor, w_M: Optional[Tensor] = None, *,
                weighted: bool = False, async_op: bool = False, previous_event=None):
        """Sum every token's K expert outputs back on its source rank (collective).

        ``h`` has the rows dispatch returned for ``plan`` (nvs_s, or NvS).  Returns
        ``(y [s, D] in h's dtype, w [s, K] fp32 or None)``; the K rows are added in fp32 in the
        order k = 0..K-1 and rounded once.  ``weighted=True`` (``w_M`` required) applies the
        route weights: each row is multiplied by its weight in fp32 before it is added, so
        ``y[t] = dtype(sum_k fp32(h[slot]) * w[slot])`` (the MoE layer's route-weight step);
        otherwise they are not applied.  Differentiable (in h and w_M).
        ``async_op=True``: as in ``dispatch``, ``(y, w, EventHandle)``.
        """
        self._check_live("combine")
        try:
            if async_op is not False or previous_event is not None:
                check_async_args(self, async_op, previous_event)
            self._check_plan(plan)
        except ARG_ERRORS as e:
            raise self._refuse("combine", "combine", e) from None

        def launch():
            return _dispatch_ops.combine(h_MD, w_M, plan.dst, self.name, plan.total_num_tokens,
                                         weighted)

        (y, w), ev = self._run(launch, (h_MD, w_M, plan.dst), async_op, previous_event)
        out = (y, (w if w_M is not None else None))
        return out + (ev,) if async_op else out

    def prefetch_weight(self, plan: Plan, *, local_weights: Sequence[Tensor],
                        slot_weights: Sequence[Tensor], async_op: bool = False,
                        previous_event=None) -> Optional[EventHandle]:
        """Owners push their experts' weights into the redundant slots (collective).

        Each ``local_weights[i]`` is this rank's [epn, ...] home experts, ``slot_weights[i]``
        this rank's [epn, ...] slots; slot b of rank d receives the owner's local[e % epn] for
        e = experts_to_copy[d, b]; slots with -1 are untouched.  Not differentiable.
        ``async_op=True``: returns an ``EventHandle`` (wait before reading the slots or writing
        the local weights); otherwise None.
        """
        return self._slot_op("prefetch_weight", ("local_weights", "slot_weights"), plan,
                             local_weights, slot_weights, async_op, previous_event,
                             writes_local=False)

    def reduce_grad(self, plan: Plan, *, local_grads: Sequence[Tensor],
                    slot_grads: Sequence[Tensor], async_op: bool = False,
                    previous_event=None) -> Optional[EventHandle]:
        """Owners add their experts' slot grads from every rank into the local grads (collective).

        [epn, ...] tensors, all fp32 or all bf16.  local[le] += slot grads of expert
        rank*epn + le, one by one in ascending (src*epn + b), summed in fp32 (bf16: rounded once);
        then every rank zeroes its own consumed slots.
        ``async_op=True``: returns an ``EventHandle`` (wait before reading either list);
        otherwise None.
        """
        return self._slot_op("reduce_grad", ("local_grads", "slot_grads"), plan, local_grads,
                             slot_grads, async_op, previous_event, writes_local=True)

    def _slot_op(self, op: str, names: tuple, plan: Plan, local_in, slots_in, async_op: bool,
                 previous_event, writes_local: bool) -> Optional[EventHandle]:
        """prefetch_weight / reduce_grad: the same checks, launch and stream handling; they differ
        in the op and in what it writes (the slots; reduce_grad the local grads too)."""
        self._check_live(op)
        try:
            if async_op is not False or previous_event is not None:
                check_async_args(self, async_op, previous_event)
            self._check_plan(plan)
            local = _tensor_list(op, names[0], local_in)
            slots = _tensor_list(op, names[1], slots_in)
        except ARG_ERRORS as e:
            raise self._refuse(op, op, e) from None
        fn = getattr(torch.ops.moonep, op)

        def launch():
            fn(plan.experts_to_copy, local, slots, self.name)

        _, ev = self._run(launch, (plan.experts_to_copy, local, slots), async_op, previous_event,
                          mutated=local + slots if writes_local else slots)
        return ev


def _total(total_num_tokens) -> int:
    """total_num_tokens as the ops take it: -1 when every rank passes the same s."""
    tot = -1 if total_num_tokens is None else total_num_tokens
    if not isinstance(tot, int) or isinstance(tot, bool):
        raise TypeError(f"total_num_tokens must be an int or None, got {type(tot).__name__}")
    return tot


def cost_inputs(policy: str, slack, expert_dim, link_gbps, replica_cost, *, R: int, E: int,
                S: int, K: int, token_padding: int, D: int, dtype: torch.dtype
                ) -> tuple[int, int]:
    """(slack_ppm, replica_cost) of a Buffer: policy "cost"'s planner inputs, derived on the
    host from the static shapes (no data); (0, 0) for the other policies."""
    slack_ppm = slack_to_ppm(slack)
    if policy != "cost":
        if slack_ppm or link_gbps is not None or replica_cost is not None:
            raise ValueError(f"slack, link_gbps and replica_cost are settings of policy 'cost'; "
                             f"policy {policy!r} plans exact caps")
        return 0, 0
    if link_gbps is not None and (isinstance(link_gbps, bool)
                                  or not isinstance(link_gbps, (int, float))
                                  or not link_gbps > 0):
        raise ValueError(f"link_gbps must be a positive number (GB/s), got {link_gbps!r}")
    if replica_cost is None:
        if isinstance(expert_dim, bool) or not isinstance(expert_dim, int) or expert_dim < 1:
            raise ValueError("policy 'cost' needs expert_dim (the experts' FFN dim F, for the "
                             f"GEMM cost model) or replica_cost, got expert_dim={expert_dim!r}")
        if E % R:          # GroupSpec names this error; the cost model needs E/R experts
            return slack_ppm, 0
        replica_cost = plan_cost.replica_cost(
            D, expert_dim, R=R, E=E, S=S, K=K, token_padding=token_padding, dtype=dtype,
            link_gbps=link_gbps).copies
    check_cost_args(policy, slack_ppm, replica_cost)
    return slack_ppm, replica_cost


def _tensor_list(op: str, name: str, tensors) -> list[Tensor]:
    """A list or tuple of tensors, detached.  A bare tensor is refused: iterating it would pass
    its rows as the list (an [epn, epn] weight would silently become epn row tensors)."""
    if isinstance(tensors, Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list or tuple of tensors, got "
                        f"{type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"{op}: {name}[{i}] must be a tensor, got {type(t).__name__}")
    return [t.detach() for t in tensors]
