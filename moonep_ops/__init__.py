"""moonep_ops: Mixture-of-Experts expert parallelism with perfect load balance.

Importing the package registers every ``torch.ops.moonep.*`` custom op (schemas and fake kernels
are pure Python, so they exist without any compiled library).  Architecture: docs/architecture.md.

The top level exports what a user calls, one name per thing they do (docs/api.md):

  MoEArgs, MoonEPMoE, bind_moe, Router   put the MoE layer in a model (the front door)
  Buffer                                 one EP group's data plane, for a layer of one's own
  plan, plan_all_ranks, Plan, POLICIES   the planner: one rank's plan, every rank's, the policies
  grouped_mm, grouped_mm_dgrad,          the expert path's building blocks: the grouped GEMM
  grouped_mm_wgrad, swiglu               forward, its two backward GEMMs, the activation

Everything else is imported from the package that owns it: types the API returns (GroupResult,
EventHandle, ExpertPool: moonep_ops.planner, .comm_stream, .ops.moe_experts), sizes
(moonep_ops.geometry), the in-place wgrad forms (moonep_ops.ops.grouped_mm), backends and their
contract (moonep_ops.backends: what a backend author subclasses), and the helpers of tests,
benchmarks and the main job (moonep_ops.testing: virtual ranks, the all-to-all baseline, the
training step, torchtitan's CPU shims, synthetic routings), which the library never imports.
"""
from . import ops  # noqa: F401  (registers torch.ops.moonep.*)
from .buffer import Buffer
from .nn import MoEArgs, MoonEPMoE, Router, bind_moe
from .ops.grouped_mm import grouped_mm, grouped_mm_dgrad, grouped_mm_wgrad
from .ops.swiglu import swiglu
from .planner import POLICIES, Plan, plan, plan_all_ranks

__all__ = ["MoEArgs", "MoonEPMoE", "bind_moe", "Router", "Buffer", "plan", "plan_all_ranks",
           "Plan", "POLICIES", "grouped_mm", "grouped_mm_dgrad", "grouped_mm_wgrad", "swiglu"]
__version__ = "0.2.0"
