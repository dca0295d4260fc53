"""moonep_ops.integrations.hf: Hugging Face transformers MoE models converted to MoonEP.

For every supported family (tiny CPU models, each with non-default options: renormalisation on
or off, a dense first layer, DeepSeek-V3's group-limited, biased, scaled routing, Qwen2-MoE's gated
shared expert, routers skewed so that the planner replicates experts):
* the built-in Router configured by router_args reproduces each HF router bitwise (ids, weights,
  logits; fp32 and bf16, ties included);
* the converted model gives the unconverted model's logits, loss, aux loss, router logits and
  grads (input embeddings, every replicated parameter) within 1e-5 in fp32, at R = 1 in process
  and at R = 1, 2, 4 gloo ranks (each rank its own batch; expert grads = the sum over the ranks of
  the reference grads), and the planner really replicated experts;
* full_state_dict round-trips bitwise (keys, order, shapes, dtypes, buffers); a fresh HF model
  loads it strict and gives identical logits; save_pretrained -> from_pretrained round-trips;
* compiled = eager, no graph break inside a converted block, no recompile on new routings;
* unsupported blocks and options are refused before anything is converted.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (the test extra pins it)")


from moonep_ops.integrations import hf  # noqa: E402
from moonep_ops.nn.router import Router  # noqa: E402

from dist_harness import cached_runner, multi_rank_cases  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")

D, E, K, F, V = 64, 8, 2, 24, 128
BATCH, SEQ = 2, 16                     # s = 32 tokens per rank and forward
CAP, TP = 40, 8                        # capacity and token padding of the converted layers
HOT = 3                                # the expert a skewed router favours
TOL = 1e-5

_COMMON = dict(vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=K,
               tie_word_embeddings=False, experts_implementation="eager",
               attn_implementation="eager", router_aux_loss_coef=0.1)
# F = 24 so that 2F != D: a transposed layout cannot pass by accident.
TINY = {
    # gated shared expert; layer 0 dense (mlp_only_layers); renorm off
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        intermediate_size=96, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        num_experts=E, norm_topk_prob=False, mlp_only_layers=[0], decoder_sparse_step=1)),
    # layer 0 dense ((i + 1) % 2 == 0 is sparse); renorm on (the released checkpoints' setting)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, intermediate_size=96, moe_intermediate_size=24, num_experts=E,
        norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[])),
    # every layer sparse; always renormalised; F = intermediate_size
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=24, num_local_experts=E, router_jitter_noise=0.0)),
    # every layer sparse; renorm on (the default is off)
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        intermediate_size=24, num_experts=E, norm_topk_prob=True, eos_token_id=None)),
    # layer 0 dense; 4 groups of 2 experts, top-2 groups; renorm off (the default is on) with
    # routed_scaling_factor 2.5; 2 shared experts fused into one MLP (Fs = 48)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=24,
        n_routed_experts=E, n_shared_experts=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=False, first_k_dense_replace=1, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    # families whose block, router, experts and MLP are the code of one above
    # (test_added_families_are_a_base_familys_code): each with its own non-default options
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        head_dim=16, intermediate_size=96, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_experts=E, norm_topk_prob=True,
        mlp_only_layers=[0], decoder_sparse_step=1,
        layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
        head_dim=16, intermediate_size=24, num_local_experts=E, router_jitter_noise=0.0,
        layer_types=["linear_attention", "full_attention"])),
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(
        intermediate_size=24, num_experts=E, norm_topk_prob=False, pad_token_id=1,
        bos_token_id=None, eos_token_id=None)),
    # 2 groups of 4, top-1 group; renorm on, scale 1.5; one shared expert
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=16, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=E,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        norm_topk_prob=True, first_k_dense_replace=1)),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
        head_dim=16, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=E,
        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.0,
        norm_topk_prob=False, first_k_dense_replace=1)),
    # 4 groups of 2, top-2 groups; renorm on, scale 2.5; the lightning indexer beside attention
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=24,
        n_routed_experts=E, n_shared_experts=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, mlp_layer_types=["dense", "sparse"],
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        index_topk=8, index_n_heads=2, index_head_dim=16)),
    # one group (no group limit); renorm off, scale 1.8; two shared experts
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=24,
        n_routed_experts=E, n_shared_experts=2, n_group=1, topk_group=1,
        routed_scaling_factor=1.8, norm_topk_prob=False, mlp_layer_types=["dense", "sparse"],
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
    # the text model of a multimodal checkpoint (text-only batches; the vision tower is tiny and
    # untouched): keyed by its text config's model_type, the family's
    "glm4v_moe_text": ("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration", dict(
        head_dim=16, intermediate_size=96, moe_intermediate_size=24, n_routed_experts=E,
        n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.0,
        norm_topk_prob=True, first_k_dense_replace=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [2, 3, 3], "partial_rotary_factor": 1.0})),
    # DeepSeek-V3's router in EXAONE's code: 2 groups of 4, top-1 group, renorm on, scale 2.0
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(
        head_dim=16, intermediate_size=96, moe_intermediate_size=24, num_experts=E,
        num_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.0,
        norm_topk_prob=True, mlp_layer_types=["dense", "sparse"],
        layer_types=["sliding_attention", "full_attention"], sliding_window=8)),
    # Mixtral's experts, a biased sigmoid router without groups (the bias a block buffer)
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        head_dim=16, intermediate_size=24, num_local_experts=E, router_jitter_noise=0.0)),
    # Qwen3-Next's block with the renorm always on, every layer sparse, linear attention
    "qwen3_5_moe_text": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", dict(
        head_dim=16, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        num_experts=E, layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16)),
}
FAMILIES = list(TINY)
# the vision tower of the multimodal families (not converted; the smallest that builds)
VISION = {"glm4v_moe_text": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                 out_hidden_size=D, patch_size=14, spatial_merge_size=2,
                                 temporal_patch_size=2),
          "qwen3_5_moe_text": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                   out_hidden_size=D, patch_size=14, spatial_merge_size=2,
                                   temporal_patch_size=2, num_position_embeddings=16)}
# hub checkpoints with Mixtral's legacy names (block_sparse_moe.experts.N.w1; transformers'
# conversion_mapping maps these families as "mixtral")
LEGACY_MIXTRAL_KEYS = {"mixtral", "minimax", "minimax_m2"}
POST_NORM = {"flex_olmo"}              # a norm after each MLP, none before it
# transformers' torch fallback of Qwen3-Next's gated delta rule (linear attention) fails in a
# compiled backward (a .view of a non-contiguous grad, in HF's code, converted or not): the
# compile test runs that family with full attention in both layers
COMPILE_OVERRIDES = {n: {"layer_types": ["full_attention", "full_attention"]}
                     for n in ("qwen3_next", "qwen3_5_moe_text")}


def score_bias(blk):
    """The HF block's selection-only score bias buffer (DeepSeek-V3's in its gate, MiniMax-M2's
    in the block), or None."""
    key = hf.family_of(blk).score_bias
    return blk.get_buffer(key) if key else None


def hf_route(blk, x):
    """(logits, weights, ids) of the HF block's router (MiniMax-M2's takes the block's bias)."""
    if hf.family_of(blk).score_bias == "e_score_correction_bias":
        return blk.gate(x, blk.e_score_correction_bias)
    return blk.gate(x)


