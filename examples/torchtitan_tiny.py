"""Tiny torchtitan 0.3.0 MoE models (Qwen3-MoE, DeepSeek-V3 and gpt-oss shapes), a synthetic token stream and
shared initial weights: what examples/torchtitan_moonep.py trains and tests/test_integrations_torchtitan.py
checks.  Imports only torchtitan's models (no Trainer, tokenizer or dataset packages).

On a CPU-only torch, importing this module applies moonep_ops.testing.torchtitan_cpu's shims
first (torchtitan's models assume CUDA/triton at import); on a machine with CUDA it does not.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

if not torch.cuda.is_available():
    from moonep_ops.testing import torchtitan_cpu

    torchtitan_cpu.install("torchtitan.models.qwen3", "torchtitan.models.deepseek_v3",
                           "torchtitan.models.gpt_oss")

import torchtitan.models.deepseek_v3 as tt_dsv3  # noqa: E402
import torchtitan.models.gpt_oss as tt_gpt_oss  # noqa: E402
import torchtitan.models.qwen3 as tt_qwen3  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from torchtitan.models.common import (ComplexRoPE, CosSinRoPE, Embedding, Linear,  # noqa: E402
                                      RMSNorm, ScaledDotProductAttention)
from torchtitan.models.common.attention import FlexAttention  # noqa: E402

VOCAB, SEQ_LEN, GLOBAL_BATCH = 256, 32, 8      # global batch: sequences per step, all ranks


# -- tiny models (D = 64, E = 8 experts of F = 32, top-2) ------------------------------------------
def _sdpa(cfg):
    # The registry's attention is FlexAttention; SDPA (causal, no masks) runs everywhere.
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def qwen3_tiny() -> tt_qwen3.Qwen3Model.Config:
    """Qwen3-MoE shape: softmax router, route_norm, no shared expert, 2 MoE layers."""
    dim, head_dim = 64, 16
    return _sdpa(tt_qwen3.Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=tt_qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init=tt_qwen3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                              param_init=tt_qwen3._LINEAR_INIT),
        layers=tt_qwen3._build_qwen3_moe_layers(
            fuse_qkv=False, n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim,
            moe_hidden_dim=32, num_experts=8, top_k=2, attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ_LEN, theta=1e6),
            moe_comm_backend="standard")))


def dsv3_tiny() -> tt_dsv3.DeepSeekV3Model.Config:
    """DeepSeek-V3 shape: MLA, 1 dense + 2 MoE layers with a shared expert, sigmoid router with
    node-limited groups (4 groups, top-2), route_norm, route_scale 2.5."""
    dim = 64
    layers = tt_dsv3._build_dsv3_layers(
        n_layers=3, n_dense_layers=1, dim=dim, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=0.70,
        dense_hidden_dim=128, moe_hidden_dim=32, num_experts=8, num_shared_experts=1,
        router_top_k=2, router_score_func="sigmoid", router_num_expert_groups=4,
        router_num_limited_groups=2, router_route_scale=2.5, router_route_norm=True,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=SEQ_LEN, theta=10000.0))
    return _sdpa(tt_dsv3.DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init=tt_dsv3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=tt_dsv3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                              param_init=tt_dsv3._output_linear_init(dim)),
        layers=layers, mtp_layers=[]))


class MathSinkAttention(FlexAttention):
    """gpt-oss's inner attention on any device: FlexAttention's contract (its BlockMasks, or
    causal without one; an ``out_transform`` given the log-sum-exp: the sinks) computed densely
    in fp32, because flex attention has no CPU backward.  The same in both runs a test
    compares."""

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, enable_gqa=False,
                out_transform=None, **kwargs):
        B, L, N, H = q_BLNH.shape
        rep = N // k_BLNH.shape[2]
        q = q_BLNH.float().transpose(1, 2)
        k, v = (t.float().repeat_interleave(rep, dim=2).transpose(1, 2) for t in (k_BLNH, v_BLNH))
        idx = torch.arange(L, device=q.device)
        if attention_masks is None:       # the Trainer's step passes none here: causal
            keep = idx[:, None] >= idx[None, :]
        else:
            keep = attention_masks.mask_mod(torch.arange(B, device=q.device)[:, None, None, None],
                                            torch.zeros((), dtype=torch.long, device=q.device),
                                            idx[:, None], idx[None, :])
        s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else H ** -0.5)
        s = s.masked_fill(~keep, float("-inf"))
        lse_BNL = torch.logsumexp(s, dim=-1)
        out_BLNH = (torch.exp(s - lse_BNL[..., None]) @ v).transpose(1, 2).to(q_BLNH.dtype)
        if out_transform is None:
            return out_BLNH
        return out_transform(out_BLNH, lse_BNL.transpose(1, 2))


def gpt_oss_tiny() -> tt_gpt_oss.GptOssModel.Config:
    """gpt-oss shape: attention with sinks (4 heads of 16), sliding window on layer 0, 2 MoE
    layers of 8 biased experts (F = 32, top-2, clamped SwiGLU), a biased softmax router."""
    dim, head_dim = 64, 16
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ_LEN, theta=150000.0)
    layers = tt_gpt_oss._build_gptoss_layers(
        dim=dim, n_layers=2, hidden_dim=32, num_experts=8, top_k=2, load_balance_coeff=1e-3,
        attn_backend="flex", moe_comm_backend="standard", rope=rope)
    for i, layer in enumerate(layers):
        layer.attention = tt_gpt_oss._make_gptoss_attn_config(
            dim=dim, layer_id=i, attn_backend="flex", n_heads=4, n_kv_heads=2,
            head_dim=head_dim, sliding_window_size=8 if i % 2 == 0 else None, fuse_qkv=False,
            rope=rope)
        layer.attention.inner_attention = MathSinkAttention.Config()
    return tt_gpt_oss.GptOssModel.Config(
        vocab_size=VOCAB, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init=tt_gpt_oss._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=tt_gpt_oss._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                              param_init=tt_gpt_oss._output_linear_init(dim)),
        layers=layers)


MODELS = {"qwen3": (qwen3_tiny, tt_qwen3.parallelize_qwen3),
          "dsv3": (dsv3_tiny, tt_dsv3.parallelize_deepseekv3),
          "gpt_oss": (gpt_oss_tiny, tt_gpt_oss.parallelize_gptoss)}


def global_batch(step: int, seed: int = 1234) -> torch.Tensor:
    """[GLOBAL_BATCH, SEQ_LEN + 1] learnable rows for ``step``: arithmetic progressions mod VOCAB."""
    g = torch.Generator().manual_seed(seed + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 8, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ_LEN + 1)) % VOCAB


def reference_state_dict(model: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full initial weights, the same in every process and run (a plain unsharded build)."""
    torch.manual_seed(seed)
    m = MODELS[model][0]().build()
    m.init_weights(buffer_device=None)
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    for k, v in sd.items():
        # gpt-oss: experts scaled up from torchtitan's 0.02-scale init so that their biases
        # matter (dropping them moves the step-1 loss by 7e-2; bf16 noise: ~4e-3)
        if model == "gpt_oss" and ".inner_experts." in k:
            v.mul_(40.0 if "bias" in k else 12.0)
    return sd


def expert_layout(model: torch.nn.Module) -> dict[str, tuple]:
    """key -> (global shape, local shape, placements) of the routed experts' state-dict entries."""
    out = {}
    for k, v in model.state_dict().items():
        if ".routed_experts." in k:
            local = v.to_local() if isinstance(v, DTensor) else v
            out[k] = (tuple(v.shape), tuple(local.shape),
                      tuple(str(p) for p in getattr(v, "placements", ())))
    return out
