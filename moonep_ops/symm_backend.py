"""The CUDA data plane over symmetric memory (``libmoonep_ep.so``, csrc/ep_kernels.cu).

Every rank owns a few *symmetric regions*: the same allocation on every rank, each rank's copy
mapped into every peer, so a kernel reads or writes a peer's copy with a plain load/store
(NVLink on several GPUs, local memory on one).  A region is (local tensor, peer table), the
peer table an int64 device tensor of the R base addresses.  Regions of a Buffer (bytes):

  sig      [R] u64        barrier arrivals, written by the peers      8R
  hist     [R, E+3] i32   gathered histograms + (bad flag, s, total)  4R(E+3)
  x_stage  [S, H]         dispatch: this rank's tokens, pulled by the destinations
  desc     [NvS] i64      dispatch: stamped row descriptors, written by the sources
  wland    [NvS] f32      dispatch: route weights, written by the sources
  y_stage  [NvS, H]       combine: expert outputs, pulled by the sources   (staged mode)
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
  combine   stage h (and w), B, pull K rows per token and add in fp32 in k order, B
            (direct mode, one rank: read h where it is instead of staging it)
  prefetch  B, owners push their experts into the slots, B
  reduce    B, owners pull the slot grads and add them in ascending (src*epn+b), B, zero slots
Nothing reads device memory on the host: kernels launch on the current stream, errors (bad ids,
histograms that disagree, a barrier timeout) are OR-ed into ``err`` and read lazily by
``Buffer.check_errors()``.  So dispatch/combine/prefetch/reduce are capturable in CUDA graphs.

Heaps (where the regions come from):
  TorchSymmetricHeap   torch.distributed._symmetric_memory over a process group (one process
                       per GPU; no NVLink multicast is used or needed)
  VirtualGroup         R *virtual ranks* in one process on one GPU (tests, benchmarks, and R=1
                       without a process group): plain device allocations, every rank's copy
                       visible to all.  Each virtual rank issues its ops on its own stream;
                       since nothing blocks the host, rank 0's ops are queued before rank 1's
                       and the barriers meet on the device.
"""
from __future__ import annotations

import abc
import ctypes
import os
import threading
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _native
from .backends import Backend, _row_bytes

ERR_BAD_IDS, ERR_HIST, ERR_PLAN, ERR_TIMEOUT = 1, 2, 4, 8
_ERR_TEXT = {ERR_BAD_IDS: "a rank passed expert ids outside [0, E)",
             ERR_HIST: "a rank's histogram does not sum to s*K, or s/total_num_tokens disagree",
             ERR_PLAN: "the plan overflowed (more than epn redundant slots or a row out of range)",
             ERR_TIMEOUT: "a cross-rank barrier timed out: a peer did not call the same op"}
_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}
DEFAULT_TIMEOUT_S = float(os.environ.get("MOONEP_BARRIER_TIMEOUT_S", "60"))


def describe_errors(word: int) -> str:
    return "; ".join(text for bit, text in _ERR_TEXT.items() if word & bit) or "none"


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


