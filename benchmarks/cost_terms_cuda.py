"""Policy "cost"'s two model terms against the H200: the slowest rank's expert GEMMs and a
replica's bytes.

    python benchmarks/cost_terms_cuda.py [--models qwen3-30b-a3b deepseek-v3] [--tokens 4096]

For each model-zoo shape at EP R = 8 and each routing (benchmarks/planner_cost_table.py's
routings and plans: plain EP, exact MoonEP, policy "cost" with eps = 0.05), the rank the model
predicts slowest is built on this GPU as it would run: its home segments and its slots' segments
(padded to token_padding) as the 2*epn groups of one receive buffer, random bf16 rows and
weights, and the nine GEMMs of one training step (forward gate, up, down; their dgrads; their
wgrads written in bf16, the MoE backward's path) are timed back to back (CUDA events, median).
Printed beside the prediction (gemm/plan_cost.py: expert_gemm_us): measured / predicted per
row, and whether the model orders the three plans as the GPU does.

The link term: one replica's weights (3*D*F bf16) as a device-to-device copy, against
links.DEVICE_COPY_TBPS; over NVLink it needs two GPUs (not on a one-GPU machine: printed n/a).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm_bench_common as common  # noqa: E402
from planner_cost_table import MODELS, imbalance, routing_counts  # noqa: E402

from moonep_ops.geometry import slack_to_ppm  # noqa: E402
from moonep_ops.gemm import links  # noqa: E402
from moonep_ops.gemm import plan_cost as pc  # noqa: E402
from moonep_ops.ops import grouped_mm as gm  # noqa: E402
from moonep_ops.planner import plan_group  # noqa: E402

ROUTINGS = [("lognormal", 0.02), ("lognormal", 0.05), ("hot", 10.0)]


def predicted_slowest(alloc_ER, D, F, tp, plain):
    R = alloc_ER.shape[1]
    best = (-1.0, 0)
    for d in range(R):
        h, s = pc.rank_segments(alloc_ER, d, token_padding=tp, plain=plain)
        us = pc.expert_gemm_us(h + s, D, F)
        best = max(best, (us, d))
    return best[1], best[0]


def time_rank(home, slots, D, F, B, iters=10):
    """Median µs of the rank's nine training GEMMs on this GPU."""
    counts = home + slots + [0] * (B - len(slots))
    M = max(sum(counts), 1)
    cu = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(M, D, device=dev, dtype=bf)
    h = torch.randn(M, F, device=dev, dtype=bf)
    w13 = [torch.randn(B, F, D, device=dev, dtype=bf) * 0.02 for _ in range(2)]
    s13 = [torch.randn(B, F, D, device=dev, dtype=bf) * 0.02 for _ in range(2)]
    w2, s2 = (torch.randn(B, D, F, device=dev, dtype=bf) * 0.02 for _ in range(2))
    g13 = [torch.empty(B, F, D, device=dev, dtype=bf) for _ in range(4)]
    g2 = [torch.empty(B, D, F, device=dev, dtype=bf) for _ in range(2)]
    dyF = torch.randn(M, F, device=dev, dtype=bf)
    dyD = torch.randn(M, D, device=dev, dtype=bf)

    def step():
        gm.grouped_mm(x, w13[0], s13[0], cu)
        gm.grouped_mm(x, w13[1], s13[1], cu)
        gm.grouped_mm(h, w2, s2, cu)
        gm.grouped_mm_dgrad(dyF, w13[0], s13[0], cu)
        gm.grouped_mm_dgrad(dyF, w13[1], s13[1], cu)
        gm.grouped_mm_dgrad(dyD, w2, s2, cu)
        gm.grouped_mm_wgrad_into(dyF, x, cu, g13[0], g13[1])
        gm.grouped_mm_wgrad_into(dyF, x, cu, g13[2], g13[3])
        gm.grouped_mm_wgrad_into(dyD, h, cu, g2[0], g2[1])

    return common.time_us(step, iters=iters, warmup=3)


def copy_gbps(nbytes: int, iters: int = 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = common.time_us(lambda: dst.copy_(src), iters=iters, warmup=3)
    return 2 * nbytes / (us * 1e-6) / 1e9   # read + write


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "deepseek-v3"])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--slack", type=float, default=0.05)
    ap.add_argument("--token-padding", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cost_terms_cuda: needs a GPU")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; R = {a.ranks}, "
          f"s = {a.tokens}, token_padding {a.token_padding}, eps {a.slack}")
    print("\n| model | routing | imb | plan | rank | predicted GEMM us | measured us | meas / pred |")
    print("|---|---|---|---|---|---|---|---|")
    ratios, order_ok, order_n = [], 0, 0
    R, tp = a.ranks, a.token_padding
    for name in a.models:
        D, F, E, K = MODELS[name]
        if E % R:
            continue
        B = E // R
        T = R * a.tokens * K
        rcs = pc.replica_cost(D, F, R=R, E=E, S=a.tokens, K=K, token_padding=tp)
        for kind, param in ROUTINGS:
            cnt = routing_counts(kind, param, R, E, T, a.seed)
            tpe = torch.zeros(R, E, dtype=torch.int32)
            tpe[0] = cnt
            exact = plan_group(tpe, T, tp, "moonep").alloc_ER
            cost = plan_group(tpe, T, tp, "cost", slack_to_ppm(a.slack), rcs.copies).alloc_ER
            got = {}
            for plan, alloc, plain in (("plain", exact, True), ("exact", exact, False),
                                       ("cost", cost, False)):
                d, pred = predicted_slowest(alloc, D, F, tp, plain)
                home, slots = pc.rank_segments(alloc, d, token_padding=tp, plain=plain)
                meas = time_rank(home, slots, D, F, B)
                got[plan] = (pred, meas)
                ratios.append(meas / pred)
                print(f"| {name} | {kind} {param:g} | {imbalance(cnt, R):.3f} | {plan} | {d} | "
                      f"{pred:.0f} | {meas:.0f} | {meas / pred:.3f} |")
                torch.cuda.empty_cache()
            for p, q in (("plain", "exact"), ("exact", "cost"), ("plain", "cost")):
                (pp, mp), (pq, mq) = got[p], got[q]
                if abs(pp - pq) > 0.02 * max(pp, pq):     # the model calls a winner
                    order_n += 1
                    order_ok += (pp < pq) == (mp < mq)
    g = statistics.geometric_mean(ratios)
    print(f"\nmeasured / predicted GEMM time: gmean {g:.3f}, min {min(ratios):.3f}, "
          f"max {max(ratios):.3f} over {len(ratios)} rank-steps; the model orders "
          f"{order_ok}/{order_n} plan pairs it separates by > 2 % as the GPU does")
    print("\n| link term | bytes | measured GB/s | model GB/s |")
    print("|---|---|---|---|")
    for name in a.models:
        D, F, _, _ = MODELS[name]
        nb = 3 * D * F * 2
        print(f"| {name}: one replica's bf16 weights, device copy (read + write) | {nb / 1e6:.0f} MB | "
              f"{copy_gbps(nb):.0f} | {links.DEVICE_COPY_TBPS * 1e3:.0f} (DEVICE_COPY_TBPS) |")
    if torch.cuda.device_count() < 2:
        print(f"| over NVLink | - | n/a (one GPU) | {links.LINK_GBPS:.0f} (LINK_GBPS, datasheet) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
