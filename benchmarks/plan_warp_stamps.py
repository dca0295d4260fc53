"""Which warp each stage of the device planner's group kernel waits for: every warp's clock64
as it reaches the end of each stage (moonep_plan_debug_warp_stamps, before the barrier), median
over 9 warm launches.

    PYTHONPATH=$PWD python benchmarks/plan_warp_stamps.py

A stage's barrier completes when its last warp arrives, so stage i runs from the last arrival at
barrier i-1 (the load stage: from thread 0 leaving the dependency wait) to the last arrival at
barrier i; the pieces stage has no barrier after it, and its slowest warp ends the kernel.
Thread 0's own stamps after each __syncthreads() (moonep_plan_debug_stamps, the stage table of
bench_plan_device.py) are taken before the barrier completes: the barrier is
BAR.SYNC.DEFER_BLOCKING, and the warp issues on until a memory instruction
(benchmarks/clock_barrier_probe.cu).  They time warp 0's arrivals, which is what the
"thread 0" column shows; session 9's "warps stamped after the barrier" caveat was this.
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_plan_device import routing  # noqa: E402
from moonep_ops import planner as pdv  # noqa: E402
from moonep_ops.geometry import Geometry  # noqa: E402
from moonep_ops.testing import histogram  # noqa: E402

CASES = ((8, 384, "one_group"), (8, 384, "hot"), (8, 384, "zipf"),
         (64, 1024, "hot"), (64, 1024, "one_group"), (64, 1024, "zipf"))
STAGES = ["load", "quotas", "split", "layout", "pieces"]


def main() -> int:
    if not torch.cuda.is_available() or not pdv.device_planner_available():
        print("needs a CUDA device and libmoonep_ep.so (python -m moonep_ops.build --lib ep)")
        return 1
    st = torch.zeros(8, dtype=torch.int64, device="cuda")
    ws = torch.zeros(5 * 32, dtype=torch.int64, device="cuda")
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    s, K, tp, rank = 8192, 8, 128, 1
    for R, E, kind in CASES:
        tk = routing(kind, R, E, s, K)
        geo = Geometry(R=R, E=E, S=s, K=K, token_padding=tp)
        hist = pdv.make_hist_rx(histogram(tk, E), s).cuda()
        topk = tk[rank].cuda()
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        bufs = pdv.allocate(hist, s, K, R)
        runs = []
        for _ in range(9):
            for _ in range(3):
                x @ x                                    # busy-GPU clocks, as the bench
            for i in range(20):
                if i == 19:
                    st.zero_()
                    ws.fill_(-1)
                    pdv.debug_stamps(st)
                    pdv.debug_warp_stamps(ws)
                pdv.plan_into(hist, topk, rank, R, s, tp, geo.NvS, err, bufs, group_only=True)
            pdv.debug_stamps(None)
            pdv.debug_warp_stamps(None)
            runs.append((st.tolist(), ws.view(5, 32).tolist()))
        print(f"== R={R} E={E} {kind}: stage cycles (to the last warp's arrival; thread 0's "
              "stamps) | the five last warps, warp@cycles after the stage's start | the first "
              "and the last warp")
        # the block has 16 warps at R <= 12 (kSmallGroupThreads): the others' stamps stay -1
        nw = sum(1 for w in range(32) if runs[0][1][0][w] != -1)

        def start(r, i):         # stage i starts when barrier i-1 completes: its last arrival
            return r[0][1] if i == 0 else max(r[1][i - 1][:nw])
        total = 0.0
        for i, name in enumerate(STAGES):
            dur = statistics.median(max(r[1][i][:nw]) - start(r, i) for r in runs)
            t0 = statistics.median(r[0][i + 2] - r[0][i + 1] for r in runs)
            per = [statistics.median(r[1][i][w] - start(r, i) for r in runs) for w in range(nw)]
            last = sorted(range(nw), key=lambda w: -per[w])[:5]
            total += dur
            print(f"  {name:7s} {dur:6.0f} {t0:6.0f} | "
                  + " ".join(f"w{w}@{per[w]:.0f}" for w in last)
                  + f" | w0@{per[0]:.0f} w{nw - 1}@{per[nw - 1]:.0f}")
        print(f"  total   {total:6.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
