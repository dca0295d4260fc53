"""The FP8 wgrad GEMM's configs and cost model: the host mirror of the device's choice.

The prep kernel of ``moonep_grouped_gemm_fp8_wgrad`` (cutlass_kernels/kernel_fp8_wgrad.cu)
evaluates this model on the device from the group sizes and runs the cheapest config; :func:`pick`
is the same rule on the host, in the same float32 operations and order (the device rounds each
one explicitly, so the two agree bit for bit; the tests hold the device to it).

dW_g = dy_g^T x_g is an O x I output per group with K = M_g tokens.  Every group has the same
output tiles T_c = (ceil(O / BM) rounded up to CM) * (ceil(I / BN) rounded up to CN), and a tile
of group g runs kb_g = ceil(M_g / 128) K blocks.  With the non-empty groups' count n, the sum
and the max of kb_g:

    work_c = T_c * (per_round_c * n + per_kblock_c * sum kb)          tile-microseconds
    t_c    = fixed_c + max(work_c / slots_c, per_round_c + per_kblock_c * max kb,
                           bytes / MEM_BYTES_PER_US)

slots_c = sm_count (x2 for ping-pong: two tiles in flight per SM). The groups run largest first
(LPT), so the balanced bound work / slots is close when tiles outnumber the SMs, and the
one-tile term (0 when every group is empty) bounds a call with few tiles. bytes = sum over
non-empty groups of M_g * (O + I) (the e4m3 operands) + 2 * O * I (the bf16 dW). The cheapest
prediction wins; one within TIE_TOL of it ties and goes to the lower index. Constants:
:mod:`moonep_ops.gemm.tuning_fp8_wgrad` (seeded, not yet fitted).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from . import fp8_cost, tuning_fp8_wgrad
from .fp8_cost import MAX_CONFIGS, TILE, Fp8Config, round_up

# Config-index order of the library (kernel_fp8_wgrad.cu Configs); the device chooses among all.
WGRAD_CONFIGS: tuple[Fp8Config, ...] = (
    Fp8Config("c128x128", 128, 128, False, EN=64, raster_n=True),
    Fp8Config("p64x128", 64, 128, True, raster_n=True),
)
NAMES = tuple(c.name for c in WGRAD_CONFIGS)
config_index = fp8_cost.config_indexer(NAMES, "FP8 wgrad")


def tiles_per_group(O: int, I: int, cfg: Fp8Config) -> int:
    return round_up(-(-O // cfg.BM), cfg.CM) * round_up(-(-I // cfg.BN), cfg.CN)


def predict(counts: Sequence[int], O: int, I: int, sm_count: int,
            constants: dict | None = None, mem_bytes_per_us: float | None = None) -> dict:
    """Predicted µs per config, float32, in the device's order of operations."""
    constants = tuning_fp8_wgrad.CONSTANTS if constants is None else constants
    f = np.float32
    bw = f(tuning_fp8_wgrad.MEM_BYTES_PER_US if mem_bytes_per_us is None else mem_bytes_per_us)
    kbs = [-(-int(c) // TILE) for c in counts if int(c) > 0]
    n, kb_sum, kb_max = len(kbs), sum(kbs), max(kbs, default=0)
    rows = sum(int(c) for c in counts if int(c) > 0)
    bytes_ = f(f(rows) * f(O + I)) + f(f(n) * f(f(f(2.0) * f(O)) * f(I)))
    t_mem = f(bytes_ / bw)
    out = {}
    for cfg in WGRAD_CONFIGS:
        fixed, per_round, per_kb = (f(v) for v in constants[cfg.name])
        slots = f(sm_count * (2 if cfg.pingpong else 1))
        per_tile_sum = f(f(per_round * f(n)) + f(per_kb * f(kb_sum)))
        balanced = f(f(f(tiles_per_group(O, I, cfg)) * per_tile_sum) / slots)
        one_tile = f(per_round + f(per_kb * f(kb_max))) if n else f(0.0)
        out[cfg.name] = float(f(fixed + max(balanced, one_tile, t_mem)))
    return out


def pick(pred: dict, tie_tol: float | None = None) -> str:
    """The cheapest config; within tie_tol of it the lowest index wins (the device's rule)."""
    return fp8_cost.pick_among(NAMES, pred,
                               tuning_fp8_wgrad.TIE_TOL if tie_tol is None else tie_tol)


def select(counts: Sequence[int], O: int, I: int, sm_count: int) -> str:
    return pick(predict(counts, O, I, sm_count))


def tuning_table() -> list[float]:
    """The device's tuning table, the FP8 GEMM's layout (fp8_cost.tuning_table_of)."""
    return fp8_cost.tuning_table_of(WGRAD_CONFIGS, tuning_fp8_wgrad)
