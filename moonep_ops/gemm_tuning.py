"""Fitted constants of the grouped-GEMM cost model (moonep_ops.gemm_cost_model).

THIS FILE IS REWRITTEN by ``benchmarks/calibrate_grouped_gemm.py``; edit by hand only to seed it.

PEAK_TFLOPS / HBM_TBPS: the measured dense bf16 ceiling and device-copy bandwidth of the H200.
EFFICIENCY[kind][config] = (eta, bw_frac, tau_sw_us, tau0_us):
  eta        fraction of PEAK_TFLOPS one tile's MMA mainloop reaches with this config;
  bw_frac    fraction of HBM_TBPS reached by rounds bound by first-touch HBM bytes;
  tau_sw_us  extra time of a round in which some CTA starts a new group (descriptor update);
  tau0_us    launch + prologue + tail of one GEMM.
"""

CALIBRATED = True
CALIBRATION_SOURCE = 'benchmarks/calibrate_grouped_gemm.py on NVIDIA H200, torch 2.11.0+cu130, 2026-11-29'

PEAK_TFLOPS = 785.5
HBM_TBPS = 4.265
NUM_SMS = 132

EFFICIENCY = {
    "fwd": {
        "c128x256": (0.8705, 0.9676, 0.8788, 19.8168),
        "p64x256": (0.5807, 0.9949, 0.0, 26.4031),
        "p128x128": (0.8225, 0.9614, 0.7706, 24.0966),
    },
    "dgrad": {
        "c128x256": (0.8114, 0.9897, 0.0, 0.0),
        "p64x256": (0.5722, 1.0138, 2.3217, 0.0),
        "p128x128": (0.8133, 0.9402, 1.879, 1.1058),
    },
    "wgrad": {
        "c128x256": (0.5889, 0.8114, 0.6804, 0.0075),
        "c128x128": (0.6083, 0.814, 0.0, 76.4584),
        "p128x128": (0.6709, 0.6678, 0.0, 46.3283),
    },
    "wgrad_lp": {
        "c128x256": (0.7418, 0.6499, 0.0, 102.3969),
        "c128x128": (0.6771, 0.5632, 0.7736, 0.026),
        "p128x128": (0.8311, 0.552, 1.0211, 0.088),
    },
}
