"""Fitted constants of the grouped-GEMM cost model (moonep_ops.gemm_cost_model).

THIS FILE IS REWRITTEN by ``benchmarks/calibrate_grouped_gemm.py``; edit by hand only to seed it.

PEAK_TFLOPS / HBM_TBPS: the measured dense bf16 ceiling and device-copy bandwidth of the H200.
EFFICIENCY[kind][config] = (eta, bw_frac, tau_sw_us, tau0_us, tau_epi_us):
  eta        fraction of PEAK_TFLOPS one tile's MMA mainloop reaches with this config;
  bw_frac    fraction of HBM_TBPS reached by rounds bound by first-touch HBM bytes;
  tau_sw_us  extra time of a round in which some CTA starts a new group (descriptor update);
  tau0_us    launch + prologue + tail of one GEMM;
  tau_epi_us epilogue time one tile adds to its mainloop (not overlapped: cooperative kernels).
"""

CALIBRATED = True
CALIBRATION_SOURCE = 'benchmarks/calibrate_grouped_gemm.py on NVIDIA H200, torch 2.11.0+cu130, 2026-11-29'

PEAK_TFLOPS = 791.8
HBM_TBPS = 4.262
NUM_SMS = 132

EFFICIENCY = {
    "fwd": {
        "c128x256": (0.8512, 0.9491, 0.0, 8.7036, 1.2655),
        "p64x256": (0.569, 0.9869, 0.0, 20.1248, 0.0),
        "p128x128": (0.8046, 0.9596, 0.7404, 20.0876, 0.0),
    },
    "dgrad": {
        "c128x256": (0.8555, 0.987, 0.0, 0.0, 2.8889),
        "p64x256": (0.577, 1.0128, 2.8648, 0.0, 0.0),
        "p128x128": (0.8093, 0.9421, 1.7657, 2.2838, 0.0),
    },
    "wgrad": {
        "c128x256": (0.905, 0.8168, 0.0, 20.5472, 8.133),
        "c128x128": (0.8759, 0.8104, 0.0, 32.0651, 3.6953),
        "p128x128": (0.8135, 0.6571, 0.0, 23.1961, 1.9649),
    },
    "wgrad_lp": {
        "c128x256": (0.8617, 0.7025, 0.0, 55.6565, 2.2902),
        "c128x128": (0.8381, 0.6225, 0.0, 40.9879, 1.3348),
        "p128x128": (0.968, 0.5511, 0.0328, 63.6449, 0.942),
    },
}
