"""Hugging Face transformers sparse-MoE models on MoonEP: one call converts, checkpoints round-trip.

    from moonep_ops.integrations import hf
    model = AutoModelForCausalLM.from_pretrained(path)       # every rank: the same full model
    hf.convert_model(model, group=ep_group, capacity=S)      # in place; collective over ep_group
    loss = model(input_ids=ids_r, labels=ids_r).loss         # each rank its own batch, <= S tokens
    loss.backward()
    sd = hf.full_state_dict(model)                           # collective: the unconverted layout
    if rank == 0:
        model.save_pretrained(out_dir, state_dict=sd)        # plain transformers reloads it

Supported (transformers 5.24): the sparse-MoE blocks of Qwen2-MoE (with its gated shared expert),
Qwen3-MoE, Mixtral, OLMoE and DeepSeek-V3 (Kimi-K2's architecture), and of Qwen3-Next, MiniMax,
FlexOlmo, GLM-4.5 (glm4_moe), dots.llm1, DeepSeek-V3.2 and GLM-4.7-Flash (glm4_moe_lite), whose
blocks are those families' code, GLM-4.5V's text model, Qwen3.5-MoE (Qwen3-Next's block, its router
always renormalising), MiniMax-M2 (Mixtral's experts, a biased sigmoid router), K-EXAONE
(DeepSeek-V3's router in its own code) and gpt-oss (biased experts, the clamped SwiGLU, the
interleaved gate/up layout, a biased top-k-first router) (``FAMILIES``). Each becomes a ``MoonEPBlock``: the HF
block's forward signature and return value (``[batch, seqlen, D] -> [batch, seqlen, D]``) around a
``moonep_ops.MoonEPMoE`` that holds this rank's home experts ``r*E/R .. (r+1)*E/R - 1`` (r, R: rank
and size of ``group``; one rank when torch.distributed is not initialised), the shared expert(s),
and a built-in ``Router`` configured by ``router_args(config)`` so that it computes what the
family's HF router computes, op for op. Dense layers and every other module are untouched.

Under expert parallelism each rank runs its own batch.  The outputs, the loss and the grads of the
replicated parameters (dense layers, routers, shared experts) are those of the unconverted model on
that rank's batch: reduce them as data parallelism does.  The expert weights' grads already hold
the sum over the ranks of every rank's contribution: keep them out of the data-parallel reduction
(``expert_parameter_names``).

Checkpoints.  ``full_state_dict`` (collective) returns the unconverted model's ``state_dict()``:
the same keys in the same order, shapes, dtypes and values, all experts gathered.  The converted
model's own ``state_dict()`` holds this rank's shard (``<block>.moe.w1/w3 [E/R, F, D]``,
``<block>.moe.w2 [E/R, D, F]``, ``<block>.moe.router.*``, ``<block>.moe.shared.*``) and loads back
into the same converted model; its ``load_state_dict`` also takes the unconverted layout with all
E experts (each rank keeps its slice).

Router logits (``output_router_logits``, the aux loss): each converted block hands its router's
logits ``[s, E]`` (s = batch * seqlen, not detached) to transformers' output collector, as the HF
router's capturing hook does: exactly one record per sparse layer per forward, in eager mode and
under ``torch.compile(model)``.  A converted block compiled on its own (not inside the compiled
model) cannot see the collector without a graph break; it raises if recording is requested there.

docs/integrations.md has the whole story: how each family maps onto the Router's options, what is
refused and why, the checkpoint round trip.
"""
from __future__ import annotations

import warnings

import transformers

TESTED_TRANSFORMERS = "5.24"
if not transformers.__version__.startswith(TESTED_TRANSFORMERS + "."):
    warnings.warn(f"moonep_ops.integrations.hf was written against transformers "
                  f"{TESTED_TRANSFORMERS}.x (block classes, weight layouts, the output collector); "
                  f"found {transformers.__version__}", UserWarning, stacklevel=2)

from .families import FAMILIES, FAMILIES_BY_TYPE, Family, family_of, router_args  # noqa: E402
from .convert import (MoonEPBlock, convert_model, converted_blocks,  # noqa: E402
                      expert_parameter_names, full_state_dict)
from .checkpoint import CheckpointError, LoadReport, load_pretrained, save_pretrained  # noqa: E402
from .fsdp import (FSDPLayout, clip_grad_norm_, fsdp_layout, fully_shard_dense,  # noqa: E402
                   reduce_expert_grads)

__all__ = ["FAMILIES", "FAMILIES_BY_TYPE", "CheckpointError", "FSDPLayout", "Family",
           "LoadReport", "MoonEPBlock", "clip_grad_norm_", "convert_model", "converted_blocks",
           "expert_parameter_names", "family_of", "fsdp_layout", "full_state_dict",
           "fully_shard_dense", "load_pretrained", "reduce_expert_grads", "router_args",
           "save_pretrained"]