def biased_groups(name):
    """DeepSeek-V3's router (fp32 weight, score bias, groups): its family and those of its code."""
    return hf.FAMILIES_BY_TYPE[name].biased_groups
# added family -> (base family, their class-name prefixes): the transformers classes that the
# conversion relies on, equal as code up to the prefix
SAME_CODE = {"qwen3_next": ("qwen2_moe", "Qwen3Next", "Qwen2Moe"),
             "minimax": ("mixtral", "MiniMax", "Mixtral"),
             "flex_olmo": ("olmoe", "FlexOlmo", "Olmoe"),
             "glm4_moe": ("deepseek_v3", "Glm4Moe", "DeepseekV3"),
             "dots1": ("deepseek_v3", "Dots1", "DeepseekV3"),
             "deepseek_v32": ("deepseek_v3", "DeepseekV32", "DeepseekV3"),
             "glm4_moe_lite": ("deepseek_v3", "Glm4MoeLite", "DeepseekV3"),
             "glm4v_moe_text": ("deepseek_v3", "Glm4vMoeText", "DeepseekV3")}
# in-process variants (the other side of each family's options)
VARIANTS = [(n, {}) for n in FAMILIES] + [
    ("qwen2_moe", {"norm_topk_prob": True}),
    ("qwen3_moe", {"norm_topk_prob": False}),
    ("olmoe", {"norm_topk_prob": False}),
    ("deepseek_v3", {"norm_topk_prob": True}),
    ("deepseek_v3", {"n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.0}),
    ("deepseek_v3", {"n_group": 1, "topk_group": 1}),
]
VIDS = [n + "".join(f"-{k}={v}" for k, v in o.items()) for n, o in VARIANTS]


def make_config(name, **overrides):
    cfg_cls, _, kw = TINY[name]
    if name in VISION:                 # a multimodal config: the text model gets the sizes
        top = ("tie_word_embeddings", "attn_implementation", "experts_implementation")
        text = {k: v for k, v in {**_COMMON, **kw, **overrides}.items() if k not in top}
        return getattr(transformers, cfg_cls)(text_config=text, vision_config=VISION[name],
                                              **{k: _COMMON[k] for k in top})
    return getattr(transformers, cfg_cls)(**{**_COMMON, **kw, **overrides})


def decoder_layer(model, qual):
    """The decoder layer of block ``qual`` (``model[.language_model].layers.<i>.mlp``)."""
    layers = getattr(model.model, "language_model", model.model).layers
    return layers[int(qual.split(".layers.")[1].split(".")[0])]


def sparse_blocks(model):
    return [(n, m) for n, m in model.named_modules() if hf.family_of(m) is not None]


def tiny(name, seed=0, skew=True, **overrides):
    """A tiny HF CausalLM with realistically scaled weights (HF's 0.02 init routes uniformly and
    gives outputs ~1e-4, against which a 1e-5 check proves nothing).  skew: the embeddings share a
    direction that router row HOT follows, so ~90 % of the tokens pick expert HOT (its fair share
    is K/E = 25 %) and the planner has to replicate it."""
    torch.manual_seed(seed)
    model = getattr(transformers, TINY[name][1])(make_config(name, **overrides)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    mu = torch.randn(D, generator=g)
    mu /= mu.norm()
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=g) + (3.0 * mu if skew else 0.0))
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=g) * 0.1)
        for _, blk in sparse_blocks(model):
            for pname, p in blk.named_parameters():
                std = 0.25 if pname in ("gate.weight", "shared_expert_gate.weight") else 0.07
                p.copy_(torch.randn(p.shape, generator=g) * std)
            if skew:
                blk.gate.weight[HOT] += 1.5 * mu
            if score_bias(blk) is not None:
                score_bias(blk).copy_(torch.randn(E, generator=g) * 0.3)
                if skew:
                    score_bias(blk)[HOT] += 0.6
    return model


def batch(rank, step=0):
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + 5)
    return torch.randint(0, V, (BATCH, SEQ), generator=g)


def snapshot(model):
    return ([(n, type(m)) for n, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()})


def assert_unchanged(model, snap):
    mods, sd = snap
    assert [(n, type(m)) for n, m in model.named_modules()] == mods
    now = model.state_dict()
    assert list(now) == list(sd) and all(torch.equal(now[k], sd[k]) for k in sd)


def assert_same_state(got, want):
    assert list(got) == list(want)
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


def maxdiff(a, b):
    return (a.detach().double() - b.detach().double()).abs().max().item()


def run(model, ids, **kw):
    """Forward + backward of loss (with the aux loss where the family has one); returns the
    output and the grad of the input embeddings."""
    emb = model.get_input_embeddings()(ids)
    emb.retain_grad()
    out = model(inputs_embeds=emb, labels=ids, output_router_logits=True, **kw)
    out.loss.backward()
    return out, emb.grad


