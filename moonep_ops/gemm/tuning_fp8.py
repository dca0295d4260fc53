"""Fitted constants of the FP8 grouped-GEMM cost model (moonep_ops.gemm.fp8_cost).

THIS FILE IS REWRITTEN by ``benchmarks/fit_fp8_cost_model.py`` (from the committed measurements
in benchmarks/calibration/fp8_*.json); edit by hand only to seed it.

CONSTANTS[config] = (fixed_us, per_round_us, per_kblock_us), for the configs the device chooses
among (fp8_cost.AUTO_NAMES):
  fixed_us       launch, prologue and tail of one call;
  per_round_us   what one round of output tiles (one tile per SM, two per SM for a ping-pong
                 config) costs besides its mainloop: epilogue, scheduling;
  per_kblock_us  one 128-deep K block of one round's mainloop.
MEM_BYTES_PER_US: the bytes a call moves at least (weights of its non-empty groups, A, D) per
  microsecond: the memory bound.
TIE_TOL: predictions within this fraction of the cheapest tie and go to the lower config index.
"""

CALIBRATED = True
CALIBRATION_SOURCE = 'benchmarks/fit_fp8_cost_model.py on benchmarks/calibration/fp8_zoo_2026-12-03.json (348 training cases, 112 held out)'

CONSTANTS = {
    'c128x128': (9.02635, 0.81589, 0.46766),
    'p64x128': (8.055, 0.11272, 0.67381),
}
MEM_BYTES_PER_US = 4243000.0   # gemm/tuning.py HBM_TBPS (not fitted)
TIE_TOL = 0.01
