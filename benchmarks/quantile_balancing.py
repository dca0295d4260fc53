"""Quantile Balancing on a synthetic skewed router: maxvio and planner work over steps.

    python benchmarks/quantile_balancing.py [--steps 20] [--rate 0.5]

A router whose gate has a rank-one component aligned with the input mean (later experts win
most tokens).  Each step routes T = R*s tokens, reports the global maxvio, and what MoonEP's
planner must do for that histogram (redundant experts, token copies moved off their home
rank), then applies one Quantile-Balancing update.  rate=0 is the unbalanced control.
"""
from __future__ import annotations

import argparse
import sys

import torch

from moonep_ops.planner import plan_group, replication_cost
from moonep_ops.testing import load_per_expert, maxvio_of, skewed_router


def run(rate: float, steps: int, D: int, E: int, K: int, R: int, s: int, seed: int):
    router, mu = skewed_router(D, E, K, rate, seed)
    g = torch.Generator().manual_seed(seed + 1)
    rows = []
    for _ in range(steps):
        ids, _, logits = router(torch.randn(R * s, D, generator=g) + mu)
        scores = router.scores(logits)
        loads = load_per_expert(ids, E)
        tpe = torch.zeros(R, E, dtype=torch.int32)
        tpe[0] = loads
        rep, moved = replication_cost(plan_group(tpe, R * s * K, 128, "moonep").alloc_ER)
        rows.append((maxvio_of(loads), int(rep), int(moved)))
        router.update_balance(scores)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    base = run(0.0, a.steps, 64, a.experts, a.topk, a.ranks, a.tokens, a.seed)
    qb = run(a.rate, a.steps, 64, a.experts, a.topk, a.ranks, a.tokens, a.seed)
    print(f"R={a.ranks}, E={a.experts}, K={a.topk}, s={a.tokens}, QB rate={a.rate}")
    print("| step | maxvio (no QB) | maxvio (QB) | redundant (no QB) | redundant (QB) | "
          "moved (no QB) | moved (QB) |")
    print("|---|---|---|---|---|---|---|")
    for i, (b, q) in enumerate(zip(base, qb)):
        print(f"| {i} | {b[0]:.2f} | {q[0]:.2f} | {b[1]} | {q[1]} | {b[2]} | {q[2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
