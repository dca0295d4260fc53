"""The data-plane and expert custom ops (``torch.ops.moonep.*``), one module per op family, each
with its schema, fake kernel, CPU reference, kernel binding and autograd:

  dispatch.py        moonep::dispatch, dispatch_with_plan, combine     (-> Backend methods)
  expert_weights.py  moonep::prefetch_weight, reduce_grad              (-> Backend methods)
  grouped_mm.py      moonep::grouped_mm, _dgrad, _wgrad, _wgrad_accumulate, _wgrad_into
  swiglu.py          moonep::swiglu, swiglu_backward
  moe_experts.py     moonep::moe_experts, moe_experts_backward; ExpertPool
The planner op moonep::plan lives in moonep_ops/planner.py, below the backends that call it.
Importing ``moonep_ops`` registers them all.
"""
from . import dispatch, expert_weights, grouped_mm, moe_experts, swiglu  # noqa: F401
