"""Virtual EP ranks on one GPU for tests and benchmarks (moonep_ops.backends.VirtualGroup).

``run_threads(R, fn)`` runs ``fn(rank)`` for every rank in its own thread and CUDA stream, so a
rank's host reads (result checks) never stop the other ranks from queueing the work its device
barriers wait for.  Everything rank-independent (inputs, references) is a pure function of
seeds, so every thread can rebuild every rank's inputs.

Each thread first makes its own cuBLAS handle (symm.prime_thread), and no rank starts before
every thread has: a thread's first cuBLAS call blocks until the device is idle, and the device
is not idle while a rank spins in a barrier waiting for that thread's rank (symm.VirtualGroup).
"""
from __future__ import annotations

import threading
import traceback

import torch

from moonep_ops.backends.symm import prime_thread


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
