"""Does a wgrad_lp tile cost more when more CTAs are busy, or when its cluster pads a column tile?

    python diagnostics/wgrad_busy_ctas.py [--rows 8192] [--rounds 7]

The cost model gives every wgrad tile the same time whatever the number of busy SMs (one CTA's
share of the dense peak), so a call of one round costs one tile.  The zoo's worst wgrad_lp pick
contradicts that: Qwen3-30B EP 64 down (O = 2048, I = 768, two groups of 8192 rows) runs
`c128x256` in 132 us with 128 CTAs (the 1 x 2 cluster pads I's 3 column tiles to 4, so 32 of
them multiply zeros) where the transposed shape (O = 768, I = 2048: 96 CTAs, no padding) runs the
same 128 x 256 x 8192 tile in 93 us.  This probe separates the two causes on one tile size:
O = 2048 and two groups of ``--rows`` rows, I from 512 to 2048, every wgrad_lp config forced and
torch._grouped_mm, interleaved (CUDA events, medians).  Printed per config and I: us, CTAs with
a tile (padding included), padding CTAs, rounds of 132, and us per round.  Equal us per round at
I = 768 (32 padding CTAs) and I = 1024 (none, also 128 CTAs) blames the number of busy CTAs;
I = 1024 near the 96-CTA time blames the padding.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import gemm_bench_common as common  # noqa: E402
from moonep_ops.gemm import cost_model as cm  # noqa: E402
from moonep_ops.ops import grouped_mm as gg  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192, help="rows of each of the two groups")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--O", type=int, default=2048)
    ap.add_argument("--I", default="512,768,1024,1280,1536,2048")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    P = torch.cuda.get_device_properties(0).multi_processor_count
    O, rows, epn = args.O, args.rows, 2
    counts = [rows, rows, 0, 0]
    M = 2 * rows
    cu = torch.tensor([rows, 2 * rows, 2 * rows, 2 * rows], dtype=torch.int32, device="cuda")
    names = [c.name for c in cm.CONFIGS["wgrad_lp"]]
    print(f"wgrad_lp, O = {O}, groups {counts}, {P} SMs; per config: us | CTAs with a tile "
          f"(padding) | rounds | us per round")
    for I in (int(v) for v in args.I.split(",")):
        g = torch.Generator(device="cuda").manual_seed(I)
        dy = torch.randn(M, O, device="cuda", generator=g).to(torch.bfloat16)
        x = torch.randn(M, I, device="cuda", generator=g).to(torch.bfloat16)
        gl = torch.empty(epn, O, I, dtype=torch.bfloat16, device="cuda")
        gs = torch.empty_like(gl)
        fns = {n: (lambda i=i: gg._launch("wgrad_lp", i, dy, x, None, gl, gs, cu, epn, M, O, I))
               for i, n in enumerate(names)}
        dyt = dy.t()
        fns["torch"] = lambda: torch._grouped_mm(dyt, x, offs=cu)
        t = common.time_interleaved(fns, rounds=args.rounds)
        t.pop("_meta")
        flops = 2.0 * M * O * I
        cells = []
        for n in names:
            cfg = cm.CONFIGS["wgrad_lp"][cm.config_index("wgrad_lp", n)]
            tiles = 2 * cm.wgrad_tiles(O, I, cfg)
            real = 2 * math.ceil(O / cfg.BM) * math.ceil(I / cfg.BN)
            rounds = math.ceil(tiles / P)
            us = t[n]["us"]
            cells.append(f"{n} {us:7.1f} | {tiles:3d} ({tiles - real:2d}) | {rounds} | "
                         f"{us / rounds:6.1f}")
        print(f"I = {I:5d}: " + "; ".join(cells) + f"; torch {t['torch']['us']:7.1f} "
              f"({flops / t['torch']['us'] / 1e6:.0f} TF/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
