"""Which warp each stage of the device planner's group kernel waits for: every warp's clock64
as it reaches the end of each stage (moonep_plan_debug_warp_stamps, before the barrier), median
over 9 warm launches.  Needs a CUDA device and the diagnostics build of libmoonep_ep.so:

    python -m moonep_ops.build --diagnostics --lib ep
    python diagnostics/plan_warp_stamps.py

The library is loaded with ctypes from $MOONEP_LIB_DIR, else moonep_ops/lib/diagnostics/ (the
production library exports no moonep_plan_debug_* hook); nothing of moonep_ops is imported.

A stage's barrier completes when its last warp arrives, so stage i runs from the last arrival at
barrier i-1 (the load stage: from thread 0 leaving the dependency wait) to the last arrival at
barrier i; the pieces stage has no barrier after it, and its slowest warp ends the kernel.
Thread 0's own stamps after each __syncthreads() (moonep_plan_debug_stamps, the stage table of
benchmarks/bench_plan_device.py) are taken before the barrier completes: the barrier is
BAR.SYNC.DEFER_BLOCKING, and the warp issues on until a memory instruction
(diagnostics/clock_barrier_probe.cu).  They time warp 0's arrivals, which is what the
"thread 0" column shows; they are not stamps taken after the barrier has completed.

Routings (the kinds of benchmarks/bench_plan_device.py, same seeds): zipf (alpha 1.0, sampled
with replacement), hot (one expert at 8x the mean load, the rest uniform), one_group (every
entry to rank 0's experts).  s = S = 8192, K = 8, token_padding 128, rank 1.

    python diagnostics/plan_warp_stamps.py --cost

policy "cost" instead (eps 0.05, replica_cost 1500: the cost table of bench_plan_device.py) on
that table's R = 64, E = 256, s = 1024 cases, with the search's stages between rank quotas and
split (its kernels' warp stamps 5 and 6), and the exact policy's stages of the same routing.
"""
from __future__ import annotations

import ctypes
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CASES = ((8, 384, "one_group"), (8, 384, "hot"), (8, 384, "zipf"),
         (64, 1024, "hot"), (64, 1024, "one_group"), (64, 1024, "zipf"))
COST_CASES = ((64, 256, "zipf"), (64, 256, "hot"), (64, 256, "one_group"))
STAGES = ["load", "quotas", "split", "layout", "pieces"]
# policy cost: (name, warp-stamp row) in the order they run (its level quotas are in "quotas")
COST_STAGES = [("load", 0), ("quotas", 1), ("c.split", 5), ("c.choice", 6), ("split", 2),
               ("layout", 3), ("pieces", 4)]


