"""Planning policies compared: replicated experts and moved token copies vs the lower bound.

    python benchmarks/planner_policy_sweep.py [--tokens 4096] [--markdown]

Steps 1-2 of the planner (which decide what moves) depend only on the global per-expert counts
and the per-rank caps, so each case draws counts for T = R*s*K token copies from an expert
distribution and plans them directly.  Lower bound on moved copies: sum_h max(0, group_h - cap_h)
(every surplus copy must leave its home rank); on replicated experts: the number of ranks
with a deficit (each needs at least one redundant expert).
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time

import torch

from moonep_ops.planner import plan_group, replication_cost

# The exact-cap policies ("cost", which trades balance for replicas within a slack, has its own
# table: benchmarks/planner_cost_table.py).
POLICIES = ("moonep", "lean")


def expert_probs(kind: str, E: int, R: int, g: torch.Generator, param: float = 0.0) -> torch.Tensor:
    perm = torch.randperm(E, generator=g)
    p = torch.ones(E, dtype=torch.float64)
    if kind == "zipf":
        p[perm] = 1.0 / (torch.arange(E, dtype=torch.float64) + 1).pow(param)
    elif kind == "hot":                       # hottest expert at (k+1)x the mean load
        p[:] = (E - (param + 1)) / (E - 1)
        p[perm[0]] = param + 1
    elif kind == "one_expert":
        p[:] = 0
        p[perm[0]] = 1
    elif kind == "one_group":                 # every copy to one rank's home experts
        B = E // R
        p[:] = 0
        p[:B] = 1
    elif kind == "staircase":                 # group loads 1..R: donors and receivers of all sizes
        B = E // R
        p = (torch.arange(E, dtype=torch.float64) // B + 1)
    elif kind == "dirichlet":                 # random group loads, flat inside each group
        B = E // R
        w = torch.distributions.Dirichlet(torch.full((R,), param)).sample().double()
        p = w.repeat_interleave(B) / B
    return p / p.sum()


def counts_from(p: torch.Tensor, T: int, g: torch.Generator) -> torch.Tensor:
    return torch.bincount(torch.multinomial(p.float(), T, replacement=True, generator=g),
                          minlength=p.numel())


def metrics(cnt_E: torch.Tensor, R: int, T: int, tp: int, policy: str) -> dict:
    tpe = torch.zeros(R, cnt_E.numel(), dtype=torch.int32)
    tpe[0] = cnt_E                              # only column sums matter to steps 1-3
    replicated, moved = replication_cost(plan_group(tpe, T, tp, policy).alloc_ER)
    return dict(replicated=int(replicated), moved=int(moved))


def lower_bounds(cnt_E: torch.Tensor, R: int, T: int) -> tuple[int, int]:
    group = cnt_E.view(R, -1).sum(1)
    base, extra = divmod(T, R)
    caps = torch.tensor([base + (r < extra) for r in range(R)])
    bal = group - caps
    return int(bal.clamp(min=0).sum()), int((bal < 0).sum())


CASES = [("uniform", 0.0), ("zipf", 0.5), ("zipf", 1.0), ("zipf", 1.5), ("zipf", 2.0),
         ("hot", 1.0), ("hot", 10.0), ("hot", 20.0), ("one_expert", 0.0), ("one_group", 0.0),
         ("staircase", 0.0), ("dirichlet", 1.0), ("dirichlet", 0.3)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank (s)")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--token-padding", type=int, default=128)
    ap.add_argument("--random-trials", type=int, default=300,
                    help="random Dirichlet group loads per (R, E) for the worst-case search")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(a.seed)
    torch.manual_seed(a.seed)
    print(f"s={a.tokens}, K={a.topk}, token_padding={a.token_padding}, seed={a.seed}")
    print("| R | E | routing | maxvio | moved LB | moved moonep | moved lean | "
          "repl LB | repl moonep | repl lean |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    totals = {p: [0, 0] for p in POLICIES}
    tot_lb = [0, 0]
    worst = {}
    for R in (8, 64):
        for E in (256, 384, 1024):
            T = R * a.tokens * a.topk
            for kind, param in CASES:
                cnt = counts_from(expert_probs(kind, E, R, g, param), T, g)
                lbm, lbr = lower_bounds(cnt, R, T)
                mv = float(cnt.max() / cnt.float().mean() - 1)
                row = {p: metrics(cnt, R, T, a.token_padding, p) for p in POLICIES}
                for p in POLICIES:
                    totals[p][0] += row[p]["moved"]
                    totals[p][1] += row[p]["replicated"]
                tot_lb[0] += lbm
                tot_lb[1] += lbr
                name = kind if not param else f"{kind} {param:g}"
                print(f"| {R} | {E} | {name} | {mv:.2f} | {lbm} | {row['moonep']['moved']} | "
                      f"{row['lean']['moved']} | {lbr} | {row['moonep']['replicated']} | "
                      f"{row['lean']['replicated']} |")
            # worst case over random group loads
            for p in POLICIES:
                worst.setdefault((R, E, p), [1.0, 0, 0, 0])
            for trial in range(a.random_trials):
                alpha = random.Random(trial).choice([0.1, 0.3, 1.0, 3.0])
                cnt = counts_from(expert_probs("dirichlet", E, R, g, alpha), T, g)
                lbm, lbr = lower_bounds(cnt, R, T)
                for p in POLICIES:
                    r = metrics(cnt, R, T, a.token_padding, p)
                    w = worst[(R, E, p)]
                    ratio = r["moved"] / lbm if lbm else 1.0
                    w[0] = max(w[0], ratio)
                    w[1] += r["moved"]
                    w[2] += r["replicated"]
                    w[3] += lbm
    print()
    print("Totals over the table: moved copies (LB %d): moonep %d, lean %d; replicated experts "
          "(LB %d): moonep %d, lean %d" % (tot_lb[0], totals["moonep"][0], totals["lean"][0],
                                              tot_lb[1], totals["moonep"][1], totals["lean"][1]))
    print()
    print(f"Random Dirichlet group loads ({a.random_trials} per row):")
    print("| R | E | policy | worst moved/LB | total moved / LB | total replicated |")
    print("|---|---|---|---|---|---|")
    for (R, E, p), (wr, m, rep, lb) in worst.items():
        print(f"| {R} | {E} | {p} | {wr:.3f} | {m / max(lb, 1):.4f} | {rep} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
