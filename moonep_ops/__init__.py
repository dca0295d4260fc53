"""moonep_ops: Mixture-of-Experts expert parallelism with perfect load balance.

Importing the package registers every ``torch.ops.moonep.*`` custom op (schemas and fake
kernels are pure Python, so they exist without any compiled library).
"""
from .geometry import Geometry, align_up
from .planner import Plan, GroupResult, plan, plan_all_ranks, POLICIES

__all__ = ["Geometry", "align_up", "Plan", "GroupResult", "plan", "plan_all_ranks", "POLICIES"]
__version__ = "0.1.0"
