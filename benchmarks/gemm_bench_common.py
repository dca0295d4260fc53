"""Shared pieces of the grouped-GEMM benchmarks (bench_gemm_zoo.py, fit_gemm_cost_model.py).

* ``gemm_modules()``: the cost model (moonep_ops/gemm/cost_model.py), its tuning constants
  (gemm/tuning.py) and the ops module (ops/grouped_mm.py); it also finds them under the flat
  module names of older trees (moonep_ops.gemm_cost_model, .gemm_tuning, .grouped_gemm), so a
  benchmark can run against an older checkout.
* ``time_interleaved()``: the timing method of benchmarks/bench_grouped_gemm.py (contenders
  interleaved round robin with a rotating order, CUDA events, warm-up, median per contender),
  extended for small problems: each sample is ``k`` back-to-back launches between one pair of
  events, and a round starts behind a GPU spin (``torch.cuda._sleep``) long enough for the host to
  enqueue the whole round, so a sample measures device time, not the host's launch cost (a call
  of the public op costs ~50-100 us of Python and ctypes; a small zoo GEMM runs ~80 us).
* ceilings (dense bf16 peak, device-copy bandwidth), compulsory bytes / roofline bound, GPU clock
  readings (nvidia-smi query only; nothing is changed), geometric means.
"""
from __future__ import annotations

import hashlib
import importlib
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _first_module(*names):
    err = None
    for n in names:
        try:
            return importlib.import_module(n)
        except ImportError as e:     # ModuleNotFoundError included
            err = e
    raise err


def gemm_modules() -> SimpleNamespace:
    """cost_model, tuning (module objects; the constants file is ``tuning.path("tuning.json")``) and ops (the
    module that defines the grouped-GEMM ops and ``backend_for``), new layout first."""
    cost_model = _first_module("moonep_ops.gemm.cost_model", "moonep_ops.gemm_cost_model")
    tuning = _first_module("moonep_ops.gemm.tuning", "moonep_ops.gemm_tuning")
    ops = _first_module("moonep_ops.ops.grouped_mm", "moonep_ops.grouped_gemm")
    return SimpleNamespace(cost_model=cost_model, tuning=tuning, ops=ops)


def gemm_library_path() -> Path | None:
    d = os.environ.get("MOONEP_LIB_DIR")
    p = Path(d) if d else ROOT / "moonep_ops" / "lib"
    p = p / "libmoonep_gemm.so"
    return p if p.exists() else None