def compare_run(ref, model, ids, group=None, call=None, **kw):
    """The converted model (run as ``call``, default itself) against the unconverted one on this
    rank's batch: outputs, router logits, aux loss, input-embedding grads, the replicated
    parameters' grads (this rank's reference grads) and the expert grads (the sum over the group
    of the reference grads)."""
    want, gx_want = run(ref, ids, **kw)
    got, gx_got = run(model if call is None else call, ids, **kw)
    bad = {}

    def check(what, a, b, tol=TOL):
        d = maxdiff(a, b)
        if not d <= tol:
            bad[what] = d

    check("logits", got.logits, want.logits)
    check("loss", got.loss, want.loss)
    check("d inputs_embeds", gx_got, gx_want)
    assert (got.aux_loss is None) == (want.aux_loss is None)
    if want.aux_loss is not None:
        check("aux_loss", got.aux_loss, want.aux_loss)
    assert len(got.router_logits) == len(want.router_logits) == len(sparse_blocks(ref))
    for i, (a, b) in enumerate(zip(got.router_logits, want.router_logits)):
        assert a.shape == b.shape == (ids.numel(), E) and a.dtype == b.dtype
        assert a.requires_grad                                   # not detached
        check(f"router_logits[{i}]", a, b)
    blocks = hf.converted_blocks(model)
    for pname, p in ref.named_parameters():
        owner = next((b for b in blocks if pname.startswith(b + ".")), None)
        if owner is None:
            mine = model.get_parameter(pname).grad
            if p.grad is None:         # takes no part (a vision tower on text batches)
                assert mine is None, f"{pname}: a grad where the reference has none"
            else:
                check(pname, mine, p.grad)
            continue
        layer, key = blocks[owner], pname[len(owner) + 1:]
        targets = layer.to_moe_keys({key: p.grad})
        targets.pop("router.expert_bias", None)                  # a buffer: no grad
        for target, g in targets.items():
            mine = layer.moe.get_parameter(target).grad
            if target in ("w1", "w3", "w2"):
                g = g.clone()
                if group is not None:
                    dist.all_reduce(g, group=group)            # every rank's contribution
                sl = slice(layer.moe.expert_offset, layer.moe.expert_offset + mine.shape[0])
                g = g[sl]
            check(f"{owner}.moe.{target}", mine, g)
    assert not bad, bad
    return got


# ---------------------------------------------------------------------------------------------
# Router: router_args reproduces each HF router bitwise
# ---------------------------------------------------------------------------------------------


def _router_for(blk, config):
    a = hf.router_args(config)
    r = Router(D, a.pop("num_experts"), a.pop("top_k"), **a,
               dtype=blk.experts.gate_up_proj.dtype)
    with torch.no_grad():
        r.gate.weight.copy_(blk.gate.weight)
        if score_bias(blk) is not None:
            r.expert_bias.copy_(score_bias(blk))
    return r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,ov", VARIANTS, ids=VIDS)
def test_router_args_reproduce_the_hf_router_bitwise(name, ov, dtype):
    model = tiny(name, **ov).to(dtype)
    for _, blk in sparse_blocks(model):
        if biased_groups(name):
            blk.gate.float()                      # from_pretrained keeps it fp32
        x = torch.randn(BATCH * SEQ, D, generator=torch.Generator().manual_seed(3)).to(dtype)
        x += 3.0 * blk.gate.weight[HOT].to(dtype) / blk.gate.weight[HOT].norm().to(dtype)
        with torch.no_grad():
            logits, w, ids = hf_route(blk, x)
            rid, rw, rlog = _router_for(blk, model.config)(x)
        assert rid.dtype == torch.int32 and rw.dtype == torch.float32
        assert torch.equal(rid, ids.int()) and torch.equal(rw, w.float())
        assert torch.equal(rlog, logits) and rlog.dtype == logits.dtype


@pytest.mark.parametrize("name", FAMILIES)
def test_router_ties_resolve_as_in_hf(name):
    """Four identical router rows: exact ties at the top-k boundary for every token.  torch.topk
    breaks them in an implementation-defined way; the Router makes the same calls (same k, same
    sorted flag, same shapes), so it picks the same experts on the same device."""
    model = tiny(name)
    for _, blk in sparse_blocks(model):
        with torch.no_grad():
            blk.gate.weight[1:5] = blk.gate.weight[HOT].clone() * 3
            if score_bias(blk) is not None:
                score_bias(blk)[1:5] = 0.5
            x = torch.randn(BATCH * SEQ, D, generator=torch.Generator().manual_seed(4))
            x += 4.0 * blk.gate.weight[HOT] / blk.gate.weight[HOT].norm()
            logits, w, ids = hf_route(blk, x)
            assert (logits[:, 1:5] == logits[:, 1:2]).all()
            rid, rw, _ = _router_for(blk, model.config)(x)
        assert torch.equal(rid, ids.int()) and torch.equal(rw, w.float())


def test_router_args_per_family():
    cfg = make_config("deepseek_v3")
    assert hf.router_args(cfg) == dict(
        num_experts=E, top_k=K, score_func="sigmoid", topk_before_score=False, route_norm=False,
        route_norm_eps=1e-20, route_scale=2.5, num_expert_groups=4, num_limited_groups=2,
        sorted_topk=False, router_dtype=torch.float32, round_weights=False, gate_bias=False)
    a = hf.router_args(make_config("mixtral"))
    assert a["route_norm"] and not a["round_weights"] and a["router_dtype"] is None
    for name in ("qwen2_moe", "qwen3_moe", "olmoe"):
        a = hf.router_args(make_config(name))
        assert a["round_weights"] and a["route_norm"] == TINY[name][2]["norm_topk_prob"]
    # a multimodal model's own config: its text config's router
    assert hf.router_args(make_config("glm4v_moe_text"))["num_expert_groups"] == 4
    with pytest.raises(NotImplementedError, match="model_type='llama'"):
        hf.router_args(transformers.LlamaConfig())


