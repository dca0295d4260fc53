"""moonep_ops: Mixture-of-Experts expert parallelism with perfect load balance.

Importing the package registers every ``torch.ops.moonep.*`` custom op (schemas and fake
kernels are pure Python, so they exist without any compiled library).
"""
from .geometry import Geometry, align_up
from .planner import Plan, GroupResult, plan, plan_all_ranks, POLICIES
from .buffer import Buffer
from .comm_stream import EventHandle
from .backends import Backend, CollectiveBackend, TorchDistBackend, SingleRankBackend
from .grouped_gemm import (grouped_mm, grouped_mm_dgrad, grouped_mm_wgrad,
                           grouped_mm_wgrad_accumulate, grouped_mm_wgrad_into)
from . import swiglu  # registers moonep::swiglu (module: swiglu.swiglu, swiglu.swiglu_backward)
from . import gemm_cost_model
from .router import Router
from .moe import MoonEPMoE, ExpertPool

__all__ = ["Geometry", "align_up", "Plan", "GroupResult", "plan", "plan_all_ranks", "POLICIES",
           "Buffer", "EventHandle", "Backend", "CollectiveBackend", "TorchDistBackend", "SingleRankBackend",
           "grouped_mm", "grouped_mm_dgrad", "grouped_mm_wgrad", "grouped_mm_wgrad_accumulate",
           "grouped_mm_wgrad_into", "gemm_cost_model", "Router", "MoonEPMoE",
           "ExpertPool"]
__version__ = "0.1.0"
