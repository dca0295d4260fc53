"""Fitted constants of the FP8 grouped GEMM's cost model (moonep_ops.gemm.fp8_cost), loaded from
tuning_fp8.json, which ``benchmarks/fit_fp8_cost_model.py`` writes from the committed
measurements in benchmarks/calibration/fp8_*.json (rerun the fit instead of editing; the file's
format: tuning.py).

CONSTANTS[config] = (fixed_us, per_round_us, per_kblock_us), for the configs the device chooses
among (fp8_cost.AUTO_NAMES):
  fixed_us       launch, prologue and tail of one call;
  per_round_us   what one round of output tiles (one tile per SM, two per SM for a ping-pong
                 config) costs besides its mainloop: epilogue, scheduling;
  per_kblock_us  one 128-deep K block of one round's mainloop.
MEM_BYTES_PER_US: the bytes a call moves at least (weights of its non-empty groups, A, D) per
  microsecond: the memory bound (tuning.HBM_TBPS, not fitted).
TIE_TOL: predictions within this fraction of the cheapest tie and go to the lower config index.
CALIBRATED, CALIBRATION_SOURCE: whether the constants are fitted, and on what.
"""
from __future__ import annotations

from . import tuning

# The keys of an FP8 GEMM's constants file (this module's and tuning_fp8_wgrad.py's), in order.
KEYS = ("CALIBRATED", "CALIBRATION_SOURCE", "CONSTANTS", "MEM_BYTES_PER_US", "TIE_TOL")


def read(file) -> tuple:
    """An FP8 GEMM's constants file (a name: this package's), its values in KEYS order."""
    data = tuning.read(file)
    return tuple(data[k] for k in KEYS)


CALIBRATED, CALIBRATION_SOURCE, CONSTANTS, MEM_BYTES_PER_US, TIE_TOL = read("tuning_fp8.json")
