"""Virtual EP ranks: R ranks of the CUDA backend in one process on one GPU (tests, benchmarks).

``VirtualGroup(R)`` is a symmetric heap (backends/symm.py) of plain device allocations, every
rank's copy visible to all; ``vg.backend(rank)`` is rank ``rank``'s ``SymmBackend``.  Each
virtual rank issues its ops on its own stream; since nothing blocks the host, rank 0's ops are
queued before rank 1's and the barriers meet on the device.

``run_threads(R, fn)`` runs ``fn(rank)`` for every rank in its own thread and CUDA stream, so a
rank's host reads (result checks) never stop the other ranks from queueing the work its device
barriers wait for.  Everything rank-independent (inputs, references) is a pure function of
seeds, so every thread can rebuild every rank's inputs.

All ranks share one CUDA context, so the CUDA stack's first-time steps that wait for the whole
device are run before any rank exists: once per device (``_prime_device``, from VirtualGroup)
and once per rank thread (``prime_thread``, from run_threads); docs/multi_gpu.md has the
measurements.
"""
from __future__ import annotations

import ctypes
import threading
import traceback

import torch
from torch import Tensor

from .. import native
from .. import settings
from ..backends.symm import SymmBackend, SymmetricHeap
from ..ops.grouped_mm import grouped_mm


_PRIMED: set[int] = set()
_CU_MODULE_LAZY_LOADING = 2          # CUmoduleLoadingMode (CU_MODULE_EAGER_LOADING is 1)


def _module_loading_is_lazy() -> bool:
    """The driver's module loading mode (fixed when CUDA starts: CUDA_MODULE_LOADING)."""
    mode = ctypes.c_int(0)
    try:
        rc = ctypes.CDLL("libcuda.so.1").cuModuleGetLoadingMode(ctypes.byref(mode))
    except (OSError, AttributeError):          # no driver API to ask: assume the env var holds
        return settings.get("CUDA_MODULE_LOADING").upper() != "EAGER"
    return rc == 0 and mode.value == _CU_MODULE_LAZY_LOADING


def _prime_device(device: torch.device) -> None:
    """Once per device and process, before any virtual rank exists: run to completion the
    first-time steps of the CUDA stack that wait for the whole device.  Measured on the H200
    with eager module loading (diagnostics/host_block_probe.py; docs/multi_gpu.md):
      - the process's first dtype cast or first reduction kernel is held on the device until
        every running kernel has finished (the host call returns at once); one of them
        releases the other, so it is a one-time step, not one per kernel;
      - the first cuBLAS GEMM blocks the host for ~3 s, until the device is idle;
      - so does loading this project's GEMM library (_prime_libraries);
      - fills, arange, elementwise arithmetic, cat, new allocator segments: not held.
    A virtual rank spinning in a barrier is a running kernel, so such a step queued before the
    other ranks' work holds that work back until the barrier times out (R = 8 in a fresh
    process: rank 0's histogram barrier, 6 of 6 runs).  One process per GPU is not exposed:
    its peers are other devices, and the step costs one stall."""
    if device.index in _PRIMED:
        return
    with torch.cuda.device(device):
        s = torch.cuda.Stream(device)
        with torch.cuda.stream(s):
            prime_thread(device)
            _prime_libraries(device)
    _PRIMED.add(device.index)


def _prime_libraries(device: torch.device) -> None:
    """Load libmoonep_ep.so and libmoonep_gemm.so and run one small grouped GEMM and the
    route-weight kernels to completion.
    Loading a library registers its kernels with the context, and that waits for the whole
    device: in fresh processes on the H200 the layer case's rank threads blocked in the GEMM
    library's first load (and every other rank thread's launch behind it) while peers spun in
    dispatch's barrier, until it timed out (4 of 4 runs; diagnostics/virtual_rank_timeouts.py
    fresh, thread stacks).  The route-weight kernels are Triton's, whose first call compiles and
    loads a module, so they are loaded here too; that alone is not enough: the R = 8 layer case
    of tests/test_virtual_ranks_fresh_cuda.py still times out on the H100 with them (barrier in
    dispatch or combine, rank 0 absent; 2026-12-06, cause not found)."""
    native.ep()
    rows = torch.zeros(16, 128, dtype=torch.bfloat16, device=device)
    w_M = torch.zeros(16, dtype=torch.float32, device=device)
    torch.ops.moonep.scale_rows(rows, w_M)
    torch.ops.moonep.scale_rows_backward(rows, w_M, rows)
    if native.gemm() is not None:
        x = torch.zeros(256, 128, dtype=torch.bfloat16, device=device)
        w = torch.zeros(1, 128, 128, dtype=torch.bfloat16, device=device)
        cu = torch.tensor([128, 256], dtype=torch.int32, device=device)
        grouped_mm(x, w, w.clone(), cu)
    torch.cuda.current_stream(device).synchronize()


