"""CPU planner latency: what one rank runs per MoE call (moonep::plan on the gathered histogram).

    python benchmarks/bench_planner.py [--threads N] [--iters 20] [--slack 0.05] [--replica-cost 1500]

Routing: Zipf(1.0) over a seeded expert permutation, s = S (full capacity), token_padding 128.
Reports the median over iterations after one warm-up, for every policy ("cost" with the given
slack and replica cost: 1500 is about what plan_cost.replica_cost gives at DeepSeek-V3 shapes).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import moonep_ops as m
from moonep_ops.testing import histogram, make_routing

CONFIGS = [(8, 384, 8192, 8), (64, 1024, 4096, 8)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--slack", type=float, default=0.05, help="policy cost's slack eps")
    ap.add_argument("--replica-cost", type=int, default=1500, help="policy cost's replica cost")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} intra-op threads")
    print("| R | E | S | K | policy | median ms | min ms |")
    print("|---|---|---|---|---|---|---|")
    for R, E, S, K in CONFIGS:
        tk0 = make_routing("zipf", 1, E, S, K, seed=0)[0]
        # other ranks' histograms: the same distribution with other seeds (only counts are needed)
        tpe = histogram([make_routing("zipf", 1, E, S, K, seed=r)[0] if r else tk0
                         for r in range(R)], E)
        for policy in m.POLICIES:
            cost = (dict(slack_ppm=round(a.slack * 1e6), replica_cost=a.replica_cost)
                    if policy == "cost" else {})
            run = lambda: m.plan(tpe, tk0, 0, num_ranks=R, capacity=S, token_padding=128,  # noqa
                                 policy=policy, **cost)
            run()
            ts = []
            for _ in range(a.iters):
                t0 = time.perf_counter()
                run()
                ts.append((time.perf_counter() - t0) * 1e3)
            print(f"| {R} | {E} | {S} | {K} | {policy} | {statistics.median(ts):.2f} | {min(ts):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
