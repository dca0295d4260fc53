"""Constants of the FP8 wgrad GEMM's cost model (moonep_ops.gemm.fp8_wgrad_cost), loaded from
tuning_fp8_wgrad.json (the format and the keys of tuning_fp8.py).

SEEDED BY HAND, not fitted: no GPU measurement of the FP8 wgrad kernel exists yet.  The seeds are
the forward FP8 GEMM's fitted constants (tuning_fp8.json, 2026-12-03), since a wgrad tile runs
the same mainloop over K = 128-token blocks (one more fp32 multiply per accumulator element in
the promotion: the per-column scale) and the same epilogue.  scripts/gpu_fp8_step.sh times every
config forced on the model-zoo cases and prints the model's error; refit from those times before
trusting the choice (an unfitted model can only cost the gap between the two configs).

CONSTANTS[config] = (fixed_us, per_round_us, per_kblock_us), as in tuning_fp8.py:
  fixed_us       launch, prologue and tail of one call;
  per_round_us   one output tile's cost besides its mainloop (epilogue, scheduling), per SM slot;
  per_kblock_us  one 128-token K block of one tile's mainloop, per SM slot.
MEM_BYTES_PER_US: the bytes a call moves at least, per microsecond (the memory bound).
TIE_TOL: predictions within this fraction of the cheapest tie and go to the lower config index.
"""
from __future__ import annotations

from .tuning_fp8 import read

CALIBRATED, CALIBRATION_SOURCE, CONSTANTS, MEM_BYTES_PER_US, TIE_TOL = read(
    "tuning_fp8_wgrad.json")
