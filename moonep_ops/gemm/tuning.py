"""Fitted constants of the grouped-GEMM cost model (moonep_ops.gemm.cost_model).

THIS FILE IS REWRITTEN by ``benchmarks/fit_gemm_cost_model.py`` (from the committed measurements
in moonep_ops/gemm/calibration/); edit by hand only to seed it.

PEAK_TFLOPS / HBM_TBPS: the measured dense bf16 ceiling and device-copy bandwidth of the H200.
EFFICIENCY[kind][config] = (eta, bw_frac, tau_sw_us, tau0_us, tau_epi_us):
  eta        fraction of PEAK_TFLOPS one tile's MMA mainloop reaches with this config;
  bw_frac    fraction of HBM_TBPS reached by rounds bound by first-touch HBM bytes;
  tau_sw_us  extra time of a round in which some CTA starts a new group (descriptor update);
  tau0_us    launch + prologue + tail of one GEMM;
  tau_epi_us epilogue time one tile adds to its mainloop (not overlapped: cooperative kernels).
SEEDED[kind][config]: configs whose constants are SEEDS, not fitted on measurements of the config
  itself (why, and from what); the fit drops a config from it once the config is measured.
NEVER_LOSE_MARGIN[kind]: the margin of the never-lose rule (cost_model.family_for), fitted.
"""

CALIBRATED = True
# Where each kind's constants come from (a partial refit, --kinds, keeps the others').
CALIBRATION_SOURCES = {
    'fwd': 'benchmarks/fit_gemm_cost_model.py on moonep_ops/gemm/calibration/zoo_2026-12-01_main.json (285 training cases, 91 held out)',
    'dgrad': 'benchmarks/fit_gemm_cost_model.py on moonep_ops/gemm/calibration/zoo_2026-12-01_main.json (285 training cases, 91 held out)',
    'wgrad': 'benchmarks/calibrate_grouped_gemm.py refit from calib_s11.json, 2026-11-30',
    'wgrad_lp': 'benchmarks/fit_gemm_cost_model.py on moonep_ops/gemm/calibration/zoo_2026-12-01_main.json (285 training cases, 91 held out)',
}
CALIBRATION_SOURCE = "; ".join(f"{k}: {v}" for k, v in CALIBRATION_SOURCES.items())

PEAK_TFLOPS = 796.2
HBM_TBPS = 4.243
NUM_SMS = 132

# Not fitted (kept by the calibration script): predictions within this fraction of the fastest
# count as a tie, broken towards less MMA work (gemm_cost_model.pick).  0.5 %: no pick on the
# calibration set changes up to 2 %, and the 64-row streaming case is an exact tie.
SELECT_TIE_TOL = 0.005
# On small groups (gemm_cost_model.tie_tolerance: a config with max_mean_rows is a candidate)
# every round streams weights and the predictions differ only by fitted per-call constants;
# 2 %: the fwd picks on the calibration set's five such cases rise from 0.947-1.0 to 1.0.
SELECT_TIE_TOL_SMALL = 0.02

# The never-lose rule (cost_model.family_for): a call runs torch._grouped_mm's kernel family
# when the model, on the shape's balanced probe histogram (cost_model.balanced_probe, token
# padding NEVER_LOSE_PROBE_TP), predicts it at most (1 + margin) times our best candidate.  Fitted
# per kind by benchmarks/fit_gemm_cost_model.py on the training cases (the best mean log ratio
# to torch minus LOSS_WEIGHT x the mean shortfall below 0.98x torch); a kind without an entry
# never uses the torch family.
NEVER_LOSE_PROBE_TP = 128
NEVER_LOSE_MARGIN = {"fwd": 0.0075, "dgrad": -0.01, "wgrad_lp": -0.05}

# Configs without measurements of their own yet: their constants are seeds (refit them from a
# zoo run that measures them: benchmarks/bench_gemm_zoo.py, then fit_gemm_cost_model.py).
SEEDED = {
    "fwd": {
        "s256x128": 'seed: the constants of s256x96 (not measured)',
        "t128x256": "stand-in: torch._grouped_mm's measured time of this kernel on 279 cases + 2.13 us per-call overhead",
        "t64x128": 'seed: the constants of p64x256 (not measured)',
    },
    "dgrad": {
        "s256x128": 'seed: the constants of s256x96 (not measured)',
        "t128x256": "stand-in: torch._grouped_mm's measured time of this kernel on 279 cases + 2.06 us per-call overhead",
        "t64x128": 'seed: the constants of p64x256 (not measured)',
    },
    "wgrad_lp": {
        "t128x256": "stand-in: torch._grouped_mm's measured time of this kernel on 285 cases + 0.98 us per-call overhead",
        "t64x128": 'seed: the constants of p128x128 (not measured)',
    },
}

EFFICIENCY = {
    "fwd": {
        "c128x256": (0.9197, 1.0, 0.0, 4.1682, 3.4505),
        "p128x128": (0.905, 0.973, 0.6396, 9.7021, 1.0195),
        "s256x80": (0.8983, 1.0, 0.0, 0.0, 3.6154),
        "s256x96": (0.9034, 1.0, 0.1865, 0.0, 2.9368),
        "p64x256": (0.7319, 0.9641, 4.868, 12.5554, 0.0),
        "s256x128": (0.9034, 1.0, 0.1865, 0.0, 2.9368),
        "t128x256": (0.8761, 1.0, 0.0, 0.0, 1.8873),
        "t64x128": (0.7319, 0.9641, 4.868, 12.5554, 0.0),
    },
    "dgrad": {
        "c128x256": (0.8743, 1.0, 0.4497, 0.0, 2.9683),
        "p128x128": (0.8664, 0.958, 0.776, 8.0453, 0.5582),
        "s256x80": (0.8518, 1.0, 0.0, 0.0, 2.8977),
        "s256x96": (0.8628, 1.0, 0.2465, 0.0, 2.1981),
        "p64x256": (0.6814, 1.0, 4.348, 0.0, 0.0),
        "s256x128": (0.8628, 1.0, 0.2465, 0.0, 2.1981),
        "t128x256": (0.8561, 1.0, 0.0, 0.0, 1.6866),
        "t64x128": (0.6814, 1.0, 4.348, 0.0, 0.0),
    },
    "wgrad": {
        "c128x256": (0.8394, 0.8219, 0.2747, 10.6539, 8.1877),
        "c128x128": (0.8519, 0.8117, 0.017, 32.3064, 3.9817),
        "p128x128": (0.8626, 0.8762, 0.0, 22.4692, 2.5417),
    },
    "wgrad_lp": {
        "c128x256": (0.8534, 0.9505, 0.0, 0.0, 2.6701),
        "c128x128": (0.8336, 1.0, 0.5146, 0.0, 1.3812),
        "p128x128": (0.8575, 0.495, 0.4998, 0.0, 1.1122),
        "t128x256": (0.8588, 0.9707, 0.0, 0.0, 3.2422),
        "t64x128": (0.8575, 0.495, 0.4998, 0.0, 1.1122),
    },
}