# ---------------------------------------------------------------------------------------------
# One rank, in process: equivalence, router logits, checkpoints
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,ov", VARIANTS, ids=VIDS)
def test_converted_model_equals_hf(name, ov):
    model = tiny(name, **ov)
    ref = copy.deepcopy(model)
    n_params = sum(p.numel() for p in model.parameters())
    assert hf.convert_model(model, capacity=CAP, token_padding=TP) is model
    blocks = hf.converted_blocks(model)
    assert list(blocks) == [n for n, _ in sparse_blocks(ref)] and not sparse_blocks(model)
    assert len({id(b.moe.buffer) for b in blocks.values()}) == 1        # one shared Buffer
    assert sum(p.numel() for p in model.parameters()) == n_params       # R = 1: nothing extra
    for step in range(2):
        compare_run(ref, model, batch(0, step))
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_close_to_hf(name):
    """bf16: the router is HF's bitwise (above); the experts sum the K rows in fp32 and round
    once where HF rounds per expert, so each block's output agrees to about one bf16 ulp, not
    bitwise, and so do the logits of a pre-norm model.  FlexOlmo normalises each MLP's output
    with no norm before it, which scales those ulps up by the inverse of the output's RMS: only
    its blocks are checked.  DeepSeek-V3's router (and its code's
    families') stays fp32 (fp32 logits) inside the bf16 model."""
    model = tiny(name).to(torch.bfloat16)
    for _, blk in sparse_blocks(model):
        if biased_groups(name):
            blk.gate.float()
    ref = copy.deepcopy(model)
    hf.convert_model(model, capacity=CAP, token_padding=TP)
    ids = batch(0)
    with torch.no_grad():
        want = ref(input_ids=ids, labels=ids, output_router_logits=True)
        got = model(input_ids=ids, labels=ids, output_router_logits=True)
    assert got.logits.dtype == torch.bfloat16
    post_norm = name in POST_NORM
    if not post_norm:
        assert maxdiff(got.logits, want.logits) <= 4e-2 < 0.2 * want.logits.abs().max().item()
        assert maxdiff(got.loss, want.loss) <= 1e-2
    for a, b in zip(got.router_logits, want.router_logits):
        assert a.dtype == b.dtype == (torch.float32 if biased_groups(name) else torch.bfloat16)
    conv = hf.converted_blocks(model)
    x = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(5)).bfloat16()
    for bname, blk in sparse_blocks(ref):
        with torch.no_grad():
            a, b = blk(x), conv[bname](x)
        a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
        ulp = 2.0 ** (torch.floor(torch.log2(a.float().abs().max())) - 7)   # bf16: 8 bits
        assert maxdiff(b, a) <= 2 * ulp, f"{bname}: {maxdiff(b, a)} > 2 bf16 ulps of the max"


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral", "deepseek_v3"])
def test_router_logits_and_aux_loss_with_padding_and_hooks(name):
    """HF installs its capturing hooks lazily (on the first recorded forward): convert before and
    after that; exactly one record per sparse layer, with a padding mask in the aux loss."""
    ids = batch(0)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    for when in ("before_hooks", "after_hooks"):
        model = tiny(name)
        ref = copy.deepcopy(model)
        if when == "after_hooks":
            with torch.no_grad():
                model(input_ids=ids, output_router_logits=True)
            assert model.model._output_capturing_hooks_installed
        hf.convert_model(model, capacity=CAP, token_padding=TP)
        with torch.no_grad():
            want = ref(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
            for _ in range(2):                                  # neither lost nor doubled
                got = model(input_ids=ids, attention_mask=mask, labels=ids,
                            output_router_logits=True)
                assert len(got.router_logits) == len(want.router_logits) == len(sparse_blocks(ref))
                assert maxdiff(got.loss, want.loss) <= TOL
                if want.aux_loss is not None:
                    assert maxdiff(got.aux_loss, want.aux_loss) <= TOL
            plain = model(input_ids=ids)                         # not recording
        assert not plain.router_logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_full_state_dict_round_trip(name, dtype):
    def build(seed):
        m = tiny(name, seed=seed).to(dtype)
        if biased_groups(name):
            for _, blk in sparse_blocks(m):
                blk.gate.float()               # an fp32 router in a bf16 model, as from_pretrained
        return m

    model = build(0)
    orig = {k: v.clone() for k, v in model.state_dict().items()}
    ids = batch(0)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    hf.convert_model(model, capacity=CAP, token_padding=TP)
    assert list(model.state_dict()) != list(orig)
    full = hf.full_state_dict(model)
    assert_same_state(full, orig)
    fresh = build(123)
    fresh.load_state_dict(full, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, want)
        # the converted model's own state dict (local shards) and the HF layout both load back
        other = build(7)
        hf.convert_model(other, capacity=CAP, token_padding=TP)
        other.load_state_dict(model.state_dict(), strict=True)
        assert_same_state(hf.full_state_dict(other), orig)
        other2 = build(8)
        hf.convert_model(other2, capacity=CAP, token_padding=TP)
        other2.load_state_dict(full, strict=True)
        assert_same_state(hf.full_state_dict(other2), orig)
        if dtype == torch.float32:
            assert maxdiff(other2(input_ids=ids).logits, want) <= TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_save_pretrained_from_pretrained(name, tmp_path):
    """save_pretrained(state_dict=full_state_dict(model)) writes the hub layout (HF reverts its
    weight fusion: per-expert keys) and plain from_pretrained restores the model bit for bit."""
    from safetensors import safe_open
    model = tiny(name)
    orig = {k: v.clone() for k, v in model.state_dict().items()}
    hf.convert_model(model, capacity=CAP, token_padding=TP)
    model.save_pretrained(tmp_path, state_dict=hf.full_state_dict(model))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    mixtral_keys = name in LEGACY_MIXTRAL_KEYS
    moe, w1 = ("block_sparse_moe", "w1") if mixtral_keys else ("mlp", "gate_proj")
    pre = "model.language_model" if name in VISION else "model"
    assert f"{pre}.layers.1.{moe}.experts.0.{w1}.weight" in keys
    back = type(model).from_pretrained(tmp_path, experts_implementation="eager")
    assert_same_state(back.state_dict(), orig)


def test_activation_checkpointing():
    """HF's activation checkpointing re-runs the converted block in the backward (its collectives
    again, with the same routing); the recompute records no router logits."""
    model = tiny("qwen2_moe")
    ref = copy.deepcopy(model)
    hf.convert_model(model, capacity=CAP, token_padding=TP)
    for m in (model, ref):
        m.train()
        m.activation_checkpointing_enable()
    plans = _spy_plans(model)
    compare_run(ref, model, batch(0))
    assert len(plans) == 2 * len(hf.converted_blocks(model))      # forward + recompute


# ---------------------------------------------------------------------------------------------
# Compile
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_block_has_no_graph_break(name):
    """Each converted block compiles with fullgraph=True (any graph break would raise) and gives
    the eager forward and backward; new routings do not recompile."""
    from torch._dynamo.testing import CompileCounterWithBackend
    model = tiny(name)
    hf.convert_model(model, capacity=CAP, token_padding=TP)
    torch._dynamo.reset()
    for qual, blk in hf.converted_blocks(model).items():
        cnt = CompileCounterWithBackend("aot_eager")
        cblk = torch.compile(blk, backend=cnt, fullgraph=True)
        for step in range(3):
            x = model.get_input_embeddings()(batch(0, step)).detach()
            outs = []
            for f in (blk, cblk):
                xi = x.clone().requires_grad_(True)
                y = f(xi)
                (y * y).sum().backward()
                grads = [xi.grad] + [p.grad.clone() for p in blk.parameters()]
                blk.zero_grad(set_to_none=True)
                outs.append((y.detach(), grads))
            assert maxdiff(outs[0][0], outs[1][0]) <= TOL
            assert all(maxdiff(a, b) <= TOL for a, b in zip(outs[0][1], outs[1][1]))
            if step == 0:
                torch.compiler.set_stance("fail_on_recompile")
        torch.compiler.set_stance("default")
        assert cnt.frame_count == 1, qual
        # compiled on its own, the block cannot reach HF's collector: recording raises
        with pytest.raises(RuntimeError, match="compiled on its own"):
            decoder_layer(model, qual).mlp = cblk
            model(input_ids=batch(0), output_router_logits=True)
        decoder_layer(model, qual).mlp = blk


@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_model_equals_eager_without_recompiles(name):
    """torch.compile(model, fullgraph=True) with output_router_logits: logits, loss, aux loss,
    router logits and grads as eager over three batches with different routings, one graph for
    the whole model.  (The first recorded forward makes HF install its capturing hooks, which
    graph-breaks in HF's code: run it eagerly first.)"""
    from torch._dynamo.testing import CompileCounterWithBackend
    model = tiny(name, **COMPILE_OVERRIDES.get(name, {}))
    hf.convert_model(model, capacity=CAP, token_padding=TP)
    with torch.no_grad():
        model(input_ids=batch(0), output_router_logits=True)
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    cmodel = torch.compile(model, backend=cnt, fullgraph=True)
    routings = set()
    for step in range(3):
        ids = batch(0, step)
        res = []
        for m in (model, cmodel):
            out = m(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
            out.loss.backward()
            res.append((out, {n: p.grad.clone() for n, p in model.named_parameters()
                              if p.grad is not None}))     # not the vision tower's
            model.zero_grad(set_to_none=True)
        (e, ge), (c, gc) = res
        assert maxdiff(e.logits, c.logits) <= TOL and maxdiff(e.loss, c.loss) <= TOL
        assert len(c.router_logits) == len(e.router_logits) == len(hf.converted_blocks(model))
        assert all(maxdiff(a, b) <= TOL for a, b in zip(e.router_logits, c.router_logits))
        assert all(maxdiff(ge[n], gc[n]) <= TOL for n in ge), name
        routings.add(tuple(e.router_logits[0].argmax(-1).tolist()))
        if step == 0:
            frames = cnt.frame_count
            torch.compiler.set_stance("fail_on_recompile")
    torch.compiler.set_stance("default")
    assert len(routings) == 3 and cnt.frame_count == frames == 1


# ---------------------------------------------------------------------------------------------
# Refusals: validated before anything is converted, the model left unchanged
# ---------------------------------------------------------------------------------------------


def _refused(model, exc, match, **kw):
    snap = snapshot(model)
    with pytest.raises(exc, match=match):
        hf.convert_model(model, **{"capacity": CAP, **kw})
    assert_unchanged(model, snap)


@pytest.mark.parametrize("name", sorted(SAME_CODE))
def test_added_families_are_a_base_familys_code(name):
    """A family added by table entry only is sound while transformers' classes for it are the
    base family's code: the sparse block, its router, experts and MLP, compared as source with
    the class-name prefix taken out (a change in either turns this red)."""
    import importlib
    import inspect
    import re
    base, mine, theirs = SAME_CODE[name]
    fam, bfam = hf.FAMILIES_BY_TYPE[name], hf.FAMILIES_BY_TYPE[base]
    mod, bmod = importlib.import_module(fam.module), importlib.import_module(bfam.module)
    suffixes = [bfam.block_class[len(theirs):], "TopkRouter", "TopKRouter", "Experts", "MLP"]
    compared = 0
    for suf in suffixes:
        a, b = getattr(mod, mine + suf, None), getattr(bmod, theirs + suf, None)
        if a is None and b is None:
            continue
        assert a is not None and b is not None, f"{mine}{suf} / {theirs}{suf}: one is missing"
        # "((name), ...)" and "(name, ...)" are the same call
        src_a = re.sub(r"\(\(([\w.]+)\)", r"(\1", inspect.getsource(a).replace(mine, "X"))
        src_b = re.sub(r"\(\(([\w.]+)\)", r"(\1", inspect.getsource(b).replace(theirs, "X"))
        assert src_a == src_b, f"{mine}{suf} is no longer {theirs}{suf}'s code"
        compared += 1
    assert compared >= 3


@pytest.mark.parametrize("cfg,cls,kw,why", [
    ("DeepseekV2Config", "DeepseekV2ForCausalLM",                 # group-limited softmax
     dict(intermediate_size=96, moe_intermediate_size=24, n_routed_experts=E, n_shared_experts=1,
          first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
          qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4), "not one of the supported"),
    ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",             # renorm clamped at norm_min
     dict(intermediate_size=96, moe_intermediate_size=24, num_experts=E),
     "ERNIE-4.5-MoE renormalises the top-k weights with a clamp"),
    ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",             # gate.wg, its own fp32 rule
     dict(intermediate_size=24, num_experts=E, moe_topk=K, head_dim=16),
     "HunYuan-A13B's MoE uses its own module names")],
    ids=["deepseek_v2", "ernie4_5_moe", "hunyuan_v1_moe"])