def load_lib() -> ctypes.CDLL:
    path = Path(os.environ.get("MOONEP_LIB_DIR", ROOT / "moonep_ops" / "lib" / "diagnostics"))
    lib = ctypes.CDLL(str(path / "libmoonep_ep.so"))
    if not hasattr(lib, "moonep_plan_debug_warp_stamps"):
        raise SystemExit(f"{path / 'libmoonep_ep.so'} is a production build: "
                         "python -m moonep_ops.build --diagnostics --lib ep")
    c_int, p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
    lib.moonep_plan_workspace_bytes.restype = c_size_t
    lib.moonep_plan_workspace_bytes.argtypes = [c_int] * 4
    lib.moonep_plan_group.restype = c_int        # csrc/moonep_ep.h
    # s K rank R E S tp NvS, slack_ppm (0: policy moonep), replica_cost (EP ABI 4)
    lib.moonep_plan_group.argtypes = ([p] + [c_int] * 8 + [c_int, ctypes.c_int64] + [p] * 5
                                      + [c_size_t, p, p])
    for name in ("moonep_plan_debug_stamps", "moonep_plan_debug_warp_stamps"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [p]
    lib.moonep_ep_last_error.restype = ctypes.c_char_p
    return lib


def routing(kind: str, R: int, E: int, s: int, K: int, seed: int = 0) -> list[torch.Tensor]:
    """Top-k ids [s, K] int32 of every rank (moonep_ops.testing.make_routing's hot / one_group
    with hot_factor 8, bench_plan_device.routing's zipf)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(E, generator=g)
    out = []
    if kind == "zipf":
        p = torch.empty(E)
        p[perm] = 1.0 / (torch.arange(E, dtype=torch.float64) + 1).float()
        return [torch.multinomial(p, s * K, replacement=True, generator=g).view(s, K)
                .to(torch.int32) for _ in range(R)]
    t, k = torch.arange(s)[:, None], torch.arange(K)[None, :]
    for _ in range(R):
        if kind == "hot":
            hot = int(perm[0])
            ids = torch.randint(0, max(E - 1, 1), (s, K), generator=g)
            ids = (ids + (ids >= hot).long()) % E
            pick = torch.rand(s, K, generator=g) < min(1.0, 8.0 / E)
            ids = torch.where(pick, torch.full_like(ids, hot), ids)
        else:  # one_group
            ids = (t * K + k) % (E // R)
        out.append(ids.to(torch.int32).contiguous())
    return out


def hist_rx(topk: list[torch.Tensor], E: int, s: int) -> torch.Tensor:
    """[R, E+3] int32: bincount, bad flag 0, s, total -1 (uniform s)."""
    rows = [torch.cat([torch.bincount(t.reshape(-1).long(), minlength=E).to(torch.int32),
                       torch.tensor([0, s, -1], dtype=torch.int32)]) for t in topk]
    return torch.stack(rows).contiguous()


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    cost = "--cost" in sys.argv[1:]
    lib = load_lib()
    st = torch.zeros(8, dtype=torch.int64, device="cuda")
    ws = torch.zeros(7 * 32, dtype=torch.int64, device="cuda")
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    s, K, tp, rank = (1024 if cost else 8192), 8, 128, 1
    for R, E, kind, ppm in ([c + (p,) for c in COST_CASES for p in (0, 50000)] if cost
                            else [c + (0,) for c in CASES]):
        B = E // R
        rc = 1500 if ppm else 0
        cap = -(-s * K * (1_000_000 + ppm) // 1_000_000)         # geometry.slack_cap(S*K)
        NvS = (cap + (tp - 1) * 2 * B + tp - 1) // tp * tp
        hist = hist_rx(routing(kind, R, E, s, K), E, s).cuda()
        new = lambda *shape: torch.empty(shape, dtype=torch.int32, device="cuda")  # noqa: E731
        cu, etc, zf, stats, err = new(2 * B), new(R, B), new(2 * B, 2), new(2), new(1)
        err.zero_()
        nws = lib.moonep_plan_workspace_bytes(R, E, s, K)
        work = torch.empty(nws, dtype=torch.uint8, device="cuda")
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

        def launch():
            rv = lib.moonep_plan_group(hist.data_ptr(), s, K, rank, R, E, s, tp, NvS, ppm, rc,
                                       cu.data_ptr(), etc.data_ptr(), zf.data_ptr(),
                                       stats.data_ptr(), work.data_ptr(), nws, err.data_ptr(),
                                       stream)
            if rv:
                raise RuntimeError(lib.moonep_ep_last_error().decode())
        runs = []
        for _ in range(9):
            for _ in range(3):
                x @ x                                    # busy-GPU clocks, as the bench
            for i in range(20):
                if i == 19:
                    st.zero_()
                    ws.fill_(-1)
                    lib.moonep_plan_debug_stamps(st.data_ptr())
                    lib.moonep_plan_debug_warp_stamps(ws.data_ptr())
                launch()
            lib.moonep_plan_debug_stamps(None)
            lib.moonep_plan_debug_warp_stamps(None)
            runs.append((st.tolist(), ws.view(7, 32).tolist()))
        if int(err.item()):
            print(f"  error word {int(err.item())} (invalid histogram?)")
        pol = f"policy cost (eps {ppm / 1e6}, rc {rc})" if ppm else "policy moonep"
        print(f"== R={R} E={E} {kind} {pol}: stage cycles (to the last warp's arrival; thread 0's "
              "stamps) | the five last warps, warp@cycles after the stage's start | the first "
              "and the last warp")
        # the block has 16 warps at R <= 12 (kSmallGroupThreads): the others' stamps stay -1
        nw = sum(1 for w in range(32) if runs[0][1][0][w] != -1)

        order = COST_STAGES if ppm else list(zip(STAGES, range(5)))

        def start(r, k):         # stage k starts when the barrier before it completes
            return r[0][1] if k == 0 else max(r[1][order[k - 1][1]][:nw])
        total = 0.0
        for k, (name, i) in enumerate(order):
            dur = statistics.median(max(r[1][i][:nw]) - start(r, k) for r in runs)
            # thread 0's stamps: the moonep stages only (the search has none)
            t0 = (statistics.median(r[0][i + 2] - r[0][i + 1] for r in runs)
                  if not ppm or i < 2 else float("nan"))
            per = [statistics.median(r[1][i][w] - start(r, k) for r in runs) for w in range(nw)]
            last = sorted(range(nw), key=lambda w: -per[w])[:5]
            total += dur
            print(f"  {name:9s} {dur:6.0f} {t0:6.0f} | "
                  + " ".join(f"w{w}@{per[w]:.0f}" for w in last)
                  + f" | w0@{per[0]:.0f} w{nw - 1}@{per[nw - 1]:.0f}")
        print(f"  total   {total:6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
