"""The supported transformers sparse-MoE families: which HF block, which config fields, which
router options reproduce the family's router (``router_args``)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import Tensor, nn


def _router_fields(**kw) -> dict:
    fields = dict(score_func="softmax", topk_before_score=False, route_norm=False,
                  route_norm_eps=0.0, route_scale=1.0, num_expert_groups=1, num_limited_groups=1,
                  sorted_topk=True, router_dtype=None, round_weights=False, gate_bias=False)
    fields.update(kw)
    return fields


def _softmax_rounded(config) -> dict:
    # Qwen2-MoE, Qwen3-MoE, OLMoE: logits = x @ W^T in the model dtype, softmax(logits, fp32),
    # top-k on the probabilities (sorted), optional renorm without eps, weights rounded back to
    # the logits' dtype.
    return _router_fields(route_norm=bool(config.norm_topk_prob), round_weights=True)


def _softmax_rounded_renorm(config) -> dict:
    # Qwen3.5-MoE: the same router with the renorm always on (no norm_topk_prob field).
    return _router_fields(route_norm=True, round_weights=True)


def _mixtral(config) -> dict:
    # logits in the model dtype, softmax(logits.float()), top-k on the probabilities, always
    # renormalised (no eps), fp32 weights.
    return _router_fields(route_norm=True)


def _minimax_m2(config) -> dict:
    # logits in the router weight's dtype, sigmoid(logits.float()), the block's
    # e_score_correction_bias for the choice only, top-k unsorted on the biased scores, weights =
    # unbiased scores, always renormalised (no eps), no scale, fp32 weights; no groups.
    return _router_fields(score_func="sigmoid", route_norm=True, sorted_topk=False)


def _gpt_oss(config) -> dict:
    # logits = x @ W^T + b in the model dtype, top-k on the logits (sorted), softmax over the K
    # in the logits' dtype (computed in fp32, rounded once), no renorm, no scale.
    return _router_fields(topk_before_score=True, gate_bias=True, round_weights=True)


def _deepseek_v3(config) -> dict:
    # fp32 logits (x and W cast to fp32), sigmoid scores, e_score_correction_bias for the choice
    # only, group-limited top-k (group score = sum of the top-2 biased scores; sorted=False for
    # both top-ks), weights = unbiased scores, renorm with + 1e-20, then * routed_scaling_factor
    # (with or without renorm).  sigmoid and the "noaux_tc" choice are hard-coded in HF
    # (scoring_func / topk_method in a config are ignored there, and here).
    return _router_fields(score_func="sigmoid", route_norm=bool(config.norm_topk_prob),
                          route_norm_eps=1e-20, route_scale=float(config.routed_scaling_factor),
                          num_expert_groups=int(config.n_group),
                          num_limited_groups=int(config.topk_group), sorted_topk=False,
                          router_dtype=torch.float32)


@dataclasses.dataclass(frozen=True)
class Family:
    """One supported transformers sparse-MoE family.

    ``experts_field`` / ``ffn_field``: the config fields of E and F.  ``shared`` / ``shared_gate``:
    the block's shared-expert MLP and its sigmoid gate (None: none).  ``router_attrs``: (HF router
    attribute, config field) pairs the HF router copied at construction (checked against the
    config: the router's copy is what HF computes with).  ``biased_groups``: DeepSeek-V3's router
    (an fp32 weight in any model dtype, ``gate.e_score_correction_bias``, group-limited top-k).
    ``score_bias``: the block's state-dict key of a selection-only score bias (it becomes the
    Router's ``expert_bias``; None: none).
    ``jitter``: Mixtral's block (``router_jitter_noise``, refused when > 0).  ``package``: the
    transformers model package when it is not ``model_type`` (a multimodal model's text config
    has its own type, e.g. ``glm4v_moe_text`` in ``glm4v_moe``).  ``layout``: the experts'
    "fused" (``gate_up_proj [E, 2F, D]`` = [gate; up], ``down_proj [E, D, F]``, no biases, SiLU)
    or "gpt_oss" (``gate_up_proj [E, D, 2F]`` gate and up interleaved along the last dim,
    ``down_proj [E, F, D]``, their biases, the clamped SwiGLU; the block returns (out,
    router_scores)).  ``router_name``: the block's router attribute.  A family is added
    only where its transformers block, router, experts and MLP classes are the same code as an
    existing family's up to the class-name prefix (tests/test_integrations_hf.py checks it)."""
    model_type: str
    block_class: str
    experts_field: str
    ffn_field: str
    router: Callable[[object], dict]
    shared: Optional[str] = None
    shared_gate: Optional[str] = None
    router_attrs: tuple = ()
    biased_groups: bool = False
    score_bias: Optional[str] = None
    jitter: bool = False
    package: Optional[str] = None
    layout: str = "fused"
    router_name: str = "gate"

    @property
    def module(self) -> str:
        pkg = self.package or self.model_type
        return f"transformers.models.{pkg}.modeling_{pkg}"

    def key_map(self) -> dict[str, tuple[str, ...]]:
        """HF block state-dict key -> the MoonEPMoE key(s) it maps to (two: gate_up_proj holds
        w1 and w3, ``to_moe`` / ``to_hf`` say how)."""
        if self.layout == "gpt_oss":
            return {"router.weight": ("router.gate.weight",), "router.bias": ("router.gate.bias",),
                    "experts.gate_up_proj": ("w1", "w3"), "experts.gate_up_proj_bias": ("b1", "b3"),
                    "experts.down_proj": ("w2",), "experts.down_proj_bias": ("b2",)}
        m = {"gate.weight": ("router.gate.weight",),
             "experts.gate_up_proj": ("w1", "w3"),
             "experts.down_proj": ("w2",)}
        if self.score_bias:
            m[self.score_bias] = ("router.expert_bias",)
        if self.shared:
            for theirs, ours in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                m[f"{self.shared}.{theirs}.weight"] = (f"shared.{ours}.weight",)
        if self.shared_gate:
            m[f"{self.shared_gate}.weight"] = ("shared_gate.weight",)
        return m

    def expert_keys(self) -> dict[str, int]:
        """The block keys that hold one entry per expert ([E, ...]) -> how many MoonEPMoE tensors
        each holds."""
        return {k: len(t) for k, t in self.key_map().items() if k.startswith("experts.")}

    def to_moe(self, key: str, t: Tensor) -> tuple[Tensor, ...]:
        """An HF block tensor (any number of leading experts) -> its ``key_map`` targets' values
        (views)."""
        if self.layout == "gpt_oss" and key in ("experts.gate_up_proj", "experts.gate_up_proj_bias"):
            tr = key == "experts.gate_up_proj"           # [.., D, 2F] -> [.., F, D] twice
            return tuple(t[..., i::2].transpose(-1, -2) if tr else t[..., i::2] for i in (0, 1))
        if self.layout == "gpt_oss" and key == "experts.down_proj":
            return (t.transpose(-1, -2),)
        if len(self.key_map()[key]) == 2:
            return tuple(t.chunk(2, dim=1))
        return (t,)

    def to_hf(self, key: str, parts) -> Tensor:
        """The inverse of ``to_moe``: the HF block tensor from its targets' values."""
        if self.layout == "gpt_oss" and key in ("experts.gate_up_proj", "experts.gate_up_proj_bias"):
            tr = key == "experts.gate_up_proj"
            return torch.stack([p.transpose(-1, -2) if tr else p for p in parts], -1).flatten(-2)
        if self.layout == "gpt_oss" and key == "experts.down_proj":
            return parts[0].transpose(-1, -2).contiguous()
        return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=1)

    def expert_args(self, config, experts: nn.Module) -> dict:
        """The ``MoEArgs`` expert fields of the family (gpt-oss: biases, the clamped SwiGLU with
        the experts' own alpha and limit, what HF computes with)."""
        if self.layout != "gpt_oss":
            return {}
        return dict(expert_bias=True, activation="swiglu_clamped",
                    swiglu_alpha=float(experts.alpha), swiglu_limit=float(experts.limit))


