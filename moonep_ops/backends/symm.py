"""The CUDA data plane over symmetric memory (``libmoonep_ep.so``, csrc/ep_kernels.cu).

Every rank owns a few *symmetric regions*: the same allocation on every rank, each rank's copy
mapped into every peer, so a kernel reads or writes a peer's copy with a plain load/store
(NVLink on several GPUs, local memory on one).  A region is (local tensor, peer table), the
peer table an int64 device tensor of the R base addresses.  Regions of a Buffer (bytes):

  sig      [R] u64        barrier arrivals, written by the peers      8R
  hist     [R, E+3] i32   gathered histograms + (bad flag, s, total)  4R(E+3)
  x_stage  [S, D]         dispatch: this rank's tokens, pulled by the destinations
  desc     [NvS] i64      dispatch: stamped row descriptors, written by the sources
  wland    [NvS] f32      dispatch: route weights, written by the sources
  y_stage  [NvS, D]       combine: expert outputs, pulled by the sources   (staged mode)
  w_stage  [NvS] f32      combine: route weights, pulled by the sources    (staged mode)
  ptab     [3, R] i64     combine: h, w addresses and rows                 (direct mode, R=1)
plus local (non-symmetric) ``epoch`` (u64 barrier counter) and ``err`` (i32 error word).
ExpertPool slot weights and slot grads are symmetric too (``symmetric_zeros``): prefetch pushes
into the peers' slots, reduce_grad pulls from them.

Protocol per op (B = barrier; every op ends with one, so no staging region is overwritten while
a peer still reads it):
  dispatch  hist publish, B, plan (device), stage x + send descriptors/weights, B,
            pull rows + fill duplicates locally + zero the rest, B
  dispatch_with_plan   stage x + send, B, pull, B
  combine   stage h (and w), B, pull K rows per token (weighted: times their weights) and
            add in fp32 in k order, B
            (direct mode, one rank: read h where it is instead of staging it)
  prefetch  B, owners push their experts into the slots, B
  reduce    B, owners pull the slot grads and add them in ascending (src*epn+b), B, zero slots
Nothing reads device memory on the host: kernels launch on the current stream, errors (bad ids,
histograms that disagree, a barrier timeout) are OR-ed into ``err`` and read lazily by
``Buffer.check_errors()``.  So dispatch/combine/prefetch/reduce are capturable in CUDA graphs.

Heaps (where the regions come from):
  TorchSymmetricHeap   torch.distributed._symmetric_memory over a process group (one process
                       per GPU; no NVLink multicast is used or needed)
  LocalHeap            a one-rank group without a process group: plain device allocations
  (R virtual ranks on one GPU in one process, for tests and benchmarks, are
  moonep_ops.testing.virtual_ranks.VirtualGroup, a heap of the same contract)
"""
from __future__ import annotations

import abc
import ctypes
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import native
from .. import settings
from ..geometry import GroupSpec, ceil_div
from ..runtime import current_raw_stream
from .. import planner as _plan
from .base import Backend, DispatchFP8Result
from .collective import _row_bytes

_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}
DEFAULT_TIMEOUT_S = float(settings.get("MOONEP_BARRIER_TIMEOUT_S"))


# ---------------------------------------------------------------------------------------------
# Heaps
# ---------------------------------------------------------------------------------------------


class SymmetricHeap(abc.ABC):
    rank: int
    world_size: int
    device: torch.device
    shared_address_space = False    # True: every rank's ordinary tensors are addressable too

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> tuple[Tensor, Tensor]:
        """Collective: a zeroed uint8 [nbytes] region -> (local copy, int64 peer table [R])."""

    @abc.abstractmethod
    def exchange(self, obj) -> list:
        """Collective (host, set-up only): every rank's picklable ``obj`` in rank order."""


class TorchSymmetricHeap(SymmetricHeap):
    """Regions from ``torch.distributed._symmetric_memory`` (one process per GPU)."""

    def __init__(self, group=None):
        import torch.distributed as dist
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self._handles = []           # keep the rendezvous handles (and mappings) alive

    def alloc(self, nbytes):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        if hasattr(symm_mem, "enable_symm_mem_for_group"):       # required before torch 2.8
            try:
                symm_mem.enable_symm_mem_for_group(self.group.group_name)
            except Exception:                                   # noqa: BLE001  (already on)
                pass
        t = symm_mem.empty(max(nbytes, 16), dtype=torch.uint8, device=self.device)
        t.zero_()
        handle = symm_mem.rendezvous(t, self.group.group_name)
        self._handles.append(handle)
        peers = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=self.device)
        torch.cuda.current_stream(self.device).synchronize()
        dist.barrier(group=self.group)   # every copy zeroed before any peer writes (setup only)
        return t[:nbytes], peers

    def exchange(self, obj):
        import torch.distributed as dist
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out



