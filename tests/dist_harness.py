"""Run many test cases inside ONE spawn of R gloo ranks (process start-up costs seconds).

    results = run_cases(R, "test_data_plane", ["case_a", "case_b"], timeout_s=120)
    results["case_a"].ok, results["case_a"].error

Each case is a module-level function ``case(ctx)`` of the named module (``ctx`` has rank, R,
group, device).  backend="gloo" (CPU tensors, CI) or "nccl" (rank r on cuda:r; the cases put
their tensors on ``ctx.device``).  A case raises (AssertionError or anything) to fail on that rank.  After every case
the ranks all-gather their ok flags, so every rank knows the verdict; a case that fails on one
rank only is reported with that rank's traceback.  If the flag exchange itself fails (a rank
died or the group is wedged after a collective timed out) the remaining cases are reported as
not run.  The process group has a timeout, and the parent kills the workers at the deadline,
so a bug shows up as a failed test instead of a hung CI job.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib
import json
import os
import tempfile
import time
import traceback
from typing import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclasses.dataclass
class CaseResult:
    ok: bool
    error: str = ""
    seconds: float = 0.0


@dataclasses.dataclass
class Ctx:
    rank: int
    R: int
    group: object
    device: torch.device


def _worker(rank: int, R: int, init_file: str, module: str, cases: Sequence[str],
            out_dir: str, pg_timeout_s: float, backend: str) -> None:
    torch.set_num_threads(1)
    results = {}
    out_path = os.path.join(out_dir, f"rank{rank}.json")

    def flush():
        with open(out_path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(out_path + ".tmp", out_path)

    try:
        device = torch.device("cpu")
        kw = {}
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            kw["device_id"] = device
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=R, timeout=datetime.timedelta(seconds=pg_timeout_s),
                                **kw)
        mod = importlib.import_module(module)
        ctx = Ctx(rank=rank, R=R, group=dist.group.WORLD, device=device)
        for name in cases:
            t0 = time.time()
            err = ""
            try:
                getattr(mod, name)(ctx)
            except BaseException:                      # noqa: BLE001 - report, never hang
                err = f"[rank {rank}] " + traceback.format_exc()
            flags = [None] * R
            try:
                dist.all_gather_object(flags, (not err, err))
            except BaseException:                      # noqa: BLE001
                results[name] = dict(ok=False, error=err or "flag exchange failed",
                                     seconds=time.time() - t0)
                flush()
                return
            errors = [e for ok, e in flags if not ok]
            results[name] = dict(ok=not errors, error="\n".join(errors), seconds=time.time() - t0)
            flush()
        dist.barrier()
    except BaseException:                              # noqa: BLE001
        results["__worker__"] = dict(ok=False, error=traceback.format_exc(), seconds=0.0)
        flush()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_cases(R: int, module: str, cases: Sequence[str], *, timeout_s: float = 300.0,
              pg_timeout_s: float = 60.0, backend: str = "gloo") -> dict[str, CaseResult]:
    """Spawn R ranks once, run every case in order, return {case: CaseResult} (rank-merged)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="moonep_dist_") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, R, init_file, module, list(cases), tmp, pg_timeout_s,
                                   backend))
                 for r in range(R)]
        for p in procs:
            p.start()
        deadline = time.time() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.time()))
        timed_out = any(p.is_alive() for p in procs)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        per_rank = []
        for r in range(R):
            path = os.path.join(tmp, f"rank{r}.json")
            per_rank.append(json.load(open(path)) if os.path.exists(path) else {})
    out: dict[str, CaseResult] = {}
    why = "timed out" if timed_out else "worker died"
    for name in cases:
        got = [pr.get(name) for pr in per_rank]
        if all(g is not None for g in got):
            errs = [g["error"] for g in got if not g["ok"]]
            out[name] = CaseResult(ok=not errs, error=errs[0] if errs else "",
                                   seconds=max(g["seconds"] for g in got))
        else:
            worker = [pr.get("__worker__", {}).get("error", "") for pr in per_rank]
            out[name] = CaseResult(ok=False, error=f"case not finished on every rank ({why}, "
                                   f"exit codes {[p.exitcode for p in procs]}):\n"
                                   + "\n".join(w for w in worker if w))
    return out



# MOONEP_TEST_DIST=nccl runs the same cases with one GPU per rank (R <= visible GPUs).
DIST_BACKEND = os.environ.get("MOONEP_TEST_DIST", "gloo")


def multi_rank_cases(namespace: dict, only_at: dict | None = None, ranks=(1, 2, 4, 8)):
    """[(R, case name)] for every ``case_*`` function in a test module's namespace; a case
    named in ``only_at`` runs only at the R listed there."""
    only_at = only_at or {}
    usable = tuple(R for R in ranks
                   if DIST_BACKEND == "gloo" or R <= torch.cuda.device_count())
    return [(R, n) for R in usable for n in sorted(namespace)
            if n.startswith("case_") and R in only_at.get(n, usable)]


def cached_runner(module: str, multi_rank, **run_kw):
    """R -> {case: CaseResult}: one spawn of R ranks runs all of that R's cases, once."""
    @functools.lru_cache(maxsize=None)
    def results(R):
        return run_cases(R, module, [n for r, n in multi_rank if r == R],
                         backend=DIST_BACKEND, **run_kw)
    return results