def prime_thread(device: torch.device) -> None:
    """A 64 x 64 bf16 GEMM, a cast and a reduction, forward and backward, and two small copies
    between host and device, on the current stream, run to completion: the calling thread's
    cuBLAS handle and the autograd engine's (its device thread runs every backward) exist
    afterwards.  Call it from each thread that queues a virtual rank's work, before any rank
    starts (run_threads): a thread's first cuBLAS call waits for the device, and the device is
    busy with a spinning barrier."""
    a = torch.ones(64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    (a @ a).float().sum().backward()
    # and a pageable host-to-device and device-to-host copy (a rank's inputs and results): in a
    # fresh process without the primes, rank 1's first input copy blocked the host until rank
    # 0's barrier timed out (diagnostics/virtual_rank_timeouts.py fresh_noprime)
    torch.ones(16).to(device).cpu()
    torch.cuda.current_stream(device).synchronize()


class VirtualGroup:
    """R virtual ranks on one GPU in one process (see the module docstring).

    All ranks share one CUDA context, and a rank spinning in a device barrier waits for work
    the other ranks queue later; anything that makes the device or the host wait for running
    kernels before that work is queued stalls every rank until the barrier times out.  So:
      - the ranks' streams must not share a hardware queue: set CUDA_DEVICE_MAX_CONNECTIONS=32
        before CUDA starts (the tests and benchmarks do; with the default 8, two streams can
        share one, and a spinning kernel blocks the peer queued behind it);
      - CUDA_MODULE_LOADING=EAGER (checked here): with lazy loading every kernel's first launch
        may wait for the whole context;
      - the CUDA stack's first-time steps that wait for the device run here, once per device
        (_prime_device);
      - work queued from one thread per rank: each thread's first cuBLAS call creates its
        handle, so prime each thread before any rank starts (run_threads).
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
        if world_size > 1 and _module_loading_is_lazy():
            raise RuntimeError(
                "virtual ranks need CUDA_MODULE_LOADING=EAGER, set before CUDA starts: with "
                "lazy loading a kernel's first launch can wait for a peer rank spinning in a "
                "barrier on the same GPU, and the barrier times out (docs/multi_gpu.md)")
        _prime_device(self.device)
        self._allocs: list[tuple[int, list[Tensor], Tensor]] = []
        self._count = [0] * world_size
        self._posted: list[list] = []            # k-th exchange: what each rank posted
        self._xcount = [0] * world_size
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

    def _exchange(self, rank: int, obj) -> list:
        """Ranks are driven one after another from one thread, so no rank can wait for the
        others: each posts its k-th object, and a rank whose object differs from one posted
        earlier sees the earlier ones (the later rank raises; ranks not yet built are shown as
        their own value)."""
        with self._lock:
            k = self._xcount[rank]
            self._xcount[rank] += 1
            while len(self._posted) <= k:
                self._posted.append([None] * self.world_size)
            self._posted[k][rank] = obj
            return [obj if o is None else o for o in self._posted[k]]


class VirtualHeap(SymmetricHeap):
    shared_address_space = True

    def __init__(self, group: VirtualGroup, rank: int):
        if not 0 <= rank < group.world_size:
            raise ValueError(f"rank {rank} outside [0, {group.world_size})")
        self.group, self.rank, self.world_size = group, rank, group.world_size
        self.device = group.device

    def alloc(self, nbytes):
        return self.group._alloc(self.rank, nbytes)

    def exchange(self, obj):
        return self.group._exchange(self.rank, obj)


def run_threads(R: int, fn, timeout_s: float = 180.0):
    streams = [torch.cuda.Stream() for _ in range(R)]
    results, errors = [None] * R, [None] * R
    primed = threading.Barrier(R, timeout=timeout_s)

    def work(r):
        try:
            with torch.cuda.stream(streams[r]):
                prime_thread(streams[r].device)
                primed.wait()
                results[r] = fn(r)
            streams[r].synchronize()
        except BaseException as e:           # noqa: BLE001  (re-raised below)
            primed.abort()                   # no thread waits for a rank that cannot start
            errors[r] = (e, traceback.format_exc())

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(R)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if alive:
        raise TimeoutError(f"virtual ranks {alive} still running after {timeout_s} s")
    for r, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"virtual rank {r} failed:\n{e[1]}") from e[0]
    return results