class LocalHeap(SymmetricHeap):
    """A one-rank group in this process (a Buffer on a GPU without a process group): plain
    device allocations, the rank's own copy its whole peer table."""
    shared_address_space = True
    rank, world_size = 0, 1

    def __init__(self, device: torch.device):
        self.device = device

    def alloc(self, nbytes):
        t = torch.zeros(max(nbytes, 16), dtype=torch.uint8, device=self.device)
        peers = torch.tensor([t.data_ptr()], dtype=torch.int64, device=self.device)
        torch.cuda.current_stream(self.device).synchronize()   # zeroed before any stream uses it
        return t[:nbytes], peers

    def exchange(self, obj):
        return [obj]

# ---------------------------------------------------------------------------------------------
# Library bindings
# ---------------------------------------------------------------------------------------------

def _call(name: str, *args) -> None:
    """One data-plane launcher of libmoonep_ep.so (prototypes: moonep_ops/native.py).  The
    message is only formatted on an error: a dispatch makes six of these calls."""
    rc = getattr(native.require_ep(), "ep_" + name)(*args)
    if rc:
        native.ep_check(rc, f"moonep_ep_{name}")


# Tensors one push_weights / reduce_grads / zero_slots launch takes (csrc/ep_kernels.cu, kMaxT).
_MAX_TENSORS = 8


def _ptrs(values: Sequence[int]):
    return (ctypes.c_void_p * len(values))(*values)


# ---------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------


