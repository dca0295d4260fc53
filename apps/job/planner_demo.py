"""``python -m apps.job --planner-only``: the planner alone over R simulated ranks.

For each maxvio, plain expert parallelism (every expert at its home rank) against the planning
policies ("cost" with a 5 % slack and DeepSeek-V3's expert shape, D 7168, F 2048, for its
replica cost): token copies each rank receives, redundant experts, token copies moved away
from their home rank, the lower bound on moved copies, and the planner's time.  No processes,
no training: instant at any size (the default sizes of the old planner demo are R=8, s=2048).
"""
from __future__ import annotations

import time

from moonep_ops.gemm.plan_cost import replica_cost
from moonep_ops.planner import POLICIES, plan_all_ranks, replication_cost
from moonep_ops.testing import histogram, maxvio, routing_for_maxvio


def planner_table(R: int, E: int, K: int, s: int, tp: int, targets, seed: int = 0) -> None:
    B = E // R
    print(f"MoonEP planner on {R} simulated ranks: E={E} (epn={B}), K={K}, s={s} tokens/rank, "
          f"token_padding={tp}; every rank's target is s*K = {s * K} token copies")
    hdr = (f"{'maxvio':>7} {'policy':>8} {'recv max':>9} {'recv mean':>9} {'max/mean':>8} "
           f"{'redundant':>9} {'moved':>8} {'lower bd':>8} {'plan ms':>8}")
    print(hdr)
    print("-" * len(hdr))
    for target in targets:
        tk = routing_for_maxvio(target, R, E, s, K, seed=seed)
        tpe = histogram(tk, E)
        group = tpe.long().sum(0).view(R, B).sum(1)
        lower = int((group - s * K).clamp(min=0).sum())
        print(f"{maxvio(tpe):7.2f} {'plain EP':>8} {int(group.max()):9d} "
              f"{float(group.float().mean()):9.0f} {float(group.max() / group.float().mean()):8.2f} "
              f"{0:9d} {0:8d} {lower:8d} {'':>8}")
        for policy in POLICIES:
            kw = {}
            if policy == "cost":
                kw = dict(slack_ppm=50_000, replica_cost=replica_cost(
                    7168, 2048, R=R, E=E, S=s, K=K, token_padding=tp).copies)
            t0 = time.perf_counter()
            res = plan_all_ranks(tk, E, tp, policy=policy, **kw)
            ms = (time.perf_counter() - t0) * 1e3
            recv = res.group.alloc_ER.sum(0)
            redundant, moved = (int(v) for v in replication_cost(res.group.alloc_ER))
            print(f"{'':7} {policy:>8} {int(recv.max()):9d} {float(recv.float().mean()):9.0f} "
                  f"{float(recv.max() / recv.float().mean()):8.2f} {redundant:9d} {moved:8d} "
                  f"{lower:8d} {ms:8.1f}")
