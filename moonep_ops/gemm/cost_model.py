"""Analytical cost model and configuration selector for the MoE grouped GEMM.

Legend: G groups (2*epn), M_g rows of group g (its token count), O/I the weight's [O, I] shape,
P persistent CTAs (SMs), BM x BN the CTA tile, CM x CN the cluster, tau the time of one tile.

What the kernels do (cutlass_kernels/), and hence what the model counts:
  * fwd   y[rows g] = x[rows g] @ W_g^T      output tiles over (M_g, O), reduction I;
  * dgrad dx[rows g] = dy[rows g] @ W_g      output tiles over (M_g, I), reduction O;
  * wgrad dW_g += dy[rows g]^T @ x[rows g]   output tiles over (O, I), reduction M_g (ragged),
    fp32 read-modify-write of the grads (O*I*8 bytes per group);
  * wgrad_lp  the same product written once in bf16 (O*I*2 bytes per group; autograd path).
  The CUTLASS sm90 group scheduler is a static persistent round robin: tiles of all groups are
  linearised in group order (M fastest inside a group), CTA p takes tiles p, p+P, p+2P, ...

fwd / dgrad (all tiles cost the same; the ragged dimension only changes how many there are):
  tiles_g = roundup(ceil(M_g/BM), CM) * roundup(ceil(n_out/BN), CN)     (0 when M_g == 0; the
            group scheduler rounds each group's tile counts up to the cluster; swap-AB:
            roundup(ceil(n_out/BM), CM) * roundup(ceil(M_g/BN), CN))
  tau     = 2*BM*BN*k_red / (PEAK/NUM_SMS * eta_c) + tau_epi  full tile even when M_g < BM;
            tau_epi is the epilogue time a tile adds (~0 when ping-pong overlaps it)
  The linear tile order is cut into rounds of P tiles.  A group's first-touch HBM bytes
  (weights O*I*2 + its activation rows in and out) are spread evenly over its tiles (with M-fastest
  raster each weight row slice is first read at the start of its column of M tiles).
  round time t_r = max(tau + [a group starts in r] * tau_sw, bytes_r / (HBM * bw_frac))
  T(c) = tau0 + sum_r t_r
wgrad (every non-empty group has the same tile count, but a tile costs ~ M_g):
  groups are run largest first (LPT order, done by the device prep kernel), a tile of group g
  costs max(2*BM*BN*M_g/(PEAK/P*eta), bytes_g/tiles/(HBM*bw_frac/P)), bytes_g = M_g*(O+I)*2 +
  O*I*8 (fp32 grad read + write; O*I*2 for wgrad_lp); CTA p's time is the sum over its tiles (+tau_sw per group it
  enters), and T(c) = tau0 + max_p.

The constants (eta, bw_frac, tau_sw, tau0, tau_epi per config) are moonep_ops/gemm/tuning.py's
(tuning.json: the H200's; tuning_h100.json on an H100, put in force by the launcher), fitted by
benchmarks/fit_gemm_cost_model.py on the committed measurements (benchmarks/calibration/*.json).  The same formulas run on the GPU inside the prep kernel
(cutlass_kernels/prep.cu, one warp per config), which is how the op selects a config from
device-resident counts without a host sync; this module is the reference and the API a user
asks ("what does the model predict for these counts?").

Two families of configs per kind (cutlass_kernels/configs.h), one fused kernel each, one per call:
  * "moonep" (cluster 1 x 2): the configs the device cost model chooses among, per call, from
    the counts (`candidates`: the shape's candidate set, at most 5);
  * "torch" (cluster 2 x 1; fwd, dgrad, wgrad_lp): torch._grouped_mm's own two sm90 kernels
    on our per-group pointers (no weight copy), the one of them torch would run picked by
    torch's own shape rule (`torch_config`).
The host picks the family from static shapes (`family_for`, the never-lose rule: the model on
the shape's balanced probe histogram, with a fitted margin), so a call never syncs and stays
capturable; `call_candidates` is what one call's device choice ranges over.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from . import tuning as gemm_tuning

KINDS = ("fwd", "dgrad", "wgrad", "wgrad_lp")
FAMILIES = ("moonep", "torch")


@dataclass(frozen=True)
class GemmConfig:
    """One compiled kernel.  Order inside CONFIGS[kind] is the config index of the C ABI."""

    name: str
    BM: int
    BN: int
    BK: int
    CM: int
    CN: int
    pingpong: bool
    EN: int = 0          # epilogue subtile width (0: CUTLASS's 32); no term of the model
    swap: bool = False   # swap-AB (fwd/dgrad): weight rows in BM-row M tiles, tokens in BN tiles
    # A candidate of the device selector only while the call's buffer holds at most this many
    # rows per group (M <= max_mean_rows * G; static shapes, so no sync); 0: always.
    max_mean_rows: int = 0
    # ... and only while it holds at least this many (M >= min_mean_rows * G); 0: always.
    min_mean_rows: int = 0

    @property
    def family(self) -> str:
        """'torch' for torch._grouped_mm's kernels (cluster 2 x 1), 'moonep' for the configs
        the device selector chooses among (cluster 1 x 2).  One fused kernel per family."""
        return "torch" if self.CM > 1 else "moonep"

    def candidate_for(self, rows: int, groups: int) -> bool:
        """Whether the device selector considers this config for a buffer of ``rows`` rows
        in ``groups`` groups: a "moonep" config within its max/min_mean_rows window (a "torch"
        config is never a candidate of the device choice: `torch_config` picks it)."""
        return (self.family == "moonep"
                and (not self.max_mean_rows or rows <= self.max_mean_rows * groups)
                and (not self.min_mean_rows or rows >= self.min_mean_rows * groups))


# Must match cutlass_kernels/configs.h (checked by tests/test_grouped_gemm_cuda.py against the
# library's moonep_gemm_config_info).  Family "moonep" clusters run along output columns only (an
# M-cluster rounds every group's M-tile count up to the cluster size and those padding tiles
# still run the mainloop); family "torch" is torch._grouped_mm's 2 x 1 (it multicasts the weight
# tile instead).  Candidate sets of "moonep" by mean rows per group (M / G): <= 64: c128x256,
# p128x128, s256x80, s256x96, p64x256; 65-255: the first four; >= 256: the first four and
# s256x128.  At most 5, the prep kernel's budget (a fifth costs it 0.2-0.7 us).
_FWD_CONFIGS = (
    GemmConfig("c128x256", 128, 256, 64, 1, 2, False, EN=64),
    GemmConfig("p128x128", 128, 128, 64, 1, 2, True),
    GemmConfig("s256x80", 256, 80, 64, 1, 2, False, swap=True),
    GemmConfig("s256x96", 256, 96, 64, 1, 2, False, swap=True),
    # 64-row tiles: the best config only for groups of <= ~64 rows (decode-like; 2-5 % over
    # c128x256 there, eta 0.51-0.61 elsewhere), so a candidate only there: a fifth candidate
    # costs the prep kernel 0.2-0.7 us, past the 5 us budget at MoE sizes.
    GemmConfig("p64x256", 64, 256, 64, 1, 2, True, max_mean_rows=64),
    # torch's cooperative 128x256x64 2x1 transposed (swap-AB: 256 weight rows x 128 tokens,
    # the 1x2 cluster pairs token tiles sharing one multicast weight tile): the same tile
    # area, bytes per k-step (16 + 16 KB) and 256-row token granularity, so it follows the
    # torch kernel where that wins (groups of >= 256 rows, n_out an odd number of 256-column
    # tiles) while the device still chooses per call.
    GemmConfig("s256x128", 256, 128, 64, 1, 2, False, swap=True, min_mean_rows=256),
    # family "torch": torch._grouped_mm's kernels (aten GroupMM.cu, sm90 bf16)
    GemmConfig("t128x256", 128, 256, 64, 2, 1, False),
    GemmConfig("t64x128", 64, 128, 128, 2, 1, True),
)
CONFIGS: dict[str, tuple[GemmConfig, ...]] = {
    "fwd": _FWD_CONFIGS,
    # dgrad runs fwd's configs; its c128x256 keeps CUTLASS's epilogue subtile
    "dgrad": (replace(_FWD_CONFIGS[0], EN=0),) + _FWD_CONFIGS[1:],
    "wgrad": (
        GemmConfig("c128x256", 128, 256, 64, 1, 2, False),
        GemmConfig("c128x128", 128, 128, 64, 1, 2, False),
        GemmConfig("p128x128", 128, 128, 64, 1, 2, True, EN=64),
    ),
    "wgrad_lp": (
        GemmConfig("c128x256", 128, 256, 64, 1, 2, False, EN=64),
        GemmConfig("c128x128", 128, 128, 64, 1, 2, False, EN=64),
        GemmConfig("p128x128", 128, 128, 64, 1, 2, True),
        GemmConfig("t128x256", 128, 256, 64, 2, 1, False),
        GemmConfig("t64x128", 64, 128, 128, 2, 1, True),
    ),
}


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def config_index(kind: str, name: str) -> int:
    _check_kind(kind)
    for i, c in enumerate(CONFIGS[kind]):
        if c.name == name:
            return i
    raise ValueError(f"unknown {kind} config {name!r}; known: {[c.name for c in CONFIGS[kind]]}")


def _cdiv(a, b):
    return -(-a // b)


def _n_tiles(n_out: int, cfg: GemmConfig) -> int:
    """Column tiles per M-tile row: ceil(n_out / BN), rounded up to the cluster's CN (padding tiles
    run in full)."""
    return _cdiv(_cdiv(n_out, cfg.BN), cfg.CN) * cfg.CN


def rows_tiles(counts: np.ndarray, n_out: int, cfg: GemmConfig) -> np.ndarray:
    """fwd/dgrad tiles of each group of ``counts`` rows; CUTLASS's group scheduler rounds a
    group's tile counts up to the cluster.  Swap-AB: ceil(n_out / BM) weight tiles (rounded up
    to CM) times the group's token tiles ceil(M_g / BN) (rounded up to CN); else
    ceil(M_g / BM) row tiles (rounded up to CM: torch's 2 x 1) times ``_n_tiles``."""
    if cfg.swap:
        return (_cdiv(_cdiv(counts, cfg.BN), cfg.CN) * cfg.CN
                * (_cdiv(_cdiv(n_out, cfg.BM), cfg.CM) * cfg.CM))
    return _cdiv(_cdiv(counts, cfg.BM), cfg.CM) * cfg.CM * _n_tiles(n_out, cfg)


def wgrad_tiles(O: int, I: int, cfg: GemmConfig) -> int:
    """Output tiles of one wgrad group (its [O, I] gradient): the same for every group."""
    return _cdiv(_cdiv(O, cfg.BM), cfg.CM) * cfg.CM * _n_tiles(I, cfg)


def _constants(kind: str, name: str):
    eta, bw_frac, tau_sw, tau0, tau_epi = gemm_tuning.EFFICIENCY[kind][name]
    return float(eta), float(bw_frac), float(tau_sw), float(tau0), float(tau_epi)


def row_rounds(counts: np.ndarray, n_out: int, k_red: int, cfg: GemmConfig,
               P: int) -> tuple[np.ndarray, np.ndarray]:
    """fwd/dgrad work of one config as rounds of P tiles (the persistent grid): the HBM bytes of
    each round ([R], a group's weight and rows spread evenly over its tiles) and whether a CTA
    starts a new group in it ([R] bool).  No constant enters: the fit precomputes these."""
    tiles = rows_tiles(counts, n_out, cfg)                     # [G]
    T = int(tiles.sum())
    if T == 0:
        return np.zeros(0), np.zeros(0, dtype=bool)
    bytes_g = np.where(counts > 0, n_out * k_red * 2.0 + counts * (n_out + k_red) * 2.0, 0.0)
    # cumulative bytes as a piecewise-linear function of the linear tile index
    ends = np.cumsum(tiles)
    starts = ends - tiles
    nz = tiles > 0
    xs = np.concatenate(([0.0], ends[nz].astype(np.float64)))
    ys = np.concatenate(([0.0], np.cumsum(bytes_g[nz])))
    R = _cdiv(T, P)
    bounds = np.minimum(np.arange(R + 1, dtype=np.float64) * P, T)
    switch = np.zeros(R, dtype=bool)
    switch[(starts[nz] // P).astype(np.int64)] = True
    return np.diff(np.interp(bounds, xs, ys)), switch


def wgrad_split(n_groups: int, t_w: int, P: int) -> np.ndarray:
    """[n_groups, P]: how many of CTA p's tiles fall in group j, when CTA p runs the linear
    tiles p, p + P, ... and group j owns tiles [j t_w, (j + 1) t_w)."""
    s_j = np.arange(n_groups, dtype=np.int64)[:, None] * t_w
    p = np.arange(P, dtype=np.int64)[None, :]
    return (s_j + t_w - 1 - p) // P - (s_j - 1 - p) // P


def _predict_rows(counts: np.ndarray, n_out: int, k_red: int, cfg: GemmConfig, kind: str,
                  P: int, peak: float, hbm: float) -> float:
    eta, bw_frac, tau_sw, tau0, tau_epi = _constants(kind, cfg.name)
    round_bytes, switch = row_rounds(counts, n_out, k_red, cfg, P)
    if round_bytes.size == 0:
        return tau0
    tau = 2.0 * cfg.BM * cfg.BN * k_red / (peak * 1e6 / P * eta) + tau_epi  # µs (peak: TF/s)
    bw = hbm * 1e6 * bw_frac                                        # bytes per µs
    t = np.maximum(tau + switch * tau_sw, round_bytes / bw)
    return tau0 + float(t.sum())


def _predict_wgrad(counts: np.ndarray, O: int, I: int, cfg: GemmConfig, P: int, peak: float,
                   hbm: float, kind: str) -> float:
    eta, bw_frac, tau_sw, tau0, tau_epi = _constants(kind, cfg.name)
    out_bytes = 8.0 if kind == "wgrad" else 2.0
    order = np.sort(counts[counts > 0])[::-1]                       # LPT: largest group first
    if order.size == 0:
        return tau0
    t_w = wgrad_tiles(O, I, cfg)
    comp = 2.0 * cfg.BM * cfg.BN * order / (peak * 1e6 / P * eta) + tau_epi
    mem = (order * (O + I) * 2.0 + O * I * out_bytes) / t_w / (hbm * 1e6 * bw_frac / P)
    tile_cost = np.maximum(comp, mem)                               # [G'] per tile of group j
    n = wgrad_split(order.size, t_w, P)                  # each group of a CTA is one switch
    per_cta = tile_cost @ n + (n > 0).sum(axis=0) * tau_sw
    return tau0 + float(per_cta.max())


def _as_counts(counts) -> np.ndarray:
    c = np.asarray(counts.tolist() if hasattr(counts, "tolist") else counts, dtype=np.int64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError("counts must be a non-empty 1-D sequence of per-group row counts")
    if (c < 0).any():
        raise ValueError("counts must be >= 0")
    return c


def predict(counts: Sequence[int], O: int, I: int, kind: str = "fwd", *,
            sm_count: int | None = None, configs: Sequence[str] | None = None) -> dict[str, float]:
    """Predicted run time in µs of every compiled configuration.

    ``counts``: rows per group (G values, e.g. ``cu_seqlens.diff(prepend=0)``), ``O, I``: the
    weight shape [O, I] (for every kind, the shape of W_g in y = x @ W_g^T), ``kind``: fwd, dgrad,
    wgrad (fp32 +=) or wgrad_lp (bf16 out).  Returns ``{config name: µs}`` (only for ``configs`` when given).
    """
    _check_kind(kind)
    c = _as_counts(counts)
    P = int(sm_count or gemm_tuning.NUM_SMS)
    peak, hbm = float(gemm_tuning.PEAK_TFLOPS), float(gemm_tuning.HBM_TBPS)
    out = {}
    for cfg in CONFIGS[kind]:
        if configs is not None and cfg.name not in configs:
            continue
        if kind == "fwd":
            out[cfg.name] = _predict_rows(c, O, I, cfg, kind, P, peak, hbm)
        elif kind == "dgrad":
            out[cfg.name] = _predict_rows(c, I, O, cfg, kind, P, peak, hbm)
        else:
            out[cfg.name] = _predict_wgrad(c, O, I, cfg, P, peak, hbm, kind)
    return out


def mma_volume(counts: Sequence[int], O: int, I: int, kind: str, name: str) -> float:
    """MMA work of one config, padding included, in units of the reduction length: tiles x BM x
    BN (fwd/dgrad, whose reduction length is the same for every config), or output tiles x BM x
    BN (wgrad, whose reduction over M_g is the same too).  The prep kernel's tie-break key."""
    _check_kind(kind)
    c = _as_counts(counts)
    cfg = CONFIGS[kind][config_index(kind, name)]
    if kind in ("fwd", "dgrad"):
        n_out = O if kind == "fwd" else I
        return float(int(rows_tiles(c, n_out, cfg).sum()) * cfg.BM * cfg.BN)
    return float(wgrad_tiles(O, I, cfg) * cfg.BM * cfg.BN)


def pick(pred: dict[str, float], volume: dict[str, float], kind: str,
         tol: float | None = None) -> str:
    """The selection rule, shared by `select` and the prep kernel: among the configs predicted
    within ``tol`` (default SELECT_TIE_TOL; see `tie_tolerance`) of the fastest, the one with the
    least MMA work (padding), then the first listed.  Why: a memory-bound round costs the same
    bytes whatever its tiles, so the model ties configs whose padded MMA differs by 2x (G = 96
    groups of 64 rows: c128x256 and p64x256 both 691 us; measured 3.74 against 3.92 TB/s,
    H200) and the extra MMA does not overlap the stream as max(compute, memory) assumes."""
    tol = gemm_tuning.SELECT_TIE_TOL if tol is None else tol
    best = min(pred.values())
    near = [n for n in pred if pred[n] <= best * (1.0 + tol)]
    return min(near, key=lambda n: (volume[n], config_index(kind, n)))


def small_groups(kind: str, rows: int, groups: int) -> bool:
    """True when the buffer holds so few rows per group that a small-group config (one with
    ``max_mean_rows``) is a candidate: every round of every config then streams weights."""
    _check_kind(kind)
    return any(c.max_mean_rows and c.candidate_for(rows, groups) for c in CONFIGS[kind])


def tie_tolerance(kind: str, rows: int, groups: int) -> float:
    """Near-tie window of `pick` for a call's buffer (shapes only, no sync): SELECT_TIE_TOL, or
    SELECT_TIE_TOL_SMALL on small groups (`small_groups`).  Why wider there: every round is
    bound by the weight stream, where max(compute, memory) cannot tell the configs apart (their
    predictions differ only by fitted per-call constants, 0.7-1.7 %), while measured the least
    padded MMA streams 2-5 % faster (p64x256 against c128x256; calibration set and streaming
    benchmark on the H200)."""
    return (gemm_tuning.SELECT_TIE_TOL_SMALL if small_groups(kind, rows, groups)
            else gemm_tuning.SELECT_TIE_TOL)


def candidates(kind: str, rows: int, groups: int) -> list[str]:
    """The "moonep" configs the device selector chooses among for a call whose buffer holds
    ``rows`` rows in ``groups`` groups (shapes only: known on the host without a sync)."""
    _check_kind(kind)
    return [c.name for c in CONFIGS[kind] if c.candidate_for(rows, groups)]


def torch_config(kind: str, rows: int, groups: int, O: int, I: int) -> str | None:
    """The "torch" config torch._grouped_mm itself would run for this call (its sm90 bf16 rule,
    aten/src/ATen/native/cuda/GroupMM.cu): "small" (m <= 128 or n <= 128) -> ping-pong 64x128x128
    (t64x128), else cooperative 128x256x64 (t128x256), both cluster 2 x 1.  fwd / dgrad (2-D x
    3-D): m = rows // groups (the buffer's rows per group, padding included), n = O (fwd) or I
    (dgrad); wgrad_lp (2-D x 2-D): m = O, n = I.  None for a kind without the family (wgrad)."""
    _check_kind(kind)
    fam = [c for c in CONFIGS[kind] if c.family == "torch"]
    if not fam:
        return None
    if kind in ("fwd", "dgrad"):
        m, n = rows // max(1, groups), (O if kind == "fwd" else I)
    else:
        m, n = O, I
    small = m <= 128 or n <= 128
    return next(c.name for c in fam if c.pingpong == small)


def balanced_probe(rows: int, groups: int) -> np.ndarray:
    """The stand-in histogram of a call's shape for the never-lose rule: the planner's balanced
    routing of a token-padded buffer.  The epn = G/2 home groups share the rows the buffer holds
    without its worst-case padding, rows - (tp-1)*G, rounded down to tp (tp =
    tuning.NEVER_LOSE_PROBE_TP, the recommended token_padding); the G/2 redundant slots are
    empty.  A buffer too small for that spreads its rows over the home groups as they are."""
    tp = int(getattr(gemm_tuning, "NEVER_LOSE_PROBE_TP", 128))
    epn = max(1, groups // 2)
    per = (rows - (tp - 1) * groups) // epn // tp * tp
    if per <= 0:
        per = rows // epn
    out = np.zeros(groups, dtype=np.int64)
    out[:epn] = max(0, per)
    return out


def never_lose_ratio(kind: str, rows: int, groups: int, O: int, I: int, *,
                     sm_count: int | None = None) -> float | None:
    """Predicted time of the torch family's config over that of the best "moonep" candidate on
    the shape's `balanced_probe` (None: the kind has no torch family, or nothing to do)."""
    t = torch_config(kind, rows, groups, O, I)
    cands = candidates(kind, rows, groups)
    if t is None or rows <= 0 or not cands:
        return None
    probe = balanced_probe(rows, groups)
    if not probe.any():
        return None
    pred = predict(probe, O, I, kind, sm_count=sm_count, configs=cands + [t])
    return pred[t] / min(pred[n] for n in cands)


def family_for(kind: str, rows: int, groups: int, O: int, I: int, *,
               sm_count: int | None = None) -> str:
    """The never-lose rule: which family a call of this static shape runs ("torch" or
    "moonep").  "torch" (torch._grouped_mm's own kernel, `torch_config`) when the model on the
    shape's `balanced_probe` predicts it at most (1 + NEVER_LOSE_MARGIN[kind]) times our best
    candidate, else "moonep" (the device chooses among `candidates` from the real counts).  The
    margin is fitted on the committed measurements (benchmarks/fit_gemm_cost_model.py): > 0
    gives torch's kernel the near-ties, because the device's per-call choice only helps when the
    counts are skewed while a loss to torch on a balanced call is what the rule exists to
    prevent.  Shapes only: no sync, capturable; the op caches it per shape."""
    margin = getattr(gemm_tuning, "NEVER_LOSE_MARGIN", {}).get(kind)
    if margin is None:
        return "moonep"
    r = never_lose_ratio(kind, rows, groups, O, I, sm_count=sm_count)
    return "torch" if r is not None and r <= 1.0 + float(margin) else "moonep"


def call_candidates(kind: str, rows: int, groups: int, O: int, I: int, *,
                    sm_count: int | None = None, family: str | None = None
                    ) -> tuple[str, list[str]]:
    """(family, configs) of one call: the never-lose rule's family (`family_for`, or
    ``family`` when given), and the configs its device choice ranges over: `torch_config`'s one
    config for "torch", `candidates` for "moonep"."""
    fam = family or family_for(kind, rows, groups, O, I, sm_count=sm_count)
    if fam not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {fam!r}")
    t = torch_config(kind, rows, groups, O, I) if fam == "torch" else None
    if fam == "torch" and t is None:
        raise ValueError(f"{kind} has no torch family")
    return fam, ([t] if t else candidates(kind, rows, groups))


def select(counts: Sequence[int], O: int, I: int, kind: str = "fwd", *,
           sm_count: int | None = None, rows: int | None = None,
           family: str | None = None) -> str:
    """Name of the configuration the op runs: the never-lose rule's family (`call_candidates`;
    ``family`` forces one), then, among its configs, the one the prep kernel picks (`pick`: the
    fastest predicted, near-ties within `tie_tolerance` to the least MMA work, then the first
    listed).  ``rows``: the buffer's rows (default: the sum of ``counts``)."""
    c = _as_counts(counts)
    rows = int(c.sum()) if rows is None else int(rows)
    _, names = call_candidates(kind, rows, len(c), O, I, sm_count=sm_count, family=family)
    if len(names) == 1:
        return names[0]
    pred = predict(c, O, I, kind, sm_count=sm_count, configs=names)
    return pick(pred, {n: mma_volume(counts, O, I, kind, n) for n in pred}, kind,
                tie_tolerance(kind, rows, len(c)))


def flops(counts: Sequence[int], O: int, I: int) -> float:
    """Useful FLOPs of one grouped GEMM (any of the three kinds): 2 * sum(M_g) * O * I."""
    return 2.0 * float(_as_counts(counts).sum()) * O * I


def tuning_table(kind: str, tie_tol: float | None = None) -> list[float]:
    """Constants flattened for the device selector: [peak TF/s, HBM TB/s, then per config
    eta, bw_frac, tau_sw_us, tau0_us, tau_epi_us in CONFIGS[kind] order, then the tie
    tolerance (default SELECT_TIE_TOL; the op passes `tie_tolerance` of the call)] (read by
    moonep_grouped_gemm in cutlass_kernels/prep.cu)."""
    _check_kind(kind)
    out = [float(gemm_tuning.PEAK_TFLOPS), float(gemm_tuning.HBM_TBPS)]
    for cfg in CONFIGS[kind]:
        out.extend(_constants(kind, cfg.name))
    out.append(float(gemm_tuning.SELECT_TIE_TOL if tie_tol is None else tie_tol))
    return out
