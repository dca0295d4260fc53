"""``Buffer``: one EP group's persistent state and the Python API of the data plane.

A Buffer is created once per EP group (collectively: every rank builds one with the same
arguments, in the same order).  It owns every persistent tensor the data plane needs, so a
compiled function never receives them as inputs:

  recv_rows     [NvS, H]  dtype  landing rows of the all-to-all (dispatch rows, combine replies)
  recv_meta     [NvS, 3]  int64  landing of the per-entry slot metadata of dispatch
  recv_weights  [NvS]     fp32   landing of the gathered route weights of combine

NvS = align_up(S*K + (tp-1)*2*epn, tp): a rank receives at most its cap of S*K token copies,
never R*S*K (docs/planner.md).  The Buffer registers itself under a unique name string; the
``torch.ops.moonep.*`` ops take that name plus plain ints and look the Buffer up, so they trace
under ``torch.compile(fullgraph=True)``.

Usage (every rank)::

    buf = Buffer(S, H, K, E, group=pg, token_padding=8)
    h, w, cu_seqlens, plan = buf.dispatch(x, topk_ids, route_weights)   # [nvs_s,H] [nvs_s] [G]
    buf.prefetch_weight(plan, local_weights=[w1], slot_weights=[w1_slots])
    z = expert_ffn(h, cu_seqlens) * w[:, None]                            # caller applies weights
    y, _ = buf.combine(plan, z)                                           # [s, H]
    ...backward...
    buf.reduce_grad(plan, local_grads=[g1], slot_grads=[g1_slots])

Async mode (CUDA symmetric-memory backend, eager only; moonep_ops/comm_stream.py, docs/api.md):
every method above takes ``async_op=True`` (and optionally ``previous_event=``) to run its
kernels on the Buffer's comm stream and return an extra trailing ``EventHandle``::

    h, w, cu_seqlens, plan, ev = buf.dispatch(x, topk_ids, route_weights, async_op=True)
    other = overlapped_compute()            # current stream, runs while the data moves
    ev.wait()                               # current stream waits on the device, no host sync
"""
from __future__ import annotations

import itertools
import weakref
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .backends import Backend, make_backend, resolve_device
from .comm_stream import EventHandle, StreamOrder, check_async_args, check_comm_stream
from .geometry import Geometry
from .planner import POLICIES, Plan

_REGISTRY: "weakref.WeakValueDictionary[str, Buffer]" = weakref.WeakValueDictionary()
_IDS = itertools.count()


def lookup(name: str) -> "Buffer":
    """The live Buffer registered under ``name`` (what the custom ops receive)."""
    buf = _REGISTRY.get(name)
    if buf is None:
        raise ValueError(f"no live moonep Buffer named {name!r} (destroyed or never created)")
    return buf


