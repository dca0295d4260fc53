"""The data-plane and expert custom ops (``torch.ops.moonep.*``), one module per op family, each
with its schema, fake kernel, CPU reference, kernel binding and autograd:

  dispatch.py        moonep::dispatch, dispatch_with_plan, combine     (-> Backend methods)
  expert_weights.py  moonep::prefetch_weight, reduce_grad              (-> Backend methods)
  grouped_mm.py      moonep::grouped_mm, _dgrad, _wgrad, _wgrad_accumulate, _wgrad_into
  quantize_fp8.py    moonep::quantize_fp8_rows, quantize_fp8_blocks, swiglu_quantize_fp8,
                     scale_rows, scale_rows_backward_fp8, dequantize_fp8_rows
  grouped_mm_fp8.py  moonep::grouped_mm_fp8, grouped_mm_fp8_dgrad, grouped_linear_fp8
  quantize_fp8_tokens.py  moonep::quantize_fp8_tokens, quantize_fp8_rows_tokens,
                     scale_rows_backward_fp8_tokens (the FP8 wgrad's token-major operands)
  grouped_mm_fp8_wgrad.py  moonep::grouped_mm_fp8_wgrad, grouped_mm_fp8_wgrad_into
  fp8_weight_cache.py  FP8WeightCache; moonep::fp8_weight_cache_refresh
  swiglu.py          moonep::swiglu, swiglu_backward
  moe_experts.py     moonep::moe_experts, moe_experts_backward; ExpertPool
  moe_experts_fp8.py moonep::moe_experts_fp8, moe_experts_fp8_backward
  moe_experts_ext.py moonep::moe_experts_ext, moe_experts_ext_backward (biases, gpt-oss's SwiGLU)
The planner op moonep::plan lives in moonep_ops/planner/op.py, below the backends that call it.
Importing ``moonep_ops`` registers them all.
"""
from . import (dispatch, expert_weights, grouped_mm, grouped_mm_fp8, moe_experts,  # noqa: F401
               moe_experts_fp8, quantize_fp8, swiglu)
from . import fp8_weight_cache, grouped_mm_fp8_wgrad, quantize_fp8_tokens  # noqa: F401
from . import moe_experts_ext  # noqa: F401