class VirtualGroup:
    """R virtual ranks on one GPU in one process (see the module docstring).

    The ranks' streams must run concurrently: a rank spinning in a barrier must never sit in the
    same hardware queue ahead of the peer work it waits for.  Set CUDA_DEVICE_MAX_CONNECTIONS=32
    (the tests and benchmarks do) before CUDA starts; with the default 8 queues, streams can
    share a queue and the barrier times out instead of meeting.  Likewise CUDA_MODULE_LOADING=
    EAGER: a lazily loaded kernel's first launch may wait for the whole context, spinning peers
    included.
    """

    def __init__(self, world_size: int, device=None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.type != "cuda":
            raise ValueError("a VirtualGroup lives on a CUDA device")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._allocs: list[tuple[int, list[Tensor], Tensor]] = []
        self._count = [0] * world_size
        self._lock = threading.Lock()       # ranks may be driven from one thread each

    def heap(self, rank: int) -> "VirtualHeap":
        return VirtualHeap(self, rank)

    def backend(self, rank: int, **kw) -> "SymmBackend":
        return SymmBackend(self.heap(rank), **kw)

    def _alloc(self, rank: int, nbytes: int):
        with self._lock:
            k = self._count[rank]
            self._count[rank] += 1
            if k == len(self._allocs):
                parts = [torch.zeros(max(nbytes, 16), dtype=torch.uint8, device=self.device)
                         for _ in range(self.world_size)]
                peers = torch.tensor([p.data_ptr() for p in parts], dtype=torch.int64,
                                     device=self.device)
                # zeroed before any rank's stream uses it.  This stream only: a device-wide
                # synchronize would wait for peers spinning in a barrier for this very rank.
                torch.cuda.current_stream(self.device).synchronize()
                self._allocs.append((nbytes, parts, peers))
            size, parts, peers = self._allocs[k]
        if size != nbytes:
            raise RuntimeError(f"virtual rank {rank}: symmetric allocation #{k} of {nbytes} bytes "
                               f"does not match the other ranks' {size} bytes (ranks must create "
                               "the same Buffers and pools in the same order)")
        return parts[rank][:nbytes], peers


class VirtualHeap(SymmetricHeap):
    shared_address_space = True

    def __init__(self, group: VirtualGroup, rank: int):
        if not 0 <= rank < group.world_size:
            raise ValueError(f"rank {rank} outside [0, {group.world_size})")
        self.group, self.rank, self.world_size = group, rank, group.world_size
        self.device = group.device

    def alloc(self, nbytes):
        return self.group._alloc(self.rank, nbytes)


# ---------------------------------------------------------------------------------------------
# Library bindings
# ---------------------------------------------------------------------------------------------

_FNS = None


def _fns():
    global _FNS
    if _FNS is None:
        i, vp, i64, ll = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_longlong
        vpp = ctypes.POINTER(ctypes.c_void_p)
        d = _native.declare_ep
        _FNS = dict(
            barrier=d("moonep_ep_barrier", i, [vp, vp, i, i, vp, ll, vp]),
            hist=d("moonep_ep_hist_publish", i, [vp, i, i, i, i, i, i, vp, vp, vp]),
            send=d("moonep_ep_dispatch_send", i, [vp, i64, vp, vp, i, i, i, i, i, i, i, vp, vp, vp,
                                                  vp, vp, vp]),
            recv=d("moonep_ep_dispatch_recv", i, [vp, vp, i, i64, vp, vp, vp, i, i, vp, vp, i, vp]),
            stage=d("moonep_ep_combine_stage", i, [vp, i64, i64, vp, vp, vp, vp]),
            combine=d("moonep_ep_combine_recv", i, [vp, vp, i, i, i, i, vp, i, i, vp, vp, vp, i,
                                                    vp, vp]),
            publish=d("moonep_ep_publish_ptrs", i, [vp, i, i, vp, vp, i64, vp]),
            push=d("moonep_ep_push_weights", i, [i, vpp, vpp, ctypes.POINTER(i64), vp, i, i, i, vp,
                                                 i, vp]),
            reduce=d("moonep_ep_reduce_grads", i, [i, vpp, vpp, ctypes.POINTER(i64), vp, i, i, i,
                                                   vp, i, i, vp]),
            zero=d("moonep_ep_zero_slots", i, [i, vpp, ctypes.POINTER(i64), vp, i, i, i, vp]),
        )
    return _FNS


def _call(name: str, *args) -> None:
    _native.ep_check(_fns()[name](*args), f"moonep_ep {name}")


def _ptrs(values: Sequence[int]):
    return (ctypes.c_void_p * len(values))(*values)


# ---------------------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------------------


class SymmBackend(Backend):
    """Device-side data plane of one rank (see the module docstring).  One per Buffer."""

    device_side = True            # no host reads: the ops are capturable in CUDA graphs

    def __init__(self, heap: SymmetricHeap, *, timeout_s: Optional[float] = None,
                 planner: Optional[str] = None, combine: Optional[str] = None):
        _native.require_ep_lib()
        self.heap = heap
        self.rank, self.world_size, self.device = heap.rank, heap.world_size, heap.device
        self.group = getattr(heap, "group", None)       # a ProcessGroup (router grads, QB)
        if not hasattr(self.group, "group_name"):
            self.group = None                           # virtual ranks have no process group
        self.timeout_ns = int((DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s) * 1e9)
        # "device": csrc/plan_kernels.cu (policy moonep); "torch": moonep::plan on device tensors
        planner = planner or os.environ.get("MOONEP_PLANNER", "auto")
        if planner not in ("auto", "device", "torch"):
            raise ValueError(f"planner must be 'auto', 'device' or 'torch', got {planner!r}")
        self.planner = planner
        # combine: "stage" copies h into the symmetric y_stage for the peers to pull; "direct"
        # reads h where it is, saving one read + write of every row.  Direct is only safe with
        # one rank: with several, a peer would read a caching-allocator block that its owner
        # may hand to another stream's tensor as soon as the op returns (seen on the H200 with
        # virtual ranks: a peer summed another rank's fp32 temporary).  The reader of a
        # one-rank group is its own stream, so stream order protects the block.
        combine = combine or os.environ.get("MOONEP_COMBINE", "auto")
        if combine not in ("auto", "stage", "direct"):
            raise ValueError(f"combine must be 'auto', 'stage' or 'direct', got {combine!r}")
        one = heap.world_size == 1 and heap.shared_address_space
        if combine == "direct" and not one:
            raise ValueError("combine='direct' needs a one-rank group in this process")
        self.direct = one and combine != "stage"
        self.buf = None
        self._sym_peers: dict[int, Tensor] = {}     # data_ptr of symmetric tensors -> peers
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count

    # -- set-up (collective, once per Buffer) ---------------------------------------------------
    def _region(self, n: int, dtype: torch.dtype):
        nbytes = n * dtype.itemsize
        local, peers = self.heap.alloc(nbytes)
        return local.view(dtype), peers

    def attach(self, buf) -> None:
        if self.buf is not None:
            raise ValueError("a SymmBackend serves one Buffer; create one backend per Buffer")
        self.buf = buf
        R, E, S, NvS = buf.R, buf.E, buf.S, buf.NvS
        rb = buf.H * buf.dtype.itemsize
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
        self.err = torch.zeros(1, dtype=torch.int32, device=self.device)

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
        return int(self.err.item())

    def clear_errors(self) -> None:
        self.err.zero_()

    # -- helpers ------------------------------------------------------------------------------
    def _stream(self):
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    def barrier(self) -> None:
        _call("barrier", self.sig_peers.data_ptr(), self.epoch.data_ptr(), self.rank,
              self.world_size, self.err.data_ptr(), self.timeout_ns, self._stream())

    # -- Backend methods ----------------------------------------------------------------------
    def gather_rows(self, row: Tensor) -> Tensor:
        raise NotImplementedError("the CUDA backend plans on the device (dispatch_fresh)")

    def dispatch_fresh(self, buf, x, topk, rw, total: int):
        self._check_planner(buf)                       # before any kernel runs
        s = x.shape[0]
        R, E, K = buf.R, buf.E, buf.K
        _call("hist", topk.data_ptr(), s * K, E, self.rank, R, s, total, self.hist_peers.data_ptr(),
              self.err.data_ptr(), self._stream())
        self.barrier()
        hist_RX = self.hist.view(R, E + 3)
        dst, cu, etc, zf, stats = self._plan(buf, hist_RX, topk, total)
        h, w = self.scatter(buf, x, rw, dst, buf.nvs_s(s, total))
        return h, w, cu, dst, etc, zf, stats

    def _check_planner(self, buf) -> None:
        from . import plan_device                      # imports this module: not at the top
        if self.planner == "device":
            if not plan_device.available():
                raise RuntimeError("the device planner is not available in libmoonep_ep.so")
            if buf.policy != "moonep":
                raise ValueError(f"planner='device' plans policy 'moonep' only, the buffer's is "
                                 f"{buf.policy!r}")

    def _plan(self, buf, hist_RX, topk, total):
        from . import plan_device                      # imports this module: not at the top
        # The torch planner runs on device tensors (sync-free for both policies; many small
        # kernels).  Bad ids were flagged by the histogram kernel: clamped for its indexing.
        out, _ = plan_device.plan_from_rows(hist_RX, topk, self.rank, buf, total, self.err,
                                            device=self.planner != "torch", clamp_ids=True)
        return out

    def scatter(self, buf, x_sH, w_sK, dst_N, nvs_s):
        s = x_sH.shape[0]
        stream = self._stream()
        h = torch.empty((nvs_s, buf.H), dtype=x_sH.dtype, device=x_sH.device)
        w = torch.empty((nvs_s,), dtype=torch.float32, device=x_sH.device)
        _call("send", x_sH.data_ptr(), self.row_bytes, w_sK.data_ptr() if w_sK is not None else None,
              dst_N.data_ptr(), s, buf.K, self.rank, buf.R, buf.S, buf.NvS, nvs_s,
              self.x_stage.data_ptr(), self.desc_peers.data_ptr(), self.wland_peers.data_ptr(),
              self.epoch.data_ptr(), self.err.data_ptr(), stream)
        self.barrier()
        _call("recv", h.data_ptr(), w.data_ptr(), nvs_s, self.row_bytes, self.desc.data_ptr(),
              self.wland.data_ptr(), self.x_peers.data_ptr(), buf.R, buf.S, self.epoch.data_ptr(),
              self.err.data_ptr(), self.num_sms, stream)
        self.barrier()
        return h, w

    def gather(self, buf, h_rH, w_r, dst_N):
        n_rows = h_rH.shape[0]
        s = dst_N.numel() // buf.K
        stream = self._stream()
        w_ptr = w_r.data_ptr() if w_r is not None else None
        if self.direct:
            _call("publish", self.ptab_peers.data_ptr(), self.rank, buf.R, h_rH.data_ptr(), w_ptr,
                  n_rows, stream)
            base = self.ptab.data_ptr()
            rows_of, y_peers, w_peers = base + 16 * buf.R, base, base + 8 * buf.R
        else:
            _call("stage", h_rH.data_ptr(), n_rows, self.row_bytes, w_ptr,
                  self.y_stage.data_ptr(), self.w_stage.data_ptr(), stream)
            rows_of, y_peers, w_peers = None, self.y_peers.data_ptr(), self.w_peers.data_ptr()
        self.barrier()
        y = torch.empty((s, buf.H), dtype=h_rH.dtype, device=h_rH.device)
        w_sK = (torch.empty((s, buf.K), dtype=torch.float32, device=h_rH.device)
                if w_r is not None else None)
        _call("combine", y.data_ptr(), w_sK.data_ptr() if w_sK is not None else None, s, buf.K,
              buf.H, _DTYPE_CODE[h_rH.dtype], dst_N.data_ptr(), buf.NvS, buf.NvS, rows_of,
              y_peers, w_peers, buf.R, self.err.data_ptr(), stream)
        self.barrier()       # peers have read this rank's rows before it may reuse them
        return y, w_sK

    def _table(self, local, slots, what):
        n = len(local)
        lp = _ptrs([t.data_ptr() for t in local])
        pp = _ptrs([self._peers_of(t, what).data_ptr() for t in slots])
        rb = (ctypes.c_int64 * n)(*[_row_bytes(t) for t in local])
        return n, lp, pp, rb

    def push_weights(self, buf, etc_RB, local, slots):
        if not local:
            return
        n, lp, pp, rb = self._table(local, slots, "prefetch_weight")
        self.barrier()        # peers are done with the slots' previous contents
        _call("push", n, lp, pp, rb, etc_RB.data_ptr(), buf.R, buf.epn, self.rank,
              self.err.data_ptr(), self.num_sms, self._stream())
        self.barrier()        # every slot filled before anyone computes with it

    def reduce_grads(self, buf, etc_RB, local, slots):
        if not local:
            return
        n, lp, pp, rb = self._table(local, slots, "reduce_grad")
        self.barrier()        # every rank's slot grads are complete
        _call("reduce", n, lp, pp, rb, etc_RB.data_ptr(), buf.R, buf.epn, self.rank,
              self.err.data_ptr(), self.num_sms, _DTYPE_CODE[local[0].dtype], self._stream())
        self.barrier()        # every owner has read the slots
        sp = _ptrs([t.data_ptr() for t in slots])
        _call("zero", n, sp, rb, etc_RB.data_ptr(), buf.epn, self.rank, self.num_sms,
              self._stream())


def default_heap(group, device: torch.device) -> SymmetricHeap:
    """An initialised process group -> torch symmetric memory (one process per GPU, also for a
    group of one); no process group -> a one-rank VirtualGroup."""
    import torch.distributed as dist
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return VirtualGroup(1, device).heap(0)
    return TorchSymmetricHeap(group)