def test_refuses_moe_families_whose_router_differs(cfg, cls, kw, why):
    """Blocks that look like a supported family's (an experts child, a gate) but route otherwise:
    refused by name and reason, not converted with the wrong router."""
    model = getattr(transformers, cls)(getattr(transformers, cfg)(**{**_COMMON, **kw}))
    _refused(model, NotImplementedError, rf"at 'model\.layers\.\d\.mlp' .*{why}")


def test_refuses_qwen3_vl_moe_whose_checkpoints_would_not_round_trip():
    text = dict(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=96, moe_intermediate_size=24, num_experts=E,
                num_experts_per_tok=K, vocab_size=V,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=D,
                  deepstack_visual_indexes=[])
    cfg = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision)
    model = transformers.Qwen3VLMoeForConditionalGeneration(cfg)
    _refused(model, NotImplementedError, r"Qwen3VLMoeTextSparseMoeBlock at .*save_pretrained")


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_refuses_non_silu(name):
    _refused(tiny(name, hidden_act="gelu"), NotImplementedError,
             r"(Qwen3MoeSparseMoeBlock|DeepseekV3MoE) at .*: hidden_act='gelu'")


def test_refuses_mixtral_jitter_and_checks_every_block_first():
    model = tiny("mixtral")
    model.model.layers[1].mlp.jitter_noise = 0.1        # layer 0 fine, layer 1 not
    _refused(model, NotImplementedError,
             r"MixtralSparseMoeBlock at 'model\.layers\.1\.mlp': router_jitter_noise=0\.1")
    _refused(tiny("mixtral", router_jitter_noise=0.01), NotImplementedError,
             r"router_jitter_noise=0\.01")


