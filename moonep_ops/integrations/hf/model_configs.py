"""The real configs of the memory plan (moonep_ops/integrations/hf/memory.py): each model's
published config.json fields that set a tensor's shape or dtype, or the routing, and the model
built from them on the meta device."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

# Rope scaling, token ids, norm epsilons, dropout and cache settings change no tensor and are
# left at transformers' defaults.

_QWEN3_MOE = dict(model_type="qwen3_moe", hidden_act="silu", attention_bias=False,
                  decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                  num_experts=128, num_experts_per_tok=8, head_dim=128,
                  num_key_value_heads=4, vocab_size=151936, tie_word_embeddings=False)

_DEEPSEEK_V3 = dict(model_type="deepseek_v3", hidden_act="silu", attention_bias=False,
                    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                    num_hidden_layers=61, num_experts_per_tok=8, n_shared_experts=1,
                    norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    tie_word_embeddings=False)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """One model's published config and parameter count."""
    name: str
    hf_id: str
    fields: dict                 # transformers config kwargs, model_type included
    published: float             # total parameters the model card states
    published_note: str


CONFIGS = {c.name: c for c in (
    ModelConfig("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B",
                dict(_QWEN3_MOE, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                     intermediate_size=6144, moe_intermediate_size=768),
                30.5e9, "model card: 30.5B in total"),
    ModelConfig("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B",
                dict(_QWEN3_MOE, hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                     intermediate_size=12288, moe_intermediate_size=1536),
                235e9, "model card: 235B in total"),
    ModelConfig("deepseek-v3", "deepseek-ai/DeepSeek-V3",
                dict(_DEEPSEEK_V3, num_attention_heads=128, num_key_value_heads=128,
                     n_routed_experts=256, n_group=8, topk_group=4, first_k_dense_replace=3,
                     routed_scaling_factor=2.5, vocab_size=129280, num_nextn_predict_layers=1),
                671e9, "model card: 671B main model, besides its 14B multi-token-prediction "
                       "module, which transformers does not build"),
    ModelConfig("kimi-k2", "moonshotai/Kimi-K2-Instruct",
                dict(_DEEPSEEK_V3, num_attention_heads=64, num_key_value_heads=64,
                     n_routed_experts=384, n_group=1, topk_group=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.827, vocab_size=163840, num_nextn_predict_layers=0),
                1.04e12, "technical report: 1.04T total (model card: 1T)"),
    ModelConfig("gpt-oss-120b", "openai/gpt-oss-120b", dict(
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_local_experts=128, num_experts_per_tok=4, num_attention_heads=64, head_dim=64,
        num_key_value_heads=8, sliding_window=128, swiglu_limit=7.0, vocab_size=201088,
        tie_word_embeddings=False), 116.8e9, "model card: 117B in total"),
)}


def experts_of(name: str) -> int:
    f = CONFIGS[name].fields
    return f.get("num_experts") or f.get("num_local_experts") or f["n_routed_experts"]


def hf_config(name: str):
    """The transformers config object of ``CONFIGS[name]``."""
    from transformers import AutoConfig
    fields = dict(CONFIGS[name].fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_meta(config, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """``AutoModelForCausalLM.from_config`` on the meta device (no memory; the dtypes
    ``from_pretrained`` gives, e.g. DeepSeek-V3's fp32 router).  ``config``: a transformers config
    or a ``CONFIGS`` name."""
    from transformers import AutoModelForCausalLM
    if isinstance(config, str):
        config = hf_config(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