_QWEN_ATTRS = (("top_k", "num_experts_per_tok"), ("num_experts", "num_experts"),
               ("norm_topk_prob", "norm_topk_prob"))
_QWEN3_5_ATTRS = (("top_k", "num_experts_per_tok"), ("num_experts", "num_experts"))
_MIXTRAL_ATTRS = (("top_k", "num_experts_per_tok"), ("num_experts", "num_local_experts"))
_DEEPSEEK_ATTRS = (("top_k", "num_experts_per_tok"), ("num_experts", "n_routed_experts"),
                   ("norm_topk_prob", "norm_topk_prob"),
                   ("routed_scaling_factor", "routed_scaling_factor"),
                   ("num_group", "n_group"), ("topk_group", "topk_group"))
_EXAONE_ATTRS = (("top_k", "num_experts_per_tok"), ("num_experts", "num_experts"),
                 ("norm_topk_prob", "norm_topk_prob"),
                 ("routed_scaling_factor", "routed_scaling_factor"),
                 ("num_group", "n_group"), ("topk_group", "topk_group"))


def _qwen2_like(model_type, block_class):          # softmax router, gated shared expert
    return Family(model_type, block_class, "num_experts", "moe_intermediate_size",
                  _softmax_rounded, shared="shared_expert", shared_gate="shared_expert_gate",
                  router_attrs=_QWEN_ATTRS)


def _olmoe_like(model_type, block_class):          # softmax router, F = intermediate_size
    return Family(model_type, block_class, "num_experts", "intermediate_size", _softmax_rounded,
                  router_attrs=_QWEN_ATTRS)