def test_refuses_deepseek_groups_that_cannot_hold_top_k():
    _refused(tiny("deepseek_v3", n_group=4, topk_group=1, num_experts_per_tok=4),
             NotImplementedError,
             r"DeepseekV3MoE.*topk_group=1 \* n_routed_experts=8 / n_group=4 = 2 < "
             r"num_experts_per_tok=4")


def test_refuses_bad_arguments_and_edited_configs():
    model = tiny("qwen3_moe")
    _refused(model, ValueError, "capacity", capacity=0)
    _refused(model, ValueError, "token_padding", token_padding=0)
    _refused(model, ValueError, "policy", policy="nope")
    _refused(model, ValueError, "slack is a setting of policy 'cost'", slack=0.1)
    with pytest.raises(ValueError, match="not a block"):
        hf.convert_model(model.model.layers[1].mlp, capacity=CAP)
    model.config.norm_topk_prob = False                 # the router kept True
    _refused(model, ValueError, r"norm_topk_prob=True but its config says norm_topk_prob=False")


def test_model_without_moe_block_is_returned_unchanged_with_a_warning():
    model = tiny("qwen2_moe", mlp_only_layers=[0, 1])    # every layer dense
    snap = snapshot(model)
    with pytest.warns(UserWarning, match="no sparse-MoE block"):
        assert hf.convert_model(model, capacity=CAP) is model
    assert_unchanged(model, snap)
    hf.convert_model(tiny("olmoe"), capacity=CAP)
    done = hf.convert_model(tiny("olmoe"), capacity=CAP)
    with pytest.warns(UserWarning, match="already converted"):
        hf.convert_model(done, capacity=CAP)


def test_more_tokens_than_capacity_raise():
    model = tiny("olmoe")
    hf.convert_model(model, capacity=16, token_padding=TP)
    with pytest.raises(ValueError, match="capacity S=16"):
        model(input_ids=batch(0))                       # 32 tokens
    model(input_ids=batch(0)[:, :8])                    # 16: fine


# ---------------------------------------------------------------------------------------------
# R = 1, 2, 4 gloo ranks: each rank its own batch (one spawn per R runs every case)
# ---------------------------------------------------------------------------------------------


def _spy_plans(model):
    """Record the plan of every dispatch of the model's Buffers (eager)."""
    plans = []
    layers = hf.converted_blocks(model).values()
    for buf in {id(b.moe.buffer): b.moe.buffer for b in layers}.values():
        orig = buf.dispatch

        def spy(*a, _orig=orig, **kw):
            out = _orig(*a, **kw)
            plans.append(out[3])
            return out
        buf.dispatch = spy
    return plans


def _equivalence_case(ctx, name):
    R, r = ctx.R, ctx.rank
    model = tiny(name)                              # the same seed: the same full model everywhere
    ref = copy.deepcopy(model)
    n_ref = sum(p.numel() for p in ref.parameters())
    hf.convert_model(model, group=ctx.group, capacity=CAP, token_padding=TP)
    blocks = hf.converted_blocks(model)
    assert len({id(b.moe.buffer) for b in blocks.values()}) == 1
    B = E // R
    expert_numel = 0
    for qual, layer in blocks.items():
        moe = layer.moe
        assert moe.owned_experts() == range(r * B, (r + 1) * B)
        assert moe.buffer.R == R and moe.buffer.rank == r
        gu = ref.get_submodule(qual).experts.gate_up_proj
        assert torch.equal(moe.w1, gu[r * B:(r + 1) * B, :F])
        expert_numel += sum(ref.get_submodule(qual).experts.get_parameter(p).numel()
                            for p in ("gate_up_proj", "down_proj"))
    # no parameter beyond the dense ones and E/R of each block's experts
    assert sum(p.numel() for p in model.parameters()) == n_ref - expert_numel * (R - 1) // R
    plans = _spy_plans(model)
    compare_run(ref, model, batch(r), group=ctx.group if R > 1 else None)
    if R > 1:                                       # the skew really made the planner replicate
        replicated = torch.tensor([sum(int(p.remote_stats[0]) for p in plans)])
        dist.all_reduce(replicated, group=ctx.group)
        assert replicated.item() > 0
    # checkpoints: the unconverted layout on every rank, bitwise; a fresh HF model loads it
    full = hf.full_state_dict(model)
    assert_same_state(full, ref.state_dict())
    fresh = tiny(name, seed=99)
    fresh.load_state_dict(full, strict=True)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=batch(r)).logits, ref(input_ids=batch(r)).logits)
        # local shards and the full HF layout load back into a converted model
        other = tiny(name, seed=98)
        hf.convert_model(other, group=ctx.group, capacity=CAP, token_padding=TP)
        other.load_state_dict(model.state_dict(), strict=True)
        assert_same_state(hf.full_state_dict(other), full)
        other.load_state_dict(full, strict=True)
        assert_same_state(hf.full_state_dict(other), full)
        assert maxdiff(other(input_ids=batch(r)).logits, ref(input_ids=batch(r)).logits) <= TOL
    for m in (model, other):
        next(iter(hf.converted_blocks(m).values())).moe.buffer.destroy()


