"""Grouped-GEMM tuning: the analytical cost model the device selector evaluates (cost_model.py),
its fitted constants (tuning.py) and the committed measurements they are fitted on
(calibration/).  The GEMM ops themselves are moonep_ops/ops/grouped_mm.py."""
from . import cost_model, tuning  # noqa: F401
