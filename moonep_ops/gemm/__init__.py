"""Grouped-GEMM tuning: the analytical cost model the device selector evaluates (cost_model.py),
its fitted constants (tuning.py and the FP8 GEMMs' tuning_fp8*.py, each loading its JSON file;
the measurements they are fitted on are committed outside the package, in
benchmarks/calibration/); the link constants (links.py) and what the planner's cost policy predicts from
both (plan_cost.py).  The GEMM ops themselves are moonep_ops/ops/grouped_mm.py."""
from . import cost_model, links, plan_cost, tuning  # noqa: F401