def case_qwen2_moe(ctx):
    _equivalence_case(ctx, "qwen2_moe")


def case_qwen3_moe(ctx):
    _equivalence_case(ctx, "qwen3_moe")


def case_mixtral(ctx):
    _equivalence_case(ctx, "mixtral")


def case_olmoe(ctx):
    _equivalence_case(ctx, "olmoe")


def case_deepseek_v3(ctx):
    _equivalence_case(ctx, "deepseek_v3")


def case_glm4_moe(ctx):                # DeepSeek-V3's code with other groups and scale
    _equivalence_case(ctx, "glm4_moe")


def case_qwen3_next(ctx):              # Qwen2-MoE's block next to linear attention
    _equivalence_case(ctx, "qwen3_next")


def case_exaone_moe(ctx):              # DeepSeek-V3's router in EXAONE's code
    _equivalence_case(ctx, "exaone_moe")


def case_minimax_m2(ctx):              # Mixtral's experts, the block's biased sigmoid router
    _equivalence_case(ctx, "minimax_m2")


def case_qwen3_5_moe_text(ctx):        # the same block, renorm always on, inside a VLM
    _equivalence_case(ctx, "qwen3_5_moe_text")


def case_qwen3_moe_cost_policy(ctx):
    """policy "cost" with a slack: the converted model still equals HF (any plan computes every
    copy once), its Buffer carries the slack and a replica cost from the block's F."""
    model = tiny("qwen3_moe")
    ref = copy.deepcopy(model)
    hf.convert_model(model, group=ctx.group, capacity=CAP, token_padding=TP, policy="cost",
                     slack=0.2, link_gbps=900.0)
    buf = next(iter(hf.converted_blocks(model).values())).moe.buffer
    assert (buf.policy, buf.slack_ppm) == ("cost", 200_000) and buf.replica_cost >= 0
    compare_run(ref, model, batch(ctx.rank), group=ctx.group if ctx.R > 1 else None)
    buf.destroy()