class Buffer:
    """Persistent state of one EP group.  See the module docstring."""

    def __init__(self, S: int, H: int, K: int, E: int, *, group: Optional[dist.ProcessGroup] = None,
                 token_padding: int = 1, dtype: torch.dtype = torch.bfloat16,
                 device=None, policy: str = "moonep", backend: str | Backend = "auto",
                 comm_stream=None):
        if not (comm_stream is None or isinstance(comm_stream, bool)
                or hasattr(comm_stream, "wait_event")):
            raise TypeError("comm_stream must be None, True or a torch.cuda.Stream on the Buffer's "
                            f"device, got {type(comm_stream).__name__}")
        if isinstance(backend, Backend):
            self.backend = backend
        elif isinstance(backend, str):
            self.backend = make_backend(backend, group, device)
        else:
            raise TypeError(f"backend must be a str or a Backend, got {type(backend).__name__}")
        R = self.backend.world_size
        self.geo = Geometry(R=R, E=E, S=S, K=K, token_padding=token_padding)
        if not isinstance(H, int) or isinstance(H, bool) or H < 1:
            raise ValueError(f"H must be a positive int, got {H!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        be_dev = getattr(self.backend, "device", None)
        if device is None and be_dev is not None:
            device = be_dev
        self.device = resolve_device(device, getattr(self.backend, "group", None))
        if be_dev is not None and torch.device(be_dev) != self.device:
            raise ValueError(f"the backend lives on {be_dev} but device={self.device} was given")
        self.H, self.dtype, self.policy = H, dtype, policy
        # async mode: the comm stream (created now for True, at the first async op for None)
        self._order = StreamOrder(self.device, check_comm_stream(comm_stream, self.device,
                                                                 self.backend))
        NvS = self.geo.NvS
        # Landing areas of the collective backends (device backends own symmetric regions).
        self.recv_rows = self.recv_meta = self.recv_weights = None
        if not getattr(self.backend, "device_side", False):
            self.recv_rows = torch.zeros((NvS, H), dtype=dtype, device=self.device)
            self.recv_meta = torch.zeros((NvS, 3), dtype=torch.long, device=self.device)
            self.recv_weights = torch.zeros((NvS,), dtype=torch.float32, device=self.device)
        self.name = f"moonep_buffer_{next(_IDS)}"
        _REGISTRY[self.name] = self
        if hasattr(self.backend, "attach"):
            self.backend.attach(self)          # device backends allocate their regions here
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            # The zero fills above ran on the current stream; the ops may later run on other
            # streams (a comm stream, a virtual rank's stream), which never wait for this one.
            # A recycled block still holding an old Buffer's barrier counter (backend.epoch)
            # then let a barrier pass early: a flaky async test that failed only after other
            # tests had run.  Set-up only, once per Buffer.
            torch.cuda.current_stream(self.device).synchronize()

    # -- geometry (Python ints) ---------------------------------------------------------------
    R = property(lambda self: self.geo.R)
    E = property(lambda self: self.geo.E)
    S = property(lambda self: self.geo.S)
    K = property(lambda self: self.geo.K)
    epn = property(lambda self: self.geo.epn)
    G = property(lambda self: self.geo.G)
    NvS = property(lambda self: self.geo.NvS)
    token_padding = property(lambda self: self.geo.token_padding)
    rank = property(lambda self: self.backend.rank)

    def nvs_s(self, s, total_num_tokens: Optional[int] = -1):
        """Receive rows this call (works on SymInts: fake kernels call it)."""
        K, R, tp = self.K, self.R, self.token_padding
        if total_num_tokens is None or total_num_tokens == -1:
            cap = s * K                           # ceil(R*s*K / R)
        else:
            cap = (total_num_tokens * K + R - 1) // R
        return (cap + (tp - 1) * self.G + tp - 1) // tp * tp

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

    @property
    def capturable(self) -> bool:
        """True when the data plane never reads device memory on the host (CUDA graphs)."""
        return bool(getattr(self.backend, "device_side", False))

    def symmetric_zeros(self, shape, dtype: torch.dtype) -> Tensor:
        """Collective: a zeroed tensor the peers can address (slot weights / slot grads for
        prefetch_weight / reduce_grad).  A plain tensor on backends that need none."""
        if hasattr(self.backend, "symmetric_zeros"):
            return self.backend.symmetric_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def check_errors(self) -> None:
        """Raise if a device kernel flagged an error (bad ids, histograms that disagree, a
        barrier timeout).  Reads one int from the device: a host sync, so call it at logging
        points, not inside captured code.  No-op for host backends (they raise eagerly)."""
        if hasattr(self.backend, "error_word"):
            self._order.drain()               # async ops in flight write the error word too
            word = self.backend.error_word()
            if word:
                from .symm_backend import describe_errors
                raise RuntimeError(f"moonep data plane error on rank {self.rank}: "
                                   f"{describe_errors(word)} (error word {word:#x})")

    def destroy(self) -> None:
        """Unregister and drop the persistent tensors (idempotent)."""
        if self._order.active and torch.cuda.is_available():
            self._order.drain()               # later frees on this stream follow async ops
        _REGISTRY.pop(self.name, None)
        self.recv_rows = self.recv_meta = self.recv_weights = None
        if hasattr(self.backend, "release"):
            self.backend.release()             # device backends drop their symmetric regions

    def __repr__(self):
        return (f"Buffer(R={self.R}, E={self.E}, S={self.S}, K={self.K}, H={self.H}, "
                f"tp={self.token_padding}, NvS={self.NvS}, dtype={self.dtype}, "
                f"backend={type(self.backend).__name__}, name={self.name!r})")

    # -- plan checks ---------------------------------------------------------------------------
    def _check_plan(self, plan) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a moonep_ops.Plan, got {type(plan).__name__}")
        mine = (self.rank, self.R, self.E, self.S, self.K, self.token_padding, self.NvS)
        theirs = (plan.rank, plan.R, plan.E, plan.S, plan.K, plan.token_padding, plan.NvS)
        if mine != theirs:
            raise ValueError(
                "the plan was made for another Buffer or rank: (rank, R, E, S, K, token_padding, "
                f"NvS) = {theirs}, this Buffer has {mine}")
        if plan.nvs_s != self.nvs_s(plan.s, plan.total_num_tokens):
            raise ValueError(f"plan.nvs_s={plan.nvs_s} is inconsistent with s={plan.s}, "
                             f"total_num_tokens={plan.total_num_tokens}")

    # -- the data plane -----------------------------------------------------------------------
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

    def dispatch(self, x_sH: Tensor, topk_ids_sK: Optional[Tensor] = None,
                 route_weights_sK: Optional[Tensor] = None, *,
                 total_num_tokens: Optional[int] = None, plan: Optional[Plan] = None,
                 async_op: bool = False, previous_event=None):
        """Scatter this rank's tokens to their experts' slots (collective).

        Fresh form: ``dispatch(x, topk_ids, route_weights=None, total_num_tokens=None)``
        all-gathers the [E] histograms, plans, and scatters.  Reuse form:
        ``dispatch(x, route_weights_sK=None, plan=plan)`` scatters with a saved plan (x must
        have the plan's s rows).  Returns ``(h [nvs_s, H], w [nvs_s] fp32 or None,
        cu_seqlens [2*epn] int32, plan)``; padding rows/weights and rows past cu_seqlens[-1]
        are zero.  Differentiable in x and route_weights.

        ``async_op=True`` (CUDA symmetric-memory backend, eager): the kernels run on the
        Buffer's comm stream after ``previous_event`` (default: after the current stream), and
        an ``EventHandle`` is appended to the result; wait on it before using the outputs.
        """
        if async_op is not False or previous_event is not None:
            check_async_args(self, async_op, previous_event)
        if plan is not None:
            if topk_ids_sK is not None or total_num_tokens is not None:
                raise ValueError("dispatch with plan= takes neither topk_ids nor total_num_tokens")
            self._check_plan(plan)
            if isinstance(x_sH, Tensor) and x_sH.dim() >= 1 and x_sH.shape[0] != plan.s:
                raise ValueError(f"the plan was made for s={plan.s} tokens but x has "
                                 f"{x_sH.shape[0]}: a plan can only be reused with the same s")

            def reuse():
                return torch.ops.moonep.dispatch_with_plan(x_sH, route_weights_sK, plan.dst,
                                                           self.name, plan.total_num_tokens)

            (h, w), ev = self._run(reuse, (x_sH, route_weights_sK, plan.dst), async_op,
                                   previous_event)
            out = (h, (w if route_weights_sK is not None else None), plan.cu_seqlens, plan)
            return out + (ev,) if async_op else out
        if topk_ids_sK is None:
            raise ValueError("dispatch needs topk_ids (or plan= to reuse a plan)")
        tot = -1 if total_num_tokens is None else total_num_tokens
        if not isinstance(tot, int) or isinstance(tot, bool):
            raise TypeError(f"total_num_tokens must be an int or None, got {type(tot).__name__}")

        def fresh():
            return torch.ops.moonep.dispatch(x_sH, topk_ids_sK, route_weights_sK, self.name, tot)

        (h, w, cu, dst, etc, zf, stats), ev = self._run(
            fresh, (x_sH, topk_ids_sK, route_weights_sK), async_op, previous_event)
        s = x_sH.shape[0]
        p = Plan(dst, cu, etc, zf, stats, rank=self.rank, R=self.R, E=self.E, S=self.S, K=self.K,
                 s=s, token_padding=self.token_padding, total_num_tokens=tot, NvS=self.NvS,
                 nvs_s=self.nvs_s(s, tot))
        out = (h, (w if route_weights_sK is not None else None), cu, p)
        return out + (ev,) if async_op else out

    def combine(self, plan: Plan, h_nvsH: Tensor, w_nvs: Optional[Tensor] = None, *,
                async_op: bool = False, previous_event=None):
        """Sum every token's K expert outputs back on its source rank (collective).

        ``h`` has the rows dispatch returned for ``plan`` (nvs_s, or NvS).  Returns
        ``(y [s, H] in h's dtype, w [s, K] fp32 or None)``; the K rows are added in fp32 in the
        order k = 0..K-1 and rounded once.  Route weights are not applied.  Differentiable.
        ``async_op=True``: as in ``dispatch``, ``(y, w, EventHandle)``.
        """
        if async_op is not False or previous_event is not None:
            check_async_args(self, async_op, previous_event)
        self._check_plan(plan)

        def launch():
            return torch.ops.moonep.combine(h_nvsH, w_nvs, plan.dst, self.name,
                                            plan.total_num_tokens)

        (y, w), ev = self._run(launch, (h_nvsH, w_nvs, plan.dst), async_op, previous_event)
        out = (y, (w if w_nvs is not None else None))
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
        if async_op is not False or previous_event is not None:
            check_async_args(self, async_op, previous_event)
        self._check_plan(plan)
        local = [t.detach() for t in local_weights]
        slots = [t.detach() for t in slot_weights]

        def launch():
            torch.ops.moonep.prefetch_weight(plan.experts_to_copy, local, slots, self.name)

        _, ev = self._run(launch, (plan.experts_to_copy, local, slots), async_op, previous_event,
                          mutated=slots)
        return ev

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
        if async_op is not False or previous_event is not None:
            check_async_args(self, async_op, previous_event)
        self._check_plan(plan)
        local = [t.detach() for t in local_grads]
        slots = [t.detach() for t in slot_grads]

        def launch():
            torch.ops.moonep.reduce_grad(plan.experts_to_copy, local, slots, self.name)

        _, ev = self._run(launch, (plan.experts_to_copy, local, slots), async_op, previous_event,
                          mutated=local + slots)
        return ev


from . import dispatch_combine as _dispatch_combine  # noqa: E402,F401  (registers the ops)
from . import expert_weights as _expert_weights  # noqa: E402,F401
