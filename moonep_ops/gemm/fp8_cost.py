"""The FP8 grouped GEMM's configs and cost model: the host mirror of the device's choice.

The prep kernel of ``moonep_grouped_gemm_fp8`` (cutlass_kernels/kernel_fp8_fwd.cu) evaluates
this model on the device from the group sizes and runs the cheapest config; :func:`pick` is the
same rule on the host (the tests hold the device to it; the fit and the benchmarks use it).

For candidate config c with tiles of BM x BN and a CM x CN cluster:

    tiles_c  = sum over groups g of (ceil(M_g / BM) rounded up to CM) * (ceil(n / BN) rounded
               up to CN)
    rounds_c = ceil(tiles_c / (sm_count * (2 if ping-pong else 1)))
    t_c      = fixed_c + max(rounds_c * (per_round_c + per_kblock_c * ceil(k / 128)),
                             compulsory bytes / MEM_BYTES_PER_US)

with the compulsory bytes = n * k for each non-empty group (its e4m3 weight) + rows * k (A) +
2 * rows * n (bf16 D).  The cheapest prediction wins; one within TIE_TOL of it ties and goes to
the lower index.  Constants: :mod:`moonep_ops.gemm.tuning_fp8`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import tuning_fp8

TILE = 128          # the scale block: K tile of every config, and the widest N tile
MAX_CONFIGS = 8     # moonep_gemm.h MOONEP_GEMM_FP8_MAX_CONFIGS (the tuning table's stride)


@dataclass(frozen=True)
class Fp8Config:
    name: str
    BM: int
    BN: int
    pingpong: bool
    CM: int = 1
    CN: int = 2
    EN: int = 0             # epilogue subtile width (0: CUTLASS's)
    raster_n: bool = False  # the persistent scheduler's order (False: along M)

    def geometry(self) -> tuple[int, ...]:
        """moonep_gemm_fp8_config_info's 8 ints: BM, BN, BK, CM, CN, pingpong, EN, swap."""
        return (self.BM, self.BN, TILE, self.CM, self.CN, int(self.pingpong), self.EN, 0)


# Config-index order of the library (kernel_fp8_fwd.cu Configs).  The device chooses among the
# first AUTO_CONFIGS (one fused kernel: one cluster shape and one persistent grid); a config
# listed after them would run only when forced.  Both are cluster 1 x 2 with raster along N; why
# these two and what was measured against them: docs/fp8.md, "The FP8 grouped GEMM kernel".
FP8_CONFIGS: tuple[Fp8Config, ...] = (
    Fp8Config("c128x128", 128, 128, False, EN=64, raster_n=True),
    Fp8Config("p64x128", 64, 128, True, raster_n=True),
)
AUTO_CONFIGS = 2
NAMES = tuple(c.name for c in FP8_CONFIGS)
AUTO_NAMES = NAMES[:AUTO_CONFIGS]


def config_indexer(names: tuple[str, ...], what: str):
    """An FP8 GEMM's ``config_index`` over its config ``names`` (``what``: its name in errors)."""
    def config_index(config) -> int:
        """-1 for None / 'auto' / -1, else the index of a name or an int in range (ValueError)."""
        if config is None or config == "auto" or config == -1:
            return -1
        if isinstance(config, str):
            if config not in names:
                raise ValueError(f"{what} config {config!r}: not one of {names} or 'auto'")
            return names.index(config)
        if isinstance(config, bool) or not isinstance(config, int) or not 0 <= config < len(names):
            raise ValueError(f"{what} config {config!r}: an index in [0, {len(names)}), a name "
                             f"of {names}, or -1 / None / 'auto'")
        return config
    return config_index


config_index = config_indexer(NAMES, "FP8 GEMM")


def round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def tiles(counts: Sequence[int], n: int, cfg: Fp8Config) -> int:
    """Output tiles the persistent scheduler walks: every group's M and N tile counts rounded up
    to the cluster's."""
    n_tiles = round_up(-(-n // cfg.BN), cfg.CN)
    return sum(round_up(-(-int(c) // cfg.BM), cfg.CM) * n_tiles for c in counts if c > 0)


def rounds(counts: Sequence[int], n: int, cfg: Fp8Config, sm_count: int) -> int:
    """Rounds of output tiles over the SMs (two tiles in flight per SM for ping-pong)."""
    return -(-tiles(counts, n, cfg) // (sm_count * (2 if cfg.pingpong else 1)))


def predict(counts: Sequence[int], n: int, k: int, sm_count: int,
            constants: dict | None = None, mem_bytes_per_us: float | None = None) -> dict:
    """Predicted µs per candidate config (the first AUTO_CONFIGS), in float32 in the device's
    order of operations (the device may contract a multiply-add into an FMA: the tie window
    absorbs that ulp)."""
    constants = tuning_fp8.CONSTANTS if constants is None else constants
    bw = np.float32(tuning_fp8.MEM_BYTES_PER_US if mem_bytes_per_us is None else mem_bytes_per_us)
    f = np.float32
    rows = sum(int(c) for c in counts)
    nonempty = sum(1 for c in counts if c > 0)
    t_mem = (f(nonempty) * f(n) * f(k) + f(rows) * f(k) + f(2.0 * rows) * f(n)) / bw
    kblocks = f(-(-k // TILE))
    out = {}
    for cfg in FP8_CONFIGS[:AUTO_CONFIGS]:
        fixed, per_round, per_kb = (f(v) for v in constants[cfg.name])
        r = f(rounds(counts, n, cfg, sm_count))
        out[cfg.name] = float(fixed + max(r * (per_round + per_kb * kblocks), t_mem))
    return out


def pick(pred: dict, tie_tol: float | None = None) -> str:
    """The cheapest config; within tie_tol of it the lowest index wins (the device's rule)."""
    return pick_among(NAMES, pred, tuning_fp8.TIE_TOL if tie_tol is None else tie_tol)


def pick_among(names: Sequence[str], pred: dict, tie_tol: float) -> str:
    """``pick``'s rule over ``names`` (config-index order), in the device's float32 operations."""
    f = np.float32
    window = f(f(min(pred.values())) * f(f(1.0) + f(tie_tol)))
    for name in names:
        if name in pred and f(pred[name]) <= window:
            return name
    raise AssertionError("unreachable")


def select(counts: Sequence[int], n: int, k: int, sm_count: int) -> str:
    return pick(predict(counts, n, k, sm_count))


def tuning_table() -> list[float]:
    return tuning_table_of(FP8_CONFIGS[:AUTO_CONFIGS], tuning_fp8)


def tuning_table_of(configs: Sequence[Fp8Config], tuning) -> list[float]:
    """The device's float[MOONEP_GEMM_FP8_TUNING_LEN] for the configs it chooses among (in
    config-index order) with the constants of ``tuning`` (tuning_fp8 or tuning_fp8_wgrad):
    fixed[MAX], per_round[MAX], per_kblock[MAX] (unused slots 0), mem_bytes_per_us, tie_tol."""
    cols = [[0.0] * MAX_CONFIGS for _ in range(3)]
    for i, cfg in enumerate(configs):
        for j, v in enumerate(tuning.CONSTANTS[cfg.name]):
            cols[j][i] = float(v)
    out = cols[0] + cols[1] + cols[2] + [float(tuning.MEM_BYTES_PER_US), float(tuning.TIE_TOL)]
    assert all(math.isfinite(v) for v in out)
    return out