class SymmBackend(Backend):
    """Device-side data plane of one rank (see the module docstring).  One per Buffer."""

    kind = "symm"
    capturable = True             # no host reads: the ops are capturable in CUDA graphs
    supports_async = True
    supports_fp8_dispatch = True  # packed e4m3 rows + scales through the byte-row kernels

    def __init__(self, heap: SymmetricHeap, *, timeout_s: Optional[float] = None,
                 planner: Optional[str] = None, combine: Optional[str] = None):
        native.require_ep()
        self.heap = heap
        self.rank, self.world_size, self.device = heap.rank, heap.world_size, heap.device
        # the torch process group (router grads, QB); virtual ranks have none
        self.group = heap.group if isinstance(heap, TorchSymmetricHeap) else None
        self.timeout_ns = int((DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s) * 1e9)
        # "device": csrc/plan_kernels.cu (policies moonep, cost); "torch": moonep::plan on device
        # tensors
        planner = planner or settings.get("MOONEP_PLANNER")
        if planner not in ("auto", "device", "torch"):
            raise ValueError(f"planner must be 'auto', 'device' or 'torch', got {planner!r}")
        self.planner = planner
        # combine: "stage" copies h into the symmetric y_stage for the peers to pull; "direct"
        # reads h where it is, saving one read + write of every row.  Direct is only safe with
        # one rank: with several, a peer would read a caching-allocator block that its owner
        # may hand to another stream's tensor as soon as the op returns (seen on the H200 with
        # virtual ranks: a peer summed another rank's fp32 temporary).  The reader of a
        # one-rank group is its own stream, so stream order protects the block.
        combine = combine or settings.get("MOONEP_COMBINE")
        if combine not in ("auto", "stage", "direct"):
            raise ValueError(f"combine must be 'auto', 'stage' or 'direct', got {combine!r}")
        one = heap.world_size == 1 and heap.shared_address_space
        if combine == "direct" and not one:
            raise ValueError("combine='direct' needs a one-rank group in this process")
        self.direct = one and combine != "stage"
        self._sym_peers: dict[int, Tensor] = {}     # data_ptr of symmetric tensors -> peers
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count

    # -- set-up (collective, once per Buffer) ---------------------------------------------------
    def _region(self, n: int, dtype: torch.dtype):
        nbytes = n * dtype.itemsize
        local, peers = self.heap.alloc(nbytes)
        return local.view(dtype), peers

    def exchange_fingerprints(self, fingerprint):
        return self.heap.exchange(fingerprint)

    def _allocate(self, spec: GroupSpec) -> None:
        R, E, S, NvS = spec.R, spec.E, spec.S, spec.NvS
        rb = spec.D * spec.dtype.itemsize
        self.row_bytes = rb
        self.sig, self.sig_peers = self._region(R, torch.int64)
        self.hist, self.hist_peers = self._region(R * (E + 3), torch.int32)
        self.x_stage, self.x_peers = self._region(S * rb, torch.uint8)
        self.desc, self.desc_peers = self._region(NvS, torch.int64)
        self.wland, self.wland_peers = self._region(NvS, torch.float32)
        if self.direct:
            self.ptab, self.ptab_peers = self._region(3 * R, torch.int64)
        else:
            self.y_stage, self.y_peers = self._region(NvS * rb, torch.uint8)
            self.w_stage, self.w_peers = self._region(NvS, torch.float32)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=self.device)
        # The planner kernels' shared-memory limits, set now rather than at the first dispatch
        # (a host call on the op path less; not the cause of docs/multi_gpu.md's timeouts).
        with torch.cuda.device(self.device):
            native.ep_check(native.require_ep().plan_prepare(), "moonep_plan_prepare")
        # [word, op of the first timeout, missing peer + 1, epoch]: csrc/moonep_ep.h
        self.err = torch.zeros(4, dtype=torch.int32, device=self.device)

    _REGIONS = ("sig", "sig_peers", "hist", "hist_peers", "x_stage", "x_peers", "desc",
                "desc_peers", "wland", "wland_peers", "ptab", "ptab_peers", "y_stage", "y_peers",
                "w_stage", "w_peers")

    def release(self) -> None:
        """Drop this Buffer's regions (Buffer.destroy; idempotent).  Call it on every rank after
        the last op: until then a peer may still read them."""
        for name in self._REGIONS:
            if hasattr(self, name):
                setattr(self, name, None)
        self._sym_peers.clear()

    def symmetric_zeros(self, shape, dtype: torch.dtype) -> Tensor:
        """Collective: a zeroed tensor every peer can address (ExpertPool slots)."""
        n = 1
        for d in shape:
            n *= int(d)
        local, peers = self._region(n, dtype)
        t = local.view(*shape)
        self._sym_peers[t.data_ptr()] = peers
        return t

    def _peers_of(self, t: Tensor, what: str) -> Tensor:
        peers = self._sym_peers.get(t.data_ptr())
        if peers is None:
            raise ValueError(f"{what}: the CUDA symmetric-memory backend needs slot tensors "
                             "allocated with Buffer.symmetric_zeros(...) (peers write into them)")
        return peers

    # -- errors -------------------------------------------------------------------------------
    def error_word(self) -> int:
        """Reads the device error word (a host sync: call it at logging points)."""
        return int(self.err[0].item())

    def error_details(self) -> tuple[int, str, int]:
        """(word, op of the first barrier timeout or "", the peer it waited for or -1); one host
        read."""
        word, op, peer, _ = self.err.tolist()
        return word, native.BARRIER_OPS.get(op, ""), peer - 1

    def clear_errors(self) -> None:
        self.err.zero_()

    # -- helpers ------------------------------------------------------------------------------
    def _stream(self) -> int:
        """The current stream of the Buffer's device (a raw cudaStream_t); each op reads it
        once and passes it to every launch and barrier it makes."""
        return current_raw_stream(self.device)

    def barrier(self, what: str, stream: Optional[int] = None) -> None:
        """One cross-rank barrier on ``stream`` (default: the current one); ``what`` names it
        (native.BARRIER_CODE) for a timeout's report.

        A one-rank group has no peer to wait for: stream order already puts every launch after
        the previous one, so only the "sent" barrier runs there, for its epoch (dispatch_send
        stamps the descriptors with the epoch after it, which dispatch_recv checks).  That is
        13 of the 15 barrier launches of a bf16 layer step at R = 1."""
        if self.world_size == 1 and what != "sent":
            return
        _call("barrier", self.sig_peers.data_ptr(), self.epoch.data_ptr(), self.rank,
              self.world_size, self.err.data_ptr(), self.timeout_ns, native.BARRIER_CODE[what],
              self._stream() if stream is None else stream)

    # -- Backend methods ----------------------------------------------------------------------
    def _plan(self, x_sD, topk_sK, total, reject):
        spec = self.spec
        if reject:        # the peers' barriers time out (the device exchange has no flag)
            raise ValueError(f"moonep dispatch: {reject} (rank {self.rank})")
        if self.planner == "device" and spec.policy not in _plan.DEVICE_POLICIES:
            raise ValueError(f"planner='device' plans the policies {_plan.DEVICE_POLICIES} "
                             f"only, the Buffer's is {spec.policy!r}")
        if self.planner == "device" and spec.policy == "cost":
            why = _plan.cost_device_limit(spec.R, spec.E, spec.slack_ppm)
            if why is not None:      # "auto" plans these with the torch reference
                raise ValueError(f"planner='device' cannot plan policy 'cost' with a slack for "
                                 f"{why}; use planner='torch' or 'auto'")
        if self.planner == "device" and not _plan.device_planner_available():
            raise RuntimeError("the device planner is not available in libmoonep_ep.so")
        # Histogram exchange, planning and the input checks run on the device: bad input sets
        # the error word (Buffer.check_errors) instead of a host read.
        s = x_sD.shape[0]
        R, E, K = spec.R, spec.E, spec.K
        stream = self._stream()
        _call("hist_publish", topk_sK.data_ptr(), s * K, E, self.rank, R, s, total,
              self.hist_peers.data_ptr(), self.err.data_ptr(), stream)
        self.barrier("hist", stream)
        hist_RX = self.hist.view(R, E + 3)
        # The torch planner (planner="torch", or a policy the device planner lacks) runs on
        # device tensors: sync-free, many small kernels.  Ids the histogram kernel flagged as
        # bad are clamped so its indexing stays in bounds.
        outs, _ = _plan.plan_from_rows(hist_RX, topk_sK, self.rank, spec, total, self.err,
                                       device=self.planner != "torch", clamp_ids=True)
        return outs, spec.nvs_s(s, total)

    def dispatch_fp8(self, xq_sD, xs_sC, topk_sK, w_sK, total, reject, pow2_scales=False):
        # The data plane moves rows as bytes (csrc/ep_kernels.cu: dispatch_send stages s rows of
        # row_bytes, dispatch_recv / dispatch_dups copy and zero whole rows), so an FP8 row and
        # its scales travel as one packed row of D + 4*ceil(D/128) bytes through the same
        # kernels; the Buffer's staging rows (D * sizeof(dtype) bytes) hold it.
        D = xq_sD.shape[1]
        rb = D + 4 * ceil_div(D, 128)      # ops/quantize_fp8.fp8_row_bytes (a layer above)
        if rb > self.row_bytes:
            raise ValueError(f"moonep dispatch_fp8: a packed FP8 row ({rb} bytes) does not fit "
                             f"the Buffer's staging rows of {self.row_bytes} bytes")
        (dst, cu, etc, zf, stats), nvs_s = self._plan(xq_sD, topk_sK, total, reject)
        packed = torch.cat([xq_sD.view(torch.uint8), xs_sC.view(torch.uint8)], 1)
        hp = torch.empty((nvs_s, rb), dtype=torch.uint8, device=xq_sD.device)
        w = self._scatter(packed, rb, w_sK, dst, hp)
        h = hp[:, :D].contiguous().view(xq_sD.dtype)
        hs = hp[:, D:].contiguous().view(xs_sC.dtype)
        return DispatchFP8Result(h, hs, w, cu, dst, etc, zf, stats)

    def dispatch_with_plan(self, x_sD, w_sK, dst_N, nvs_s):
        h = torch.empty((nvs_s, self.spec.D), dtype=x_sD.dtype, device=x_sD.device)
        return h, self._scatter(x_sD, self.row_bytes, w_sK, dst_N, h)

    def _scatter(self, x_rows, row_bytes, w_sK, dst_N, h):
        """The s rows of ``x_rows`` (contiguous, ``row_bytes`` bytes each) and the weights to
        their slots: fills ``h`` (nvs_s rows of ``row_bytes``), returns w [nvs_s] fp32."""
        spec = self.spec
        s, nvs_s = x_rows.shape[0], h.shape[0]
        stream = self._stream()
        w = torch.empty((nvs_s,), dtype=torch.float32, device=x_rows.device)
        _call("dispatch_send", x_rows.data_ptr(), row_bytes,
              w_sK.data_ptr() if w_sK is not None else None, dst_N.data_ptr(), s, spec.K,
              self.rank, spec.R, spec.S, spec.NvS, nvs_s, self.x_stage.data_ptr(),
              self.desc_peers.data_ptr(), self.wland_peers.data_ptr(), self.epoch.data_ptr(),
              self.err.data_ptr(), stream)
        self.barrier("sent", stream)
        _call("dispatch_recv", h.data_ptr(), w.data_ptr(), nvs_s, row_bytes,
              self.desc.data_ptr(), self.wland.data_ptr(), self.x_peers.data_ptr(), spec.R, spec.S,
              self.epoch.data_ptr(), self.err.data_ptr(), self.num_sms, stream)
        self.barrier("received", stream)
        return w

    def combine(self, h_MD, w_M, dst_N, weighted=False):
        spec = self.spec
        n_rows = h_MD.shape[0]
        s = dst_N.numel() // spec.K
        stream = self._stream()
        w_ptr = w_M.data_ptr() if w_M is not None else None
        if self.direct:
            _call("publish_ptrs", self.ptab_peers.data_ptr(), self.rank, spec.R, h_MD.data_ptr(),
                  w_ptr, n_rows, stream)
            base = self.ptab.data_ptr()
            rows_of, y_peers, w_peers = base + 16 * spec.R, base, base + 8 * spec.R
        else:
            _call("combine_stage", h_MD.data_ptr(), n_rows, self.row_bytes, w_ptr,
                  self.y_stage.data_ptr(), self.w_stage.data_ptr(), stream)
            rows_of, y_peers, w_peers = None, self.y_peers.data_ptr(), self.w_peers.data_ptr()
        self.barrier("staged", stream)
        y = torch.empty((s, spec.D), dtype=h_MD.dtype, device=h_MD.device)
        w_sK = (torch.empty((s, spec.K), dtype=torch.float32, device=h_MD.device)
                if w_M is not None else None)
        _call("combine_recv", y.data_ptr(), w_sK.data_ptr() if w_sK is not None else None, s,
              spec.K, spec.D, _DTYPE_CODE[h_MD.dtype], int(weighted), dst_N.data_ptr(), spec.NvS,
              spec.NvS,
              rows_of, y_peers, w_peers, spec.R, self.err.data_ptr(), stream)
        self.barrier("gathered", stream)   # peers have read this rank's rows before their reuse
        return y, w_sK

    def _slot_exchange(self, what, kernel, before, after, etc_RB, local, slots, *dtype):
        """Barrier ``before``, the kernel over every (home tensor, slot tensor) pair, barrier
        ``after``.  The kernel takes at most _MAX_TENSORS pairs (csrc/ep_kernels.cu kMaxT: an
        FP8 expert with biases has 9), so longer lists are launched in groups between the same
        two barriers.  Returns [(n, slot tensors, row bytes)] per group and the stream, for
        a follow-up launch."""
        stream = self._stream()
        self.barrier(before, stream)
        groups = []
        for i in range(0, len(local), _MAX_TENSORS):
            lo, sl = local[i:i + _MAX_TENSORS], slots[i:i + _MAX_TENSORS]
            n = len(lo)
            lp = _ptrs([t.data_ptr() for t in lo])
            pp = _ptrs([self._peers_of(t, what).data_ptr() for t in sl])
            rb = (ctypes.c_int64 * n)(*[_row_bytes(t) for t in lo])
            _call(kernel, n, lp, pp, rb, etc_RB.data_ptr(), self.spec.R, self.spec.epn,
                  self.rank, self.err.data_ptr(), self.num_sms, *dtype, stream)
            groups.append((n, sl, rb))
        self.barrier(after, stream)
        return groups, stream

    def prefetch_weight(self, etc_RB, local, slots):
        # slots_free: peers are done with the slots' previous contents; slots_filled: every slot
        # is filled before anyone computes with it
        if local:
            self._slot_exchange("prefetch_weight", "push_weights", "slots_free", "slots_filled",
                                etc_RB, local, slots)

    def reduce_grad(self, etc_RB, local, slots):
        # grads_complete: every rank's slot grads are complete; grads_read: every owner has read
        # the slots, which are zeroed then
        if not local:
            return
        groups, stream = self._slot_exchange("reduce_grad", "reduce_grads", "grads_complete",
                                             "grads_read", etc_RB, local, slots,
                                             _DTYPE_CODE[local[0].dtype])
        for n, sl, rb in groups:
            _call("zero_slots", n, _ptrs([t.data_ptr() for t in sl]), rb, etc_RB.data_ptr(),
                  self.spec.epn, self.rank, self.num_sms, stream)
