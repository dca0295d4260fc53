"""moonep_ops: Mixture-of-Experts expert parallelism with perfect load balance.

Importing the package registers every ``torch.ops.moonep.*`` custom op (schemas and fake kernels
are pure Python, so they exist without any compiled library).  Architecture: docs/architecture.md.

  Buffer                   one EP group: dispatch / combine / prefetch_weight / reduce_grad
  MoonEPMoE, Router        the MoE layer (moonep_ops.nn)
  plan, plan_all_ranks     the planner (moonep_ops.planner)
  grouped_mm*              the grouped GEMMs (moonep_ops.ops.grouped_mm)
  backends, gemm, testing  backend contract and implementations, GEMM tuning, test helpers
"""
from . import backends, gemm, ops  # noqa: F401  (ops: registers torch.ops.moonep.*)
from .backends import (Backend, CollectiveBackend, SingleRankBackend, SymmBackend,
                       TorchDistBackend, VirtualGroup)
from .buffer import Buffer
from .comm_stream import EventHandle
from .geometry import Geometry, GroupSpec, align_up
from .nn import AllToAllEPMoE, MoEArgs, MoonEPMoE, Router, bind_moe
from .ops.grouped_mm import (grouped_mm, grouped_mm_dgrad, grouped_mm_wgrad,
                             grouped_mm_wgrad_accumulate, grouped_mm_wgrad_into)
from .ops.moe_experts import ExpertPool
from .ops.swiglu import swiglu
from .planner import POLICIES, GroupResult, Plan, plan, plan_all_ranks

__all__ = ["Buffer", "EventHandle", "Geometry", "GroupSpec", "align_up", "Plan", "GroupResult",
           "plan", "plan_all_ranks", "POLICIES", "grouped_mm", "grouped_mm_dgrad",
           "grouped_mm_wgrad", "grouped_mm_wgrad_accumulate", "grouped_mm_wgrad_into", "swiglu",
           "MoonEPMoE", "MoEArgs", "bind_moe", "Router", "AllToAllEPMoE", "ExpertPool", "Backend", "CollectiveBackend",
           "TorchDistBackend", "SingleRankBackend", "SymmBackend", "VirtualGroup"]
__version__ = "0.2.0"