def file_md5(path: Path | None) -> str | None:
    if path is None or not Path(path).exists():
        return None
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def gmean(xs) -> float:
    xs = [float(x) for x in xs if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def with_env(fn: Callable[[], object], **env: str) -> Callable[[], object]:
    """``fn`` called with the environment variables ``env`` set (and restored after): an A/B
    contender for a switch the library reads per call (MOONEP_GEMM_PDL, ...)."""
    def call():
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
    return call


# ------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------

def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def time_interleaved(fns: dict[str, Callable[[], object]], *, rounds: int = 5, k: int | None = None,
                     warmup: int = 1, device: str = "cuda", target_us: float = 250.0,
                     max_k: int = 8, clock_mhz: float = 1980.0) -> dict[str, dict]:
    """Median device time (us) of each callable and its spread over rounds.

    Returns {name: {"us": median of (sample / k), "spread": (max - min) / median over the rounds,
    "k": k, "n": rounds}} plus "_meta": {k, rounds, sleep_us, cpu_us (host enqueue per call),
    gpu_est_us}.  ``k``: launches per sample (default: enough for ``target_us`` of device time,
    at most ``max_k``).  On CPU (device "cpu", the dry run) a sample is host wall time."""
    names = list(fns)
    cuda = device == "cuda"
    # warm-up; the last pass measures the host's enqueue time and a first device time per call
    cpu_us, gpu_us = {}, {}
    for w in range(max(1, warmup)):
        for n in names:
            if cuda and w == max(1, warmup) - 1:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                _sync(device)
                t0 = time.perf_counter()
                s.record()
                fns[n]()
                e.record()
                cpu_us[n] = (time.perf_counter() - t0) * 1e6
                _sync(device)
                gpu_us[n] = s.elapsed_time(e) * 1e3
            else:
                t0 = time.perf_counter()
                fns[n]()
                _sync(device)
                cpu_us[n] = gpu_us[n] = (time.perf_counter() - t0) * 1e6
    _sync(device)
    if k is None:
        k = 1 if not cuda else max(1, min(max_k, math.ceil(target_us / max(min(gpu_us.values()),
                                                                              1.0))))
    # Device spin before each round: enough for the host to enqueue the round's launches when it
    # is slower than the device (otherwise the device idles inside a sample).
    enqueue = sum(cpu_us.values()) * k
    device_work = sum(gpu_us.values()) * k
    sleep_us = 0.0 if (not cuda or device_work > 3.0 * enqueue) else min(1.5 * enqueue + 50.0, 30e3)
    samples = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        if cuda:
            if sleep_us > 0:
                torch.cuda._sleep(int(sleep_us * clock_mhz))
            evs = []
            for n in order:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(k):
                    fns[n]()
                e.record()
                evs.append((n, s, e))
            torch.cuda.synchronize()
            for n, s, e in evs:
                samples[n].append(s.elapsed_time(e) * 1e3 / k)
        else:
            for n in order:
                t0 = time.perf_counter()
                for _ in range(k):
                    fns[n]()
                samples[n].append((time.perf_counter() - t0) * 1e6 / k)
    out = {}
    for n, v in samples.items():
        med = statistics.median(v)
        out[n] = dict(us=med, spread=(max(v) - min(v)) / med if med > 0 else 0.0, k=k, n=rounds)
    out["_meta"] = dict(k=k, rounds=rounds, sleep_us=sleep_us,
                        cpu_us={n: round(v, 1) for n, v in cpu_us.items()},
                        gpu_est_us={n: round(v, 2) for n, v in gpu_us.items()})
    return out


def time_us(fn, iters: int = 10, warmup: int = 3) -> float:
    """Median device time of one callable (CUDA events), for the ceilings."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev)


def measure_ceilings(n: int = 8192, copy_bytes: int = 1 << 31) -> tuple[float, float]:
    """(dense bf16 TF/s of an n^3 product on random data, device-copy TB/s counting read and
    write): the two ceilings of the cost model (calibrate_grouped_gemm.py, bench_gemm_zoo.py)."""
    a = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    t = time_us(lambda: torch.mm(a, b), iters=20, warmup=5)
    peak = 2 * n ** 3 / (t * 1e-6) / 1e12
    del a, b
    src = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_us(lambda: dst.copy_(src), iters=20, warmup=5)
    hbm = 2 * src.numel() / (t * 1e-6) / 1e12
    del src, dst
    torch.cuda.empty_cache()
    return peak, hbm


# ------------------------------------------------------------------------------------------
# bytes and bounds
# ------------------------------------------------------------------------------------------

def compulsory_bytes(kind: str, counts, O: int, I: int) -> float:
    """HBM bytes no schedule avoids: the group rows in and out, each used weight once
    (fwd/dgrad), every group's gradient written once in bf16 (wgrad_lp; empty ones are zeroed)
    or read and written in fp32 (wgrad, non-empty groups)."""
    M = float(sum(counts))
    nz = float(sum(1 for c in counts if c > 0))
    if kind in ("fwd", "dgrad"):
        return M * (O + I) * 2 + nz * O * I * 2
    if kind == "wgrad_lp":
        return M * (O + I) * 2 + len(counts) * O * I * 2
    return M * (O + I) * 2 + nz * O * I * 8


def roofline_us(kind: str, counts, O: int, I: int, dense_us: float, hbm_tbps: float) -> float:
    """max(dense torch.mm with the same FLOPs, compulsory bytes at the copy bandwidth)."""
    return max(dense_us, compulsory_bytes(kind, counts, O, I) / (hbm_tbps * 1e6))


def flops(counts, O: int, I: int) -> float:
    return 2.0 * float(sum(counts)) * O * I


# ------------------------------------------------------------------------------------------
# environment
# ------------------------------------------------------------------------------------------

_SMI_KEYS = ("sm_mhz", "mem_mhz", "max_sm_mhz", "power_w", "power_limit_w", "temp_c", "reasons")
_SMI_FIELDS = ("clocks.sm", "clocks.mem", "clocks.max.sm", "power.draw", "power.limit",
               "temperature.gpu", "clocks_event_reasons.active")


def gpu_clocks() -> dict | None:
    """One nvidia-smi reading (a query; nothing is set), or None where it is not available.
    Retries without the throttle-reason field, which older drivers do not know."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    for n in (len(_SMI_FIELDS), len(_SMI_FIELDS) - 1):
        try:
            r = subprocess.run([exe, f"--query-gpu={','.join(_SMI_FIELDS[:n])}",
                                "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        if r.returncode == 0 and r.stdout.strip():
            vals = [v.strip() for v in r.stdout.strip().splitlines()[0].split(",")]
            out = dict(zip(_SMI_KEYS[:n], vals))
            out["t"] = round(time.time(), 1)
            return out
    return None


def git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None
