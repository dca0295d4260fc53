"""Fitted constants of the grouped-GEMM cost model (moonep_ops.gemm.cost_model).

WRITTEN BY benchmarks/fit_gemm_cost_model.py from the committed measurements in
benchmarks/calibration/ (CALIBRATION_SOURCES names them); rerun the fit instead of editing.
docs/grouped_gemm.md, "Cost model" and "Calibration", explains the model and the fit.

PEAK_TFLOPS / HBM_TBPS: the measured dense bf16 ceiling and device-copy bandwidth of the H200;
NUM_SMS: its SM count (the persistent grid's CTAs P when the device is not asked).
EFFICIENCY[kind][config] = (eta, bw_frac, tau_sw_us, tau0_us, tau_epi_us):
  eta        fraction of PEAK_TFLOPS one tile's MMA mainloop reaches with this config;
  bw_frac    fraction of HBM_TBPS reached by rounds bound by first-touch HBM bytes;
  tau_sw_us  extra time of a round in which some CTA starts a new group (descriptor update);
  tau0_us    launch + prologue + tail of one GEMM;
  tau_epi_us epilogue time one tile adds to its mainloop (not overlapped: cooperative kernels).
SEEDED[kind][config]: configs whose constants are seeds, not fitted on measurements of the config
  itself (why, and from what); the fit drops a config from it once the config is measured.
SELECT_TIE_TOL, SELECT_TIE_TOL_SMALL: the selection rule's tie window (cost_model.pick,
  tie_tolerance; not fitted): predictions within it of the fastest tie and go to the least MMA
  work; the wider window applies to small groups (a config with max_mean_rows is a candidate),
  where every round streams weights and the predictions differ only by per-call constants.
NEVER_LOSE_PROBE_TP, NEVER_LOSE_MARGIN[kind]: the never-lose rule (cost_model.family_for): a call
  runs torch._grouped_mm's kernel family when the model, on the shape's balanced probe
  histogram (token padding NEVER_LOSE_PROBE_TP), predicts it at most (1 + margin) times our best
  candidate; a kind without a margin never uses the torch family.
"""

CALIBRATED = True
# Where each kind's constants come from (a partial refit, --kinds, keeps the others').
CALIBRATION_SOURCES = {
    'fwd': 'benchmarks/fit_gemm_cost_model.py on benchmarks/calibration/zoo_2026-12-04_no_tail.json + benchmarks/calibration/zoo_2026-12-01_families.json (545 training cases, 175 held out)',
    'dgrad': 'benchmarks/fit_gemm_cost_model.py on benchmarks/calibration/zoo_2026-12-04_no_tail.json + benchmarks/calibration/zoo_2026-12-01_families.json (545 training cases, 175 held out)',
    'wgrad': "benchmarks/calibrate_grouped_gemm.py on its calibration set, measured on the H200 2026-11-30 (the fp32 += is not in the model zoo; that run's JSON is not committed)",
    'wgrad_lp': 'benchmarks/fit_gemm_cost_model.py on benchmarks/calibration/zoo_2026-12-01_families.json (285 training cases, 91 held out)',
}
CALIBRATION_SOURCE = "; ".join(f"{k}: {v}" for k, v in CALIBRATION_SOURCES.items())

PEAK_TFLOPS = 796.2
HBM_TBPS = 4.243
NUM_SMS = 132

SELECT_TIE_TOL = 0.005
SELECT_TIE_TOL_SMALL = 0.02

NEVER_LOSE_PROBE_TP = 128
NEVER_LOSE_MARGIN: dict = {}

SEEDED = {
}

EFFICIENCY = {
    "fwd": {
        "c128x256": (0.8653, 0.9728, 0.3107, 0.0, 1.3038),
        "p128x128": (0.8563, 0.9408, 0.7106, 5.6514, 0.09),
        "s256x80": (0.8411, 0.893, 0.0, 0.0, 1.9047),
        "s256x96": (0.8558, 0.9934, 0.3569, 0.0, 1.2389),
        "p64x256": (0.7202, 0.8965, 4.4514, 0.0, 0.0),
        "s256x128": (0.8799, 1.0, 0.0, 0.0, 1.5011),
        "t128x256": (0.8811, 1.0, 0.0, 0.0, 1.7216),
        "t64x128": (0.6163, 0.791, 0.0, 0.0, 0.0),
    },
    "dgrad": {
        "c128x256": (0.8583, 1.0, 0.4046, 0.0, 1.5145),
        "p128x128": (0.8515, 0.9468, 0.8392, 4.8194, 0.0498),
        "s256x80": (0.8353, 0.9287, 0.0366, 0.0, 1.851),
        "s256x96": (0.8493, 0.8767, 0.4523, 0.0, 1.1612),
        "p64x256": (0.6902, 1.0, 3.7564, 0.0, 0.0),
        "s256x128": (0.8652, 0.6896, 0.0, 0.0, 1.3251),
        "t128x256": (0.8685, 0.8904, 0.0, 0.0, 1.5773),
        "t64x128": (0.6122, 0.7739, 0.0, 0.001, 0.0047),
    },
    "wgrad": {
        "c128x256": (0.8394, 0.8219, 0.2747, 10.6539, 8.1877),
        "c128x128": (0.8519, 0.8117, 0.017, 32.3064, 3.9817),
        "p128x128": (0.8626, 0.8762, 0.0, 22.4692, 2.5417),
    },
    "wgrad_lp": {
        "c128x256": (0.8931, 0.6421, 0.034, 0.0, 2.5551),
        "c128x128": (0.8745, 0.6156, 0.2149, 6.879, 1.3905),
        "p128x128": (0.8875, 0.4434, 0.0378, 9.4568, 0.8412),
        "t128x256": (0.9058, 1.0, 0.0, 0.0, 3.0215),
        "t64x128": (0.6329, 0.4119, 0.2075, 0.0, 0.4541),
    },
}
