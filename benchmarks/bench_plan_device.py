"""Device planner latency: moonep_plan (csrc/plan_kernels.cu) against the torch planner on CUDA.

    PYTHONPATH=$PWD python benchmarks/bench_plan_device.py [--launches 100] [--reps 7]

group  = moonep_plan_group: steps 1-3 only, the one-block planning kernel (one launch);
plan   = moonep_plan: the whole plan (group kernel fused with the per-chunk topk histograms,
         then the slot assignment: two launches);
both timed as a CUDA graph of --launches back-to-back launches (CUDA events around a replay,
divided by the launch count; the best and the median of --reps replays).
torch  = torch.ops.moonep.plan on CUDA tensors, policy "moonep": eager (host launch bound), and
         in a second table replayed as a CUDA graph of one call.
The group kernel is launched with programmatic dependent launch (PDL); a second table replays,
interleaved with the first, the same graphs captured without it (moonep_plan_debug_pdl) and the
group kernel with every greedy loop round by round (moonep_plan_debug_stop 198).  A third gives the
group kernel's stages in SM cycles from clock64 stamps in block 0 (moonep_plan_debug_stamps):
"cold" = one launch right after the queued matmuls (the kernel's code and the histogram are no
longer cached, as in a training step), "warm" = the last of a back-to-back run (what the graph
timing measures).  The last table times the stages by difference (moonep_plan_debug_stop; stage 1
is the histogram load with its per-element checks, stage 2 the row-sum validation and rank
quotas).
Routings: zipf (alpha 1.0, sampled with replacement), hot (one expert at 8x the mean load, the
rest uniform), one_group (every entry to rank 0's experts: the longest greedy loops).
token_padding 128, s = S.
The cost table (--cost-eps / --cost-rc; --skip-cost leaves it out): policy "cost" (the level search
in the group kernel) beside policy "moonep" (the exact caps) on the same rows, both as graphs
replayed interleaved, with the ratio cost / exact of the medians (acceptance bar: <= 1.5) and a
check against torch.ops.moonep.plan(..., "cost") on CUDA.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import moonep_ops  # noqa: F401
from moonep_ops import native
from moonep_ops import planner as pdv
from moonep_ops.geometry import Geometry, slack_to_ppm
from moonep_ops.testing import histogram, make_hist_rx, make_routing, maxvio

CONFIGS = [(8, 64, 512, 8, "hot"),
           (8, 384, 8192, 8, "zipf"), (8, 384, 8192, 8, "hot"), (8, 384, 8192, 8, "one_group"),
           (64, 1024, 8192, 8, "zipf"), (64, 1024, 8192, 8, "hot"), (64, 1024, 8192, 8, "one_group")]


# (R, E, s, K, routing) of the cost table
COST_CONFIGS = [(8, 256, 4096, 8, "zipf"), (8, 256, 4096, 8, "hot"), (8, 256, 4096, 8, "one_group"),
                (8, 384, 8192, 8, "hot"), (16, 256, 4096, 8, "hot"),
                (64, 256, 1024, 8, "zipf"), (64, 256, 1024, 8, "hot"),
                (64, 256, 1024, 8, "one_group")]


def routing(kind, R, E, s, K, seed=0):
    if kind != "zipf":
        return make_routing(kind, R, E, s, K, seed=seed, hot_factor=8.0)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(E, generator=g)
    p = torch.empty(E)
    p[perm] = 1.0 / (torch.arange(E, dtype=torch.float64) + 1).float()
    return [torch.multinomial(p, s * K, replacement=True, generator=g).view(s, K).to(torch.int32)
            for _ in range(R)]


def _clock():
    try:
        return torch.cuda.clock_rate()
    except Exception:  # noqa: BLE001  (needs pynvml)
        return "?"


_BUSY = {"x": None, "n": 0}


def _busy():
    """Queue ~15 ms of bf16 matmuls (no host sync) so the replay right after runs at the clocks
    of a busy GPU; idle between replays, the SM clock falls (1500 MHz seen vs 1980 under load)."""
    if _BUSY["n"] <= 0:
        return
    if _BUSY["x"] is None:
        _BUSY["x"] = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = _BUSY["x"]
    for _ in range(_BUSY["n"]):
        x @ x


def capture(fn, launches):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def time_graphs(graphs, launches, reps):
    """Replays the graphs round-robin (drift of the clocks hits all alike); per graph the best
    and the median of reps replays, in us per launch."""
    ts = [[] for _ in graphs]
    for _ in range(reps):
        for g, t in zip(graphs, ts):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _busy()   # the planner runs between GEMMs in a training step: time it at their clocks
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            t.append(e0.elapsed_time(e1) * 1e3 / launches)
    return [(min(t), statistics.median(t)) for t in ts]


def time_graph(fn, launches, reps):
    return time_graphs([capture(fn, launches)], launches, reps)[0]


def _hook(name):
    """A diagnostics hook of libmoonep_ep.so (only a --diagnostics build has them), or None."""
    return getattr(native.ep(), name, None)


def _debug_stop(stop):
    _hook("plan_debug_stop")(stop)


def _debug_stamps(buf):
    _hook("plan_debug_stamps")(None if buf is None else buf.data_ptr())


def capture_with(fn, launches, stop=99, pdl=True):
    """A graph of fn captured with the debug knobs set (they act at launch, i.e. at capture)."""
    if stop == 99 and pdl and _hook("plan_debug_stop") is None:
        return capture(fn, launches)             # the production library: nothing to set
    _hook("plan_debug_stop")(stop)
    _hook("plan_debug_pdl")(int(pdl))
    try:
        return capture(fn, launches)
    finally:
        _hook("plan_debug_stop")(99)
        _hook("plan_debug_pdl")(1)


def time_eager(fn, iters):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / iters


def cost_table(a) -> None:
    """Policy "cost" against policy "moonep" on the device (group kernel alone, and the whole
    plan), best / median us per plan, and the ratio of the medians."""
    ppm, rc, tp, rank = slack_to_ppm(a.cost_eps), a.cost_rc, 128, 1
    print(f"\npolicy cost (eps = {a.cost_eps}, replica_cost = {rc}) against the exact policy "
          f"(moonep), us per plan, best / median; ratio = cost median / exact median")
    print("| R | E | s | K | routing | exact group | cost group | ratio | exact plan | cost plan "
          "| ratio | level plan chosen | err | vs torch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for R, E, s, K, kind in COST_CONFIGS:
        if R > a.max_r:
            continue
        tk = routing(kind, R, E, s, K)
        tpe = histogram(tk, E)
        hist = make_hist_rx(tpe, s).cuda()
        topk = tk[rank].cuda()
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        geo0 = Geometry(R=R, E=E, S=s, K=K, token_padding=tp)
        geo1 = Geometry(R=R, E=E, S=s, K=K, token_padding=tp, slack_ppm=ppm)
        b0, b1 = pdv.allocate(hist, s, K, R), pdv.allocate(hist, s, K, R)

        def fn(group_only, cost, hist=hist, topk=topk, R=R, s=s, err=err, b0=b0, b1=b1):
            if cost:
                return lambda: pdv.plan_into(hist, topk, rank, R, s, tp, geo1.NvS, err, b1,
                                             group_only, slack_ppm=ppm, replica_cost=rc)
            return lambda: pdv.plan_into(hist, topk, rank, R, s, tp, geo0.NvS, err, b0,
                                         group_only)
        gs = [capture(fn(True, False), a.launches), capture(fn(True, True), a.launches),
              capture(fn(False, False), a.launches), capture(fn(False, True), a.launches)]
        eg, cg, ep, cp = time_graphs(gs, a.launches, a.reps)
        tpe_c = tpe.cuda()
        ref = torch.ops.moonep.plan(tpe_c, topk, rank, R, s, tp, -1, "cost", ppm, rc)
        exact = torch.ops.moonep.plan(tpe_c, topk, rank, R, s, tp, -1, "moonep")
        same = all(torch.equal(x, y) for x, y in zip(ref, b1[:5]))
        level = not all(torch.equal(x, y) for x, y in zip(ref[1:], exact[1:]))
        print(f"| {R} | {E} | {s} | {K} | {kind} | {eg[0]:.1f} / {eg[1]:.1f} "
              f"| {cg[0]:.1f} / {cg[1]:.1f} | {cg[1] / eg[1]:.2f} | {ep[0]:.1f} / {ep[1]:.1f} "
              f"| {cp[0]:.1f} / {cp[1]:.1f} | {cp[1] / ep[1]:.2f} | {'yes' if level else 'no'} "
              f"| {int(err.item())} | {'ok' if same else 'MISMATCH'} |", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=100)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--torch-iters", type=int, default=3)
    ap.add_argument("--busy", type=int, default=10,
                    help="8192^3 bf16 matmuls queued before every timed replay (0: idle GPU)")
    ap.add_argument("--skip-torch-graph", action="store_true",
                    help="leave out the last table (the torch planner captured as a CUDA graph)")
    ap.add_argument("--max-r", type=int, default=1 << 30, help="only configurations with R <= this")
    ap.add_argument("--cost-eps", type=float, default=0.05, help="policy cost's slack (cost table)")
    ap.add_argument("--cost-rc", type=int, default=16,
                    help="policy cost's replica cost in token copies (cost table)")
    ap.add_argument("--skip-cost", action="store_true", help="leave out the cost table")
    ap.add_argument("--only-cost", action="store_true", help="the cost table only")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() or not pdv.device_planner_available():
        print("needs a CUDA device and libmoonep_ep.so (python -m moonep_ops.build --lib ep)")
        return 1
    diag = _hook("plan_debug_stop") is not None
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"graph of {a.launches} launches, best/median of {a.reps} replays (us per plan)")
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(300):                                  # ~0.4 s of matmuls: clocks up
        x @ x
    torch.cuda.synchronize()
    del x
    print(f"SM clock after warm-up: {_clock()} MHz; {a.busy} matmuls queued before each replay")
    _BUSY["n"] = a.busy
    if not a.skip_cost:
        cost_table(a)
    if a.only_cost:
        return 0
    print("| R | E | s | K | routing | maxvio | group best | group med | plan best | plan med "
          "| torch eager | err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    variants = []
    tp, rank = 128, 1
    later, stages = [], []
    for R, E, s, K, kind in CONFIGS:
        if R > a.max_r:
            continue
        tk = routing(kind, R, E, s, K)
        tpe = histogram(tk, E)
        geo = Geometry(R=R, E=E, S=s, K=K, token_padding=tp)
        hist = make_hist_rx(tpe, s).cuda()
        topk = tk[rank].cuda()
        err = torch.zeros(1, dtype=torch.int32, device="cuda")
        bufs = pdv.allocate(hist, s, K, R)
        def run_group(hist=hist, topk=topk, R=R, s=s, NvS=geo.NvS, err=err, bufs=bufs):
            pdv.plan_into(hist, topk, rank, R, s, tp, NvS, err, bufs, group_only=True)
        run_full = (lambda hist=hist, topk=topk, R=R, s=s, NvS=geo.NvS, err=err, bufs=bufs:  # noqa: E731
                    pdv.plan_into(hist, topk, rank, R, s, tp, NvS, err, bufs))
        # Default, and (diagnostics build) the A/B variants of the group kernel, interleaved.
        gs = [capture_with(run_group, a.launches), capture_with(run_full, a.launches)]
        if diag:
            gs += [capture_with(run_group, a.launches, pdl=False),
                   capture_with(run_full, a.launches, pdl=False),
                   capture_with(run_group, a.launches, stop=198)]
        grp, full, *ab = time_graphs(gs, a.launches, a.reps)
        variants.append((R, E, kind, grp, *ab))
        if (R, E) != (8, 64) and kind != "zipf":
            stages.append((R, E, s, K, kind, run_group))
        tpe_c = tpe.cuda()
        torch_fn = (lambda t_=tpe_c, k_=topk, R_=R, s_=s:                         # noqa: E731
                    torch.ops.moonep.plan(t_, k_, rank, R_, s_, tp, -1, "moonep"))
        eager = time_eager(torch_fn, a.torch_iters)
        ref = torch_fn()
        same = all(torch.equal(x, y) for x, y in zip(ref, bufs[:5]))
        later.append((R, E, s, K, kind, torch_fn))
        print(f"| {R} | {E} | {s} | {K} | {kind} | {maxvio(tpe):.2f} | {grp[0]:.1f} | {grp[1]:.1f} "
              f"| {full[0]:.1f} | {full[1]:.1f} | {eager:.0f} | {int(err.item())}"
              f"{'' if same else ' MISMATCH vs torch'} |", flush=True)
    if not diag:
        print("\n(the A/B variants and the stage tables need the diagnostics build: "
              "python -m moonep_ops.build --diagnostics; MOONEP_LIB_DIR=moonep_ops/lib/diagnostics)")
        return 0
    print("\nA/B variants: without programmatic dependent launch, and with every greedy loop round "
          "by round (stop 198: no batched split, rank quotas or single-donor closed form; best / "
          "median us, replayed interleaved with the rows above)")
    print("| R | E | routing | group, PDL | group, no PDL | plan, no PDL "
          "| group, greedy round by round (198) |")
    print("|---|---|---|---|---|---|---|")
    for R, E, kind, *vs in variants:
        print(f"| {R} | {E} | {kind} | " + " | ".join(f"{b:.1f} / {m:.1f}" for b, m in vs) + " |")
    # Stage costs from clock64 stamps inside block 0: "cold" = one launch right after the busy
    # matmuls (as in a training step: the kernel's code and the histogram are no longer cached),
    # "warm" = the 100th launch of a back-to-back run (what the graph timing above measures).
    print("\nGroup kernel stages in SM cycles (clock64 stamps in block 0, median of 7): wait = "
          "from the block's start to the end of the dependency wait; total = after the wait. "
          "Thread 0 stamps right after each barrier, before it completes (BAR.SYNC."
          "DEFER_BLOCKING): a stage column is warp 0's arrival to arrival; the last warp's "
          "view is diagnostics/plan_warp_stamps.py")
    print("| R | E | routing | run | wait | load | validate+quotas | split | layout "
          "| pieces+writes | total | total us at the clock |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    st = torch.zeros(8, dtype=torch.int64, device="cuda")
    for R, E, s_, K, kind, fn in stages:
        for label, n, stop in (("cold", 1, 99), ("warm", a.launches, 99),
                               ("warm, rank quotas round by round (197)", a.launches, 197),
                               ("warm, every greedy round by round (198)", a.launches, 198)):
            rows = []
            _debug_stop(stop)
            for _ in range(7):
                _busy()
                for i in range(n):
                    if i == n - 1:
                        st.zero_()
                        _debug_stamps(st)
                    fn()
                _debug_stamps(None)
                v = st.tolist()
                rows.append([v[i + 1] - v[i] for i in range(6)] + [v[6] - v[1]])
            _debug_stop(99)
            med = [statistics.median(c) for c in zip(*rows)]
            clk = _clock()
            us = f"{med[-1] / clk:.1f} at {clk} MHz" if isinstance(clk, (int, float)) and clk else "?"
            print(f"| {R} | {E} | {kind} | {label} | " + " | ".join(f"{x:.0f}" for x in med)
                  + f" | {us} |", flush=True)
    # Stage costs of the group kernel by difference (block 0 returns after stage k).
    print("\n| R | E | routing | launch+set-up | load | validate+rank quotas | split | layout "
          "| pieces+writes | total |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for R, E, s, K, kind, fn in stages:
        ts = []
        for stop in (0, 1, 2, 3, 4, 99):
            _debug_stop(stop)
            try:
                ts.append(time_graph(fn, a.launches, a.reps)[0])
            finally:
                _debug_stop(99)
        diffs = [ts[0]] + [ts[i] - ts[i - 1] for i in range(1, len(ts))]
        print(f"| {R} | {E} | {kind} | " + " | ".join(f"{x:.1f}" for x in diffs)
              + f" | {ts[-1]:.1f} |", flush=True)
    print(f"SM clock at the end: {_clock()} MHz")
    if a.skip_torch_graph:
        return 0

    # The torch planner replayed as a CUDA graph (its GPU-side time), last: a failed capture
    # could leave the device unusable for the rows above.
    print("\n| R | E | s | K | routing | torch planner as a CUDA graph, us |")
    print("|---|---|---|---|---|---|")
    for R, E, s, K, kind, fn in later:
        if kind == "one_group" or (R, E) == (8, 64):
            continue
        try:
            tg = f"{time_graph(fn, 1, 3)[0]:.0f}"
        except Exception as e:  # noqa: BLE001
            tg = f"n/a ({type(e).__name__}: {str(e)[:80]})"
        print(f"| {R} | {E} | {s} | {K} | {kind} | {tg} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
