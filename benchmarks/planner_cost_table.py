"""Predicted expert time of one MoE layer's training step: plain EP, exact MoonEP, policy "cost".

    python benchmarks/planner_cost_table.py [--tokens 1024] [--slack 0.05 0.1] [--markdown]
                                            [--models dsv3 kimi] [--ranks 8 64] [--topk 4]

For each model-zoo shape (D, F, E, K) at EP R (where E % R == 0) and each routing, the group's
per-expert counts of T = R*s*K token copies are planned three ways:
  plain   every expert at home (all-to-all EP), no replicas;
  exact   policy "moonep": every rank exactly its cap;
  cost    policy "cost" with the slack eps (caps <= ceil(s*K*(1+eps))), replica_cost from the
          Buffer's static shapes (moonep_ops.gemm.plan_cost.replica_cost).
and each plan gets the prediction of moonep_ops.gemm.plan_cost.plan_time: the slowest rank's
nine expert GEMMs (fwd, dgrad, wgrad of gate/up/down over its segments padded to token_padding,
at the configs the device selector picks; gemm/cost_model.py with the fitted H200 constants)
plus the replicas' weights (pushed twice: forward and the backward's re-stage) and grads
(pulled once) on the busiest link at links.LINK_GBPS (450 GB/s: the H200 datasheet's NVLink 4,
not measured).  bf16 weights.

Routings (counts are the expected loads rounded by largest remainder, so the imbalance is the
one asked for rather than sampling noise):
  lognormal x %   expert popularity exp(sigma*z), z ~ N(0, 1), sigma set so that the largest
                  rank group is (1 + x %) of the mean;
  hot maxvio v    one expert at (v + 1) x the mean load, the others equal (v <= E - 1: with
                  E = 8, Mixtral's 'maxvio 10 / 20' rows send every copy to one expert).
Columns: imb = largest group / mean - 1; maxvio = largest expert / mean - 1; repl = redundant
slots over the group; moved = token copies computed off their home rank; GB = replica bytes
over all links in one step; ms = predicted GEMM + link time of the step (the slowest rank's
GEMMs plus the busiest link).  The summary checks: at imb <= 5 % the cost policy sends >= 5x
fewer bytes than exact with a predicted time no worse; at maxvio >= 10 its time is within 2 %
of exact's (or better).
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from moonep_ops.geometry import ceil_div, slack_cap, slack_to_ppm
from moonep_ops.gemm import links
from moonep_ops.gemm import plan_cost as pc
from moonep_ops.planner import level_quotas, plan_group, split_quotas_batched

MODELS = {                      # name: (D, F, E, K)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "kimi-k2": (7168, 2048, 384, 8),
    "mixtral-8x22b": (6144, 16384, 8, 2),
    "gpt-oss-120b": (2880, 2880, 128, 4),
}
ROUTINGS = [("lognormal", 0.01), ("lognormal", 0.02), ("lognormal", 0.05), ("lognormal", 0.10),
            ("hot", 10.0), ("hot", 20.0)]


def round_counts(p: torch.Tensor, T: int) -> torch.Tensor:
    """Largest-remainder rounding of T * p (p sums to 1): non-negative ints summing to T."""
    x = p.double() * T
    base = x.floor().long()
    left = T - int(base.sum())
    order = torch.sort(-(x - base), stable=True).indices
    base[order[:left]] += 1
    return base


def imbalance(cnt: torch.Tensor, R: int) -> float:
    g = cnt.view(R, -1).sum(1).double()
    return float(g.max() / g.mean() - 1)


def maxvio(cnt: torch.Tensor) -> float:
    return float(cnt.max() / cnt.double().mean() - 1)


def routing_counts(kind: str, param: float, R: int, E: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "hot":
        p = torch.full((E,), 1.0, dtype=torch.float64)
        hot = int(torch.randint(E, (1,), generator=g))
        v = min(param, E - 1)                   # E - 1: every copy to one expert (Mixtral)
        p[:] = (E - (v + 1)) / (E - 1)
        p[hot] = v + 1
        return round_counts(p / p.sum(), T)
    z = torch.randn(E, generator=g, dtype=torch.float64)
    lo, hi = 0.0, 4.0
    for _ in range(60):                         # bisection on sigma for the rank imbalance
        mid = (lo + hi) / 2
        p = torch.exp(mid * z)
        if imbalance(round_counts(p / p.sum(), T), R) < param:
            lo = mid
        else:
            hi = mid
    p = torch.exp(hi * z)
    return round_counts(p / p.sum(), T)


def oracle_ratio(cnt, R, T, tp, eps, chosen_us, D, F, link_gbps, n=41) -> float:
    """The cost policy's predicted time over the best of exact MoonEP and n level plans evenly
    over its range, each timed with the full cost model (the planner itself scores them with
    its linear model): 1.0 when the linear model picked what the full model would."""
    even = ceil_div(T, R)
    hi = min(max(int(cnt.view(R, -1).sum(1).max()), even), slack_cap(even, slack_to_ppm(eps)))
    levels = torch.unique(torch.linspace(even, hi, n).round().long())
    z, ok = level_quotas(cnt.view(R, -1).sum(1).long(), levels)
    allocs = split_quotas_batched(cnt.long(), z)
    tpe = torch.zeros(R, cnt.numel(), dtype=torch.int32)
    tpe[0] = cnt
    cands = [a for a, f in zip(allocs, ok) if f] + [plan_group(tpe, T, tp, "moonep").alloc_ER]
    best = min(pc.plan_time(a, D, F, token_padding=tp, link_gbps=link_gbps).total_us
               for a in cands)
    return chosen_us / best


def run(models, ranks, tokens, topk, slacks, tp, seed, link_gbps, oracle=False):
    rows = []
    for name in models:
        D, F, E, K0 = MODELS[name]
        K = topk or K0
        for R in ranks:
            if E % R or E // R < 1:
                continue
            T = R * tokens * K
            rcs = pc.replica_cost(D, F, R=R, E=E, S=tokens, K=K, token_padding=tp,
                                  link_gbps=link_gbps)
            for kind, param in ROUTINGS:
                cnt = routing_counts(kind, param, R, E, T, seed)
                base = dict(model=name, R=R, s=tokens, K=K, routing=f"{kind} {param:g}",
                            kind=kind, param=param, imb=imbalance(cnt, R), maxvio=maxvio(cnt),
                            rc=rcs.copies)
                tpe = torch.zeros(R, E, dtype=torch.int32)
                tpe[0] = cnt
                exact = plan_group(tpe, T, tp, "moonep").alloc_ER
                kw = dict(token_padding=tp, link_gbps=link_gbps)
                base["plain"] = pc.plan_time(exact, D, F, plain=True, **kw)
                base["exact"] = pc.plan_time(exact, D, F, **kw)
                for eps in slacks:
                    alloc = plan_group(tpe, T, tp, "cost", slack_to_ppm(eps), rcs.copies).alloc_ER
                    base[f"cost {eps:g}"] = pc.plan_time(alloc, D, F, **kw)
                    if oracle:
                        base[f"oracle {eps:g}"] = oracle_ratio(
                            cnt, R, T, tp, eps, base[f"cost {eps:g}"].total_us, D, F, link_gbps)
                rows.append(base)
    return rows


def _fmt(t: pc.PlanTime) -> str:
    return f"{t.replicas} | {t.moved} | {t.wire_bytes / 1e9:.1f} | {t.total_us / 1e3:.2f}"


def print_table(rows, slacks, title):
    print(f"\n{title}\n")
    head = "| model | R | s | K | routing | imb % | maxvio | plain ms | exact repl | moved | GB | ms |"
    sep = "|---|---|---|---|---|---|---|---|---|---|---|---|"
    for eps in slacks:
        head += f" cost {eps:g} repl | moved | GB | ms |"
        sep += "---|---|---|---|"
    print(head)
    print(sep)
    for r in rows:
        line = (f"| {r['model']} | {r['R']} | {r['s']} | {r['K']} | {r['routing']} | "
                f"{100 * r['imb']:.1f} | {r['maxvio']:.1f} | {r['plain'].total_us / 1e3:.2f} | "
                f"{_fmt(r['exact'])} |")
        for eps in slacks:
            line += f" {_fmt(r[f'cost {eps:g}'])} |"
        print(line)


def summary(rows, slacks) -> bool:
    ok = True
    print()
    for eps in slacks:
        key = f"cost {eps:g}"
        low = [r for r in rows if r["imb"] <= 0.05 + 1e-9]
        high = [r for r in rows if r["maxvio"] >= 10 - 1e-9]
        worst_bytes = min((r["exact"].wire_bytes / r[key].wire_bytes if r[key].wire_bytes
                           else math.inf for r in low if r["exact"].wire_bytes),
                          default=math.inf)
        zero = sum(1 for r in low if r[key].wire_bytes == 0)
        slower_low = [r for r in low if r[key].total_us > r["exact"].total_us]
        worst_low = max((r[key].total_us / r["exact"].total_us for r in low), default=0.0)
        worst_high = max((r[key].total_us / r["exact"].total_us for r in high), default=0.0)
        best_high = min((r[key].total_us / r["exact"].total_us for r in high), default=0.0)
        shown = "inf" if worst_bytes == math.inf else f"{worst_bytes:.1f}x"
        if f"oracle {eps:g}" in rows[0]:
            print(f"eps = {eps:g}: predicted time over the best of 41 levels and exact, by the "
                  f"full cost model: <= {max(r[f'oracle {eps:g}'] for r in rows):.4f}")
        print(f"eps = {eps:g}: imb <= 5 % ({len(low)} rows): bytes exact / cost >= "
              f"{shown} ({zero} rows send none), time cost / exact <= {worst_low:.3f}"
              f"{' (SLOWER in %d rows)' % len(slower_low) if slower_low else ''}; "
              f"maxvio >= 10 ({len(high)} rows): time cost / exact in "
              f"[{best_high:.3f}, {worst_high:.3f}]")
        ok &= worst_bytes >= 5 and not slower_low and worst_high <= 1.02
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--ranks", nargs="*", type=int, default=[8, 16, 64])
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank s")
    ap.add_argument("--topk", type=int, default=0, help="override every model's K")
    ap.add_argument("--slack", nargs="*", type=float, default=[0.05, 0.1])
    ap.add_argument("--token-padding", type=int, default=128)
    ap.add_argument("--link-gbps", type=float, default=None,
                    help=f"default {links.LINK_GBPS:g} ({links.LINK_SOURCE})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--oracle", action="store_true",
                    help="also time 41 level plans per row with the full cost model: how far "
                         "the planner's linear score is from the full model's best")
    ap.add_argument("--others", action="store_true",
                    help="also the shapes beyond the named ones: s in {256, 4096}, K in {4, 16} "
                         "on deepseek-v3 and qwen3-30b-a3b")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"link {a.link_gbps or links.LINK_GBPS:g} GB/s per direction "
          f"({'measured' if links.LINK_MEASURED else 'datasheet, not measured'}), "
          f"token_padding {a.token_padding}, bf16, seed {a.seed}")
    rows = run(a.models, a.ranks, a.tokens, a.topk, a.slack, a.token_padding, a.seed,
               a.link_gbps, a.oracle)
    print_table(rows, a.slack, f"s = {a.tokens} tokens per rank, each model's own K")
    ok = summary(rows, a.slack)
    if a.others:
        more = []
        for s, K in ((256, 0), (4096, 0), (1024, 4), (1024, 16)):
            more += run(["deepseek-v3", "qwen3-30b-a3b"], a.ranks, s, K, a.slack,
                        a.token_padding, a.seed, a.link_gbps, a.oracle)
        print_table(more, a.slack, "Other shapes: s in {256, 4096}, K in {4, 16}")
        ok &= summary(more, a.slack)
    print(f"\nacceptance: {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