def case_subgroups(ctx):
    """EP over subgroups (R = 4 processes as 2 EP groups of 2): ownership by the group rank,
    expert grads summed within the group only, full_state_dict gathered within the group."""
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]     # every rank creates both
    group = halves[ctx.rank // 2]
    r = dist.get_rank(group)
    model = tiny("deepseek_v3")
    ref = copy.deepcopy(model)
    hf.convert_model(model, group=group, capacity=CAP, token_padding=TP)
    layer = model.model.layers[1].mlp
    assert layer.moe.owned_experts() == range(r * E // 2, (r + 1) * E // 2)
    compare_run(ref, model, batch(ctx.rank), group=group)
    assert_same_state(hf.full_state_dict(model), ref.state_dict())
    layer.moe.buffer.destroy()


def case_compiled_model(ctx):
    """torch.compile(model, fullgraph=True) over the gloo data plane: the unconverted model's
    results on each rank's batch, one graph, no recompile when the routing changes."""
    from torch._dynamo.testing import CompileCounterWithBackend
    model = tiny("qwen2_moe")
    ref = copy.deepcopy(model)
    hf.convert_model(model, group=ctx.group, capacity=CAP, token_padding=TP)
    with torch.no_grad():
        model(input_ids=batch(ctx.rank), output_router_logits=True)   # HF installs its hooks
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    cmodel = torch.compile(model, backend=cnt, fullgraph=True)
    for step in range(3):
        compare_run(ref, model, batch(ctx.rank, step), group=ctx.group, call=cmodel,
                    use_cache=False)
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        if step == 0:
            torch.compiler.set_stance("fail_on_recompile")
    torch.compiler.set_stance("default")
    assert cnt.frame_count == 1
    next(iter(hf.converted_blocks(model).values())).moe.buffer.destroy()


def case_data_parallel_recipe(ctx):
    """DDP over a converted model with the expert weights ignored (expert_parameter_names): the
    replicated grads become the mean over the ranks, the expert grads stay the sum, and DDP's
    start-up broadcast leaves each rank's own experts alone."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    R, r = ctx.R, ctx.rank
    model = tiny("qwen2_moe")
    ref = copy.deepcopy(model)
    hf.convert_model(model, group=ctx.group, capacity=CAP, token_padding=TP)
    names = hf.expert_parameter_names(model)
    assert len(names) == 3 * len(hf.converted_blocks(model))
    assert all(model.get_parameter(n).shape[0] == E // R for n in names)
    DDP._set_params_and_buffers_to_ignore_for_model(model, names)
    ddp = DDP(model, process_group=ctx.group)
    ids = batch(r)
    ddp(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    layer = model.model.layers[1].mlp
    sl = slice(r * E // R, (r + 1) * E // R)
    gu = ref.model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(layer.moe.w1, gu[sl, :F])                # not overwritten by rank 0's
    for pname, p in ref.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=ctx.group)
        if pname.endswith("experts.gate_up_proj"):
            assert maxdiff(layer.moe.w1.grad, g[sl, :F]) <= TOL            # the sum
            assert maxdiff(layer.moe.w3.grad, g[sl, F:]) <= TOL
        elif pname.endswith("experts.down_proj"):
            assert maxdiff(layer.moe.w2.grad, g[sl]) <= TOL
        elif ".mlp.gate." in pname or ".mlp.shared" in pname:
            key = pname.split(".mlp.", 1)[1]
            (target,) = [t for t in layer.to_moe_keys({key: g}) if t != "router.expert_bias"]
            assert maxdiff(layer.moe.get_parameter(target).grad, g / R) <= TOL, pname
        else:
            assert maxdiff(model.get_parameter(pname).grad, g / R) <= TOL, pname   # the mean
    layer.moe.buffer.destroy()


def case_refusals_under_ep(ctx):
    """E not divisible by R, and a model already sharded by HF (DTensor experts)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    R = ctx.R
    bad = tiny("mixtral", skew=False, num_local_experts=R + 1)
    _refused(bad, ValueError, rf"MixtralSparseMoeBlock.*num_local_experts={R + 1} is not "
             rf"divisible by the EP group size R={R}", group=ctx.group)
    model = tiny("qwen3_moe")
    ex = model.model.layers[1].mlp.experts
    mesh = init_device_mesh("cpu", (R,))
    ex.gate_up_proj = torch.nn.Parameter(distribute_tensor(ex.gate_up_proj.data, mesh, [Shard(0)]))
    mods = [(n, type(m)) for n, m in model.named_modules()]
    with pytest.raises(NotImplementedError, match=r"Qwen3MoeSparseMoeBlock.*experts\.gate_up_proj "
                       r"is a DTensor.*distributed_config"):
        hf.convert_model(model, group=ctx.group, capacity=CAP)
    assert [(n, type(m)) for n, m in model.named_modules()] == mods


MULTI_RANK = multi_rank_cases(globals(), ranks=(1, 2, 4),
                              only_at={"case_refusals_under_ep": (2, 4),
                                       "case_compiled_model": (2,),
                                       "case_data_parallel_recipe": (2,),
                                       "case_subgroups": (4,)})
_results = cached_runner(__name__, MULTI_RANK, timeout_s=420, pg_timeout_s=120)


@pytest.mark.parametrize("R,case", MULTI_RANK)
def test_multi_rank(R, case):
    res = _results(R)[case]
    assert res.ok, res.error


def test_precision_fp8_passes_through():
    """convert_model(precision="fp8") builds FP8 blocks (the DeepSeek-V3 recipe, docs/fp8.md):
    logits of a bf16 model stay close to the bf16 conversion's, and the backward runs.  Sizes
    that the FP8 kernels cannot take (F = 24) are refused before any block is converted."""
    with pytest.raises(ValueError, match="multiples of 16"):
        hf.convert_model(tiny("mixtral").to(torch.bfloat16), capacity=CAP, token_padding=TP,
                         precision="fp8")
    models = {}
    for prec in ("bf16", "fp8"):
        model = tiny("mixtral", intermediate_size=32).to(torch.bfloat16)
        hf.convert_model(model, capacity=CAP, token_padding=TP, precision=prec,
                         fp8_pow2_scales=prec == "fp8")
        blocks = hf.converted_blocks(model)
        assert {(b.moe.args.precision, b.moe.args.fp8_pow2_scales) for b in blocks.values()} \
            == {(prec, prec == "fp8")}
        models[prec] = model
    ids = batch(0)
    out = {p: m(input_ids=ids, labels=ids) for p, m in models.items()}
    rel = float((out["fp8"].logits.float() - out["bf16"].logits.float()).norm()
                / out["bf16"].logits.float().norm())
    assert 0 < rel < 5e-2, rel
    out["fp8"].loss.backward()
    grads = [p.grad for p in models["fp8"].parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_fp8_weight_cache_and_wgrad_pass_through():
    """convert_model(fp8_weight_cache=, fp8_wgrad=) reach every layer's MoEArgs; with the cache
    each layer holds an FP8WeightCache of cache_nbytes(E/R, F, D) bytes, and a forward/backward
    step gives the uncached step's logits, loss and every grad bitwise (the cache holds the same
    block quantisation the op computes otherwise).  Set with precision "bf16", or not bools,
    they raise before any block is converted."""
    from moonep_ops.ops.fp8_weight_cache import FP8WeightCache, cache_nbytes
    model = tiny("mixtral", intermediate_size=32).to(torch.bfloat16)
    for bad, err, match in ((dict(fp8_weight_cache=True), ValueError, "options of precision"),
                            (dict(fp8_wgrad=True), ValueError, "options of precision"),
                            (dict(precision="fp8", fp8_wgrad=1), TypeError, "fp8_wgrad")):
        with pytest.raises(err, match=match):
            hf.convert_model(model, capacity=CAP, token_padding=TP, **bad)
        assert not hf.converted_blocks(model)
    runs = {}
    for opts in (dict(), dict(fp8_weight_cache=True), dict(fp8_wgrad=True)):
        model = tiny("mixtral", intermediate_size=32).to(torch.bfloat16)
        hf.convert_model(model, capacity=CAP, token_padding=TP, precision="fp8", **opts)
        layers = [b.moe for b in hf.converted_blocks(model).values()]
        assert {(m.args.fp8_weight_cache, m.args.fp8_wgrad) for m in layers} == {
            (opts.get("fp8_weight_cache", False), opts.get("fp8_wgrad", False))}
        for m in layers:
            if opts.get("fp8_weight_cache"):
                assert isinstance(m.fp8_cache, FP8WeightCache)
                assert m.fp8_cache.nbytes() == cache_nbytes(E, 32, D)
            else:
                assert m.fp8_cache is None
        ids = batch(0)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        runs[tuple(opts)] = [out.logits, out.loss] + [p.grad for p in model.parameters()
                                                      if p.requires_grad]
        if opts.get("fp8_weight_cache"):
            assert all(m.fp8_cache.refreshes == {"fwd": 1, "bwd": 1} for m in layers)
    ref = runs[()]
    assert all(torch.equal(a, b) for a, b in zip(runs[("fp8_weight_cache",)], ref))
    # fp8_wgrad: the same forward; the backward's expert weight grads from FP8 operands
    wg = runs[("fp8_wgrad",)]
    assert torch.equal(wg[0], ref[0]) and torch.equal(wg[1], ref[1])
    assert any(not torch.equal(a, b) for a, b in zip(wg[2:], ref[2:]))
    assert all(torch.isfinite(g).all() for g in wg[2:])
