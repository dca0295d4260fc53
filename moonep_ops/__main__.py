"""The main job: ``python -m moonep_ops`` (the README's first command).

For now a planner demonstration over R simulated ranks on this machine: it sweeps router
imbalance and prints, for plain expert parallelism (every expert at its home rank) and for the
two MoonEP planning policies, the token copies each rank receives, the redundant experts, the
token copies moved away from their home rank and the planner's time.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from .planner import POLICIES, plan_all_ranks, replication_cost
from .routing import histogram, maxvio, routing_for_maxvio


def _positive(name):
    def parse(v):
        try:
            x = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {v!r}")
        if x < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {x}")
        return x
    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moonep_ops", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", "-R", type=_positive("R"), default=8)
    ap.add_argument("--experts", "-E", type=_positive("E"), default=64)
    ap.add_argument("--topk", "-K", type=_positive("K"), default=8)
    ap.add_argument("--tokens", "-s", type=_positive("s"), default=2048, help="tokens per rank")
    ap.add_argument("--token-padding", type=_positive("token_padding"), default=128)
    ap.add_argument("--maxvio", type=float, nargs="+", default=[0, 1, 10, 20])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.experts % a.ranks:
        ap.error(f"E={a.experts} is not divisible by R={a.ranks}")
    if a.topk > a.experts:
        ap.error(f"K={a.topk} > E={a.experts}")
    if any(v < 0 for v in a.maxvio):
        ap.error("maxvio values must be >= 0")

    R, E, K, s, tp = a.ranks, a.experts, a.topk, a.tokens, a.token_padding
    B = E // R
    print(f"MoonEP planner on {R} simulated ranks: E={E} (epn={B}), K={K}, s={s} tokens/rank, "
          f"token_padding={tp}; every rank's target is s*K = {s * K} token copies")
    hdr = (f"{'maxvio':>7} {'policy':>8} {'recv max':>9} {'recv mean':>9} {'max/mean':>8} "
           f"{'redundant':>9} {'moved':>8} {'lower bd':>8} {'plan ms':>8}")
    print(hdr)
    print("-" * len(hdr))
    for target in a.maxvio:
        tk = routing_for_maxvio(target, R, E, s, K, seed=a.seed)
        tpe = histogram(tk, E)
        group = tpe.long().sum(0).view(R, B).sum(1)
        cap = s * K
        lower = int((group - cap).clamp(min=0).sum())
        mv = maxvio(tpe)
        print(f"{mv:7.2f} {'plain EP':>8} {int(group.max()):9d} {float(group.float().mean()):9.0f} "
              f"{float(group.max() / group.float().mean()):8.2f} {0:9d} {0:8d} {lower:8d} {'':>8}")
        for policy in POLICIES:
            t0 = time.perf_counter()
            res = plan_all_ranks(tk, E, tp, policy=policy)
            ms = (time.perf_counter() - t0) * 1e3
            recv = res.group.alloc_ER.sum(0)
            redundant, moved = (int(v) for v in replication_cost(res.group.alloc_ER))
            print(f"{'':7} {policy:>8} {int(recv.max()):9d} {float(recv.float().mean()):9.0f} "
                  f"{float(recv.max() / recv.float().mean()):8.2f} {redundant:9d} {moved:8d} "
                  f"{lower:8d} {ms:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