def _mixtral_like(model_type, block_class):
    return Family(model_type, block_class, "num_local_experts", "intermediate_size", _mixtral,
                  router_attrs=_MIXTRAL_ATTRS, jitter=True)


def _deepseek_like(model_type, block_class, package=None):   # noaux_tc router, shared experts
    return Family(model_type, block_class, "n_routed_experts", "moe_intermediate_size",
                  _deepseek_v3, shared="shared_experts", router_attrs=_DEEPSEEK_ATTRS,
                  biased_groups=True, score_bias="gate.e_score_correction_bias", package=package)


FAMILIES = (
    _qwen2_like("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
    Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", "num_experts", "moe_intermediate_size",
           _softmax_rounded, router_attrs=_QWEN_ATTRS),
    _mixtral_like("mixtral", "MixtralSparseMoeBlock"),
    _olmoe_like("olmoe", "OlmoeSparseMoeBlock"),
    _deepseek_like("deepseek_v3", "DeepseekV3MoE"),
    # the same block, router, experts and MLP code as the family above them
    _qwen2_like("qwen3_next", "Qwen3NextSparseMoeBlock"),          # Qwen3-Next
    _mixtral_like("minimax", "MiniMaxSparseMoeBlock"),              # MiniMax-Text-01
    _olmoe_like("flex_olmo", "FlexOlmoSparseMoeBlock"),             # FlexOlmo
    _deepseek_like("glm4_moe", "Glm4MoeMoE"),                       # GLM-4.5 / 4.6
    _deepseek_like("dots1", "Dots1MoE"),                            # dots.llm1
    _deepseek_like("deepseek_v32", "DeepseekV32MoE"),               # DeepSeek-V3.2
    _deepseek_like("glm4_moe_lite", "Glm4MoeLiteMoE"),              # GLM-4.7-Flash
    # the text models of multimodal checkpoints (their text config's model_type)
    _deepseek_like("glm4v_moe_text", "Glm4vMoeTextMoE", "glm4v_moe"),   # GLM-4.5V
    # Mixtral's experts under a biased sigmoid router (the bias a buffer of the block)
    Family("minimax_m2", "MiniMaxM2SparseMoeBlock", "num_local_experts", "intermediate_size",
           _minimax_m2, router_attrs=_MIXTRAL_ATTRS, score_bias="e_score_correction_bias",
           jitter=True),                                            # MiniMax-M2
    # DeepSeek-V3's router and experts in its own code, E from num_experts
    Family("exaone_moe", "ExaoneMoeSparseMoEBlock", "num_experts", "moe_intermediate_size",
           _deepseek_v3, shared="shared_experts",
           router_attrs=_EXAONE_ATTRS, biased_groups=True,
           score_bias="gate.e_score_correction_bias"),                     # K-EXAONE
    # Qwen3-Next's block whose router always renormalises (mapped on its own, not by table)
    Family("qwen3_5_moe_text", "Qwen3_5MoeSparseMoeBlock", "num_experts", "moe_intermediate_size",
           _softmax_rounded_renorm, shared="shared_expert", shared_gate="shared_expert_gate",
           router_attrs=_QWEN3_5_ATTRS,
           package="qwen3_5_moe"),                                  # Qwen3.5-MoE
    # biased experts, clamped SwiGLU, interleaved transposed gate/up, biased top-k-first router
    Family("gpt_oss", "GptOssMLP", "num_local_experts", "intermediate_size", _gpt_oss,
           router_attrs=_MIXTRAL_ATTRS, layout="gpt_oss", router_name="router"),   # gpt-oss
)
_BY_CLASS = {(f.module, f.block_class): f for f in FAMILIES}
FAMILIES_BY_TYPE = {f.model_type: f for f in FAMILIES}


def family_of(module: nn.Module) -> Optional[Family]:
    """The supported family whose sparse-MoE block class ``module`` is exactly (a subclass may
    change the forward, so it does not count), or None."""
    t = type(module)
    return _BY_CLASS.get((t.__module__, t.__name__))


def router_args(config) -> dict:
    """The ``MoEArgs`` router fields (num_experts, top_k and every option of the built-in
    ``Router``) that reproduce the HF router of ``config.model_type``."""
    if (getattr(config, "model_type", None) not in FAMILIES_BY_TYPE
            and hasattr(config, "get_text_config")):
        config = config.get_text_config()              # a multimodal model's config
    fam = FAMILIES_BY_TYPE.get(getattr(config, "model_type", None))
    if fam is None:
        raise NotImplementedError(f"no MoonEP router for model_type="
                                  f"{getattr(config, 'model_type', None)!r} (supported: "
                                  f"{sorted(FAMILIES_BY_TYPE)})")
    return dict(num_experts=int(getattr(config, fam.experts_field)),
                top_k=int(config.num_experts_per_tok), **fam.router(config))
