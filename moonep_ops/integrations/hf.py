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
always renormalising), MiniMax-M2 (Mixtral's experts, a biased sigmoid router) and K-EXAONE
(DeepSeek-V3's router in its own code) (``FAMILIES``). Each becomes a ``MoonEPBlock``: the HF
block's forward signature and return value (``[B, T, D] -> [B, T, D]``) around a
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
logits ``[B*T, E]`` (not detached) to transformers' output collector, as the HF router's capturing
hook does: exactly one record per sparse layer per forward, in eager mode and under
``torch.compile(model)``.  A converted block compiled on its own (not inside the compiled model)
cannot see the collector without a graph break; it raises if recording is requested there.

docs/integrations.md has the whole story: how each family maps onto the Router's options, what is
refused and why, the checkpoint round trip.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
import transformers
from torch import Tensor, nn
from transformers.utils import output_capturing as _capture

from ..geometry import slack_to_ppm
from ..nn.moe import MoEArgs, MoonEPMoE, bind_moe
from ..planner import POLICIES

TESTED_TRANSFORMERS = "5.24"
if not transformers.__version__.startswith(TESTED_TRANSFORMERS + "."):
    warnings.warn(f"moonep_ops.integrations.hf was written against transformers "
                  f"{TESTED_TRANSFORMERS}.x (block classes, weight layouts, the output collector); "
                  f"found {transformers.__version__}", UserWarning, stacklevel=2)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------
# Families: which HF block, which config fields, which router
# ---------------------------------------------------------------------------------------------


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
    has its own type, e.g. ``glm4v_moe_text`` in ``glm4v_moe``).  A family is added
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

    @property
    def module(self) -> str:
        pkg = self.package or self.model_type
        return f"transformers.models.{pkg}.modeling_{pkg}"

    def key_map(self) -> dict[str, tuple[str, ...]]:
        """HF block state-dict key -> the MoonEPMoE key(s) it maps to (two: gate_up_proj is the
        concatenation [w1; w3] along dim 1)."""
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


# ---------------------------------------------------------------------------------------------
# Validation (every block, before any is converted)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Conversion:
    """One validated block and the sizes of its MoonEP layer."""
    name: str
    block: nn.Module
    family: Family
    config: object
    E: int
    K: int
    D: int
    F: int
    Fs: Optional[int]
    dtype: torch.dtype
    device: torch.device


def _is_dtensor(t: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:                                 # torch without distributed
        return False
    return isinstance(t, DTensor)


def _is_silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _check_block(name: str, block: nn.Module, fam: Family, R: int) -> _Conversion:
    cls = type(block).__name__
    where = f"{cls} at {name!r}"
    ex = block.experts
    config = getattr(ex, "config", None)               # set by HF's @use_experts_implementation
    if getattr(config, "model_type", None) != fam.model_type:
        raise NotImplementedError(f"{where}: its experts module carries no {fam.model_type} "
                                  "config (experts.config); not a transformers 5.x block")
    # Already sharded by transformers' own tensor / expert parallelism: we would see a shard.
    for pname, p in block.named_parameters():
        if _is_dtensor(p):
            raise NotImplementedError(
                f"{where}: parameter {pname} is a DTensor -- the model is already sharded by "
                f"transformers (distributed_config={getattr(config, 'distributed_config', None)!r}"
                "); convert the unsharded model")
    if getattr(ex, "_is_expert_parallel", False):
        raise NotImplementedError(f"{where}: the experts are already expert-parallel in "
                                  "transformers (experts._is_expert_parallel=True, distributed_"
                                  f"config={getattr(config, 'distributed_config', None)!r})")
    tensors = list(block.state_dict().values())
    if any(t.is_meta for t in tensors):
        raise ValueError(f"{where}: the block has meta tensors; materialise the model (load its "
                         "weights) before converting it")
    # The MoonEP experts are SwiGLU: act(gate) * up with act = SiLU, no biases, [gate; up] rows.
    acts = [ex.act_fn] + ([getattr(block, fam.shared).act_fn] if fam.shared else [])
    if not all(_is_silu(a) for a in acts):
        raise NotImplementedError(
            f"{where}: hidden_act={getattr(config, 'hidden_act', None)!r} is not SiLU; MoonEP's "
            "experts are SwiGLU (silu(gate) * up)")
    layout = dict(has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True,
                  has_post_expert_norm=False)
    for flag, want in layout.items():
        if getattr(ex, flag, want) != want:
            raise NotImplementedError(f"{where}: experts.{flag}={getattr(ex, flag)!r}; MoonEP "
                                      f"converts {layout}")
    gate_fn = getattr(type(ex), "_apply_gate", None)
    if gate_fn is not None and getattr(gate_fn, "__name__", "") != "_default_apply_gate":
        raise NotImplementedError(f"{where}: {type(ex).__name__} overrides _apply_gate (not "
                                  "act(gate) * up)")
    if fam.jitter and float(getattr(block, "jitter_noise", 0.0)) > 0:
        raise NotImplementedError(
            f"{where}: router_jitter_noise={block.jitter_noise} > 0 -- the block then multiplies "
            "the hidden states by random noise in training, which no conversion reproduces")
    router = block.gate
    for attr, field in fam.router_attrs:
        if getattr(router, attr) != getattr(config, field):
            raise ValueError(f"{where}: the HF router runs with {attr}={getattr(router, attr)!r} "
                             f"but its config says {field}={getattr(config, field)!r} (edited "
                             "after the model was built?); make them agree")
    if fam.biased_groups:
        _check_deepseek_groups(where, config, fam.experts_field)
    keys = fam.key_map()
    if set(block.state_dict()) != set(keys):
        raise NotImplementedError(f"{where}: state-dict keys {sorted(block.state_dict())}, "
                                  f"expected {sorted(keys)} (another transformers version?)")
    gu = ex.gate_up_proj
    E, K = int(getattr(config, fam.experts_field)), int(config.num_experts_per_tok)
    if gu.dim() != 3 or gu.shape[1] % 2:
        raise NotImplementedError(f"{where}: experts.gate_up_proj has shape {tuple(gu.shape)}, "
                                  "expected [E, 2F, D]")
    _, F2, D = gu.shape
    F = F2 // 2
    want = {"experts.gate_up_proj": (E, 2 * F, D), "experts.down_proj": (E, D, F),
            "gate.weight": (E, D)}
    for key, shape in want.items():
        got = tuple(block.get_parameter(key).shape)
        if got != shape:
            raise NotImplementedError(f"{where}: {key} has shape {got}, expected {shape} "
                                      f"({fam.experts_field}={E}, {fam.ffn_field}={F}, "
                                      f"hidden_size={D})")
    if not 1 <= K <= E:
        raise NotImplementedError(f"{where}: num_experts_per_tok={K} must lie in [1, "
                                  f"{fam.experts_field}={E}]")
    dtype = gu.dtype
    if dtype not in _DTYPES:
        raise NotImplementedError(f"{where}: experts in {dtype}; MoonEP takes {_DTYPES}")
    for pname, p in block.named_parameters():
        if pname.startswith("gate.") and fam.biased_groups:
            continue                                    # an fp32 router in any model: fine
        if p.dtype != dtype:
            raise NotImplementedError(f"{where}: {pname} is {p.dtype} but the experts are "
                                      f"{dtype}; MoonEP runs the block in one dtype")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{where}: the block's tensors lie on several devices {devices}")
    if E % R:
        raise ValueError(f"{where}: {fam.experts_field}={E} is not divisible by the EP group "
                         f"size R={R} (each rank owns E/R experts)")
    Fs = getattr(block, fam.shared).gate_proj.weight.shape[0] if fam.shared else None
    return _Conversion(name, block, fam, config, E, K, D, F, Fs, dtype, devices.pop())


def _check_deepseek_groups(where: str, config, experts_field: str) -> None:
    E, K = getattr(config, experts_field), config.num_experts_per_tok
    G, Gk = config.n_group, config.topk_group
    if not (isinstance(G, int) and isinstance(Gk, int)) or not 1 <= Gk <= G:
        raise NotImplementedError(f"{where}: n_group={G!r}, topk_group={Gk!r}: need ints with "
                                  "1 <= topk_group <= n_group")
    if E % G or E // G < 2:
        raise NotImplementedError(f"{where}: {experts_field}={E} must split into n_group={G} "
                                  "groups of at least 2 experts (the group score sums a top-2)")
    if Gk * (E // G) < K:
        raise NotImplementedError(
            f"{where}: topk_group={Gk} * {experts_field}={E} / n_group={G} = {Gk * (E // G)} "
            f"< num_experts_per_tok={K}: HF would pick masked (-inf) experts")


_UNSUPPORTED_WHY = {
    "Qwen3VLMoeTextSparseMoeBlock": "Qwen3-VL-MoE's checkpoints store the experts transposed, and "
                                    "transformers' save_pretrained reverts that by reading the "
                                    "live experts' parameter shapes, which a converted block no "
                                    "longer has (so its checkpoints would not round-trip)",
    "GptOssMLP": "gpt-oss (model_type='gpt_oss') has per-expert biases, a clamped (up + 1) SwiGLU "
                 "with alpha 1.702 (swiglu_limit), transposed interleaved gate/up weights and "
                 "MXFP4 checkpoints, which the MoonEP experts do not implement",
}


def _unsupported(name: str, module: nn.Module) -> Optional[str]:
    """A message if ``module`` looks like a sparse-MoE block (an ``experts`` child) of a family
    this integration does not convert, else None."""
    if family_of(module) is not None or isinstance(module, MoonEPBlock):
        return None
    if not isinstance(getattr(module, "experts", None), nn.Module):
        return None
    cls = type(module)
    config = getattr(module.experts, "config", None)
    why = _UNSUPPORTED_WHY.get(cls.__name__, "not one of the supported sparse-MoE blocks")
    return (f"{cls.__module__}.{cls.__name__} at {name!r} (model_type="
            f"{getattr(config, 'model_type', None)!r}): {why}; supported: "
            f"{[f.block_class for f in FAMILIES]}")


def _group_size(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 1
    return dist.get_world_size(group)


def _check_positive_int(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


# ---------------------------------------------------------------------------------------------
# Router logits -> transformers' output collector
# ---------------------------------------------------------------------------------------------


def _recording(collected) -> bool:
    return collected is not None and "router_logits" in collected


@torch.library.custom_op("moonep_hf::unrecorded_routing", mutates_args=())
def _unrecorded_routing(w_sK: Tensor) -> Tensor:
    """A copy of the routing weights, or an error if transformers is recording router logits:
    a block compiled on its own runs this at run time (the collector is a ContextVar that a graph
    cannot read), so requesting the logits there fails loudly instead of losing records."""
    if _recording(_capture._active_collector.get()):
        raise RuntimeError("output_router_logits was requested, but this MoonEP block was compiled "
                           "on its own: the router logits cannot reach transformers' collector "
                           "from inside it.  Compile the whole model (torch.compile(model)) or run "
                           "the block eagerly")
    return w_sK.clone()


@_unrecorded_routing.register_fake
def _(w_sK: Tensor) -> Tensor:
    return torch.empty_like(w_sK)


_unrecorded_routing.register_autograd(lambda ctx, grad: grad)


def _emit_router_logits(logits_sE: Tensor, w_sK: Tensor) -> Tensor:
    """Append the logits to transformers' ``router_logits`` collector when the model records them
    (what the HF router's output-capturing hook does); returns the routing weights to use.

    transformers keeps the collector in a ContextVar, or, when its ``capture_outputs`` wrapper runs
    under torch.compile, in a plain attribute (``compiling``).  Eagerly and inside a compiled model
    we append as the hook does; a block compiled on its own goes through ``_unrecorded_routing``."""
    var = _capture._active_collector
    if torch.compiler.is_compiling() and not var.compiling:
        return torch.ops.moonep_hf.unrecorded_routing(w_sK)
    collected = var.get()
    if _recording(collected):
        collected["router_logits"].append(logits_sE)
    return w_sK


# ---------------------------------------------------------------------------------------------
# The converted block
# ---------------------------------------------------------------------------------------------


class MoonEPBlock(nn.Module):
    """A converted HF sparse-MoE block: ``forward(hidden_states [B, T, D]) -> [B, T, D]`` like the
    block it replaces, computed by ``self.moe`` (a bound ``MoonEPMoE``).

    ``hf_class``: the replaced class; ``hf_layout``: its ``state_dict()`` keys, shapes and dtypes,
    in order (what ``hf_state_dict`` reproduces).  ``load_state_dict`` takes either this module's
    own keys (``moe.*``, local or full experts) or the HF block's keys (full or local experts)."""

    def __init__(self, moe: MoonEPMoE, family: Family, hf_layout: tuple):
        super().__init__()
        self.moe = moe
        self.family = family
        self.hf_class = f"{family.module}.{family.block_class}"
        self.hf_layout = hf_layout                      # ((key, shape, dtype), ...)
        self._key_map = family.key_map()
        self.register_load_state_dict_pre_hook(self._from_hf_keys)

    def forward(self, hidden_states: Tensor) -> Tensor:
        moe = self.moe
        if hidden_states.dim() < 2 or hidden_states.shape[-1] != moe.dim:
            raise ValueError(f"{type(self).__name__} expects hidden states [..., D={moe.dim}], got "
                             f"{tuple(hidden_states.shape)}")
        ids_sK, w_sK, logits_sE = moe.router(hidden_states.reshape(-1, moe.dim))
        w_sK = _emit_router_logits(logits_sE, w_sK)
        return moe(hidden_states, topk_ids=ids_sK, topk_weights=w_sK)

    # -- weights in the HF layout ---------------------------------------------------------------
    def to_moe_keys(self, hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
        """HF block keys (no prefix) -> ``self.moe`` keys; gate_up_proj splits into w1, w3."""
        out = {}
        for key, t in hf_state.items():
            targets = self._key_map[key]
            parts = (t,) if len(targets) == 1 else t.split(t.shape[1] // 2, dim=1)
            out.update(zip(targets, parts))
        if "gate.weight" in hf_state and "router.expert_bias" not in out:
            # families without a selection bias: the Router's stays zero (no Quantile Balancing)
            out["router.expert_bias"] = torch.zeros_like(self.moe.router.expert_bias)
        return out

    @torch.no_grad()
    def hf_state_dict(self, prefix: str = "") -> dict[str, Tensor]:
        """Collective over the EP group: the replaced block's ``state_dict()`` (same keys, order,
        shapes, dtypes), all experts gathered."""
        full = self.moe.full_state_dict()
        out = {}
        for key, shape, dtype in self.hf_layout:
            parts = [full[t] for t in self._key_map[key]]
            t = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).to(dtype)
            if tuple(t.shape) != shape:
                raise RuntimeError(f"{prefix}{key}: rebuilt {tuple(t.shape)}, expected {shape}")
            out[prefix + key] = t
        return out

    def _from_hf_keys(self, module, state_dict, prefix, *args) -> None:
        hf = {k: state_dict.pop(prefix + k) for k in self._key_map if prefix + k in state_dict}
        for k, t in self.to_moe_keys(hf).items():
            state_dict[prefix + "moe." + k] = t

    def extra_repr(self) -> str:
        return f"replaces {self.family.block_class}"


def _build(c: _Conversion, capacity: int, token_padding: int, policy: str, slack: float,
           link_gbps: Optional[float], precision: str, fp8_pow2_scales: bool) -> MoonEPBlock:
    """An unbound MoonEPBlock on the meta device (no memory until bind)."""
    fam = c.family
    args = MoEArgs(**router_args(c.config), num_shared_experts=1 if fam.shared else 0,
                   shared_hidden_dim=c.Fs, shared_gate=fam.shared_gate is not None,
                   capacity=capacity, token_padding=token_padding, policy=policy, slack=slack,
                   link_gbps=link_gbps, precision=precision, fp8_pow2_scales=fp8_pow2_scales)
    moe = MoonEPMoE(args, c.D, c.F, dtype=c.dtype, device="meta")
    layout = tuple((k, tuple(t.shape), t.dtype) for k, t in c.block.state_dict().items())
    return MoonEPBlock(moe, fam, layout)


@torch.no_grad()
def _load_block(layer: MoonEPBlock, block: nn.Module) -> None:
    """Copy the HF block's weights into the bound layer (this rank's experts only)."""
    layer.moe.load_state_dict(layer.to_moe_keys(block.state_dict()), strict=True)
    params = dict(layer.moe.named_parameters())
    for key, p in block.named_parameters():
        for target in layer._key_map[key]:
            params[target].requires_grad_(p.requires_grad)
    layer.train(block.training)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def convert_model(model: nn.Module, *, group: Optional[dist.ProcessGroup] = None, capacity: int,
                  token_padding: int = 128, policy: str = "moonep", slack: float = 0.0,
                  link_gbps: Optional[float] = None, precision: str = "bf16",
                  fp8_pow2_scales: bool = False) -> nn.Module:
    """Replace every supported sparse-MoE block of ``model`` by a ``MoonEPBlock``, in place.

    Collective over ``group`` (None: the default group when torch.distributed is initialised,
    else one rank): every rank calls it on the same model (the same full weights).  Rank r keeps
    experts ``r*E/R .. (r+1)*E/R - 1`` of each block; the converted layers share Buffers
    (``bind_moe``: one per distinct setting).

    Args:
      capacity: S, the most tokens a rank passes to one forward (B*T of its batch); every rank
        of the group must pass the same number of tokens per forward; more than S raises
        ValueError.
      token_padding: alignment of the receive buffer's expert segments (128 suits the CUDA
        grouped GEMM; any positive int on the CPU).
      policy: planner policy, one of ``moonep_ops.POLICIES``.
      slack, link_gbps: policy "cost"'s cap slack eps and link bandwidth (``Buffer``'s
        arguments; each block's FFN dim is the cost model's F).
      precision: the routed experts' precision, "bf16" (default) or "fp8" (the DeepSeek-V3 FP8
        recipe, docs/fp8.md: a bf16 model whose hidden and expert FFN sizes are multiples of
        16); fp8_pow2_scales: power-of-two FP8 scales.

    Every block is validated before any is converted: an unsupported block or option raises
    NotImplementedError (bad arguments: ValueError) naming the block class and the config field,
    and leaves the model unchanged.  A model without a sparse-MoE block is returned unchanged,
    with a UserWarning.  Returns ``model``.
    """
    _check_positive_int("capacity", capacity)
    _check_positive_int("token_padding", token_padding)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if slack_to_ppm(slack) and policy != "cost":
        raise ValueError(f"slack is a setting of policy 'cost', got policy {policy!r}")
    if link_gbps is not None and policy != "cost":
        raise ValueError(f"link_gbps is a setting of policy 'cost', got policy {policy!r}")
    if family_of(model) is not None or isinstance(model, MoonEPBlock):
        raise ValueError(f"convert_model takes the model that contains the sparse-MoE blocks, "
                         f"not a block ({type(model).__name__})")
    R = _group_size(group)
    todo = []
    for name, module in model.named_modules():
        fam = family_of(module)
        if fam is not None:
            todo.append(_check_block(name, module, fam, R))
            continue
        why = _unsupported(name, module)
        if why is not None:
            raise NotImplementedError(why)
    if not todo:
        if any(isinstance(m, MoonEPBlock) for m in model.modules()):
            why = "no unconverted sparse-MoE block (already converted)"
        else:
            why = f"no sparse-MoE block (supported: {[f.block_class for f in FAMILIES]})"
        warnings.warn(f"convert_model: {type(model).__name__} has {why}; returned unchanged",
                      UserWarning, stacklevel=2)
        return model
    devices = {c.device for c in todo}
    if len(devices) != 1:
        raise ValueError(f"the sparse-MoE blocks lie on several devices {devices}; MoonEP "
                         "converts a model whose blocks share one device")

    layers = [_build(c, capacity, token_padding, policy, slack, link_gbps, precision,
                     fp8_pow2_scales) for c in todo]
    try:
        bind_moe(nn.ModuleList(layers), group=group, device=devices.pop())   # collective
        for layer, c in zip(layers, todo):
            _load_block(layer, c.block)
    except BaseException:
        for layer in layers:                            # the model is still untouched
            if layer.moe.buffer is not None:
                layer.moe.buffer.destroy()
        raise
    for layer, c in zip(layers, todo):
        parent_name, _, attr = c.name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, layer)
    return model


def converted_blocks(model: nn.Module) -> dict[str, MoonEPBlock]:
    """{qualified name: MoonEPBlock} of a converted model, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoonEPBlock)}


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Collective over the EP group (every rank calls it): the state dict of the unconverted
    model -- its keys in its order, buffers included, the same shapes, dtypes and values, every
    expert gathered -- on every rank.  ``model.save_pretrained(path, state_dict=...)`` writes a
    checkpoint plain transformers loads, and a fresh HF model ``load_state_dict(..., strict=True)``
    takes it."""
    blocks = converted_blocks(model)
    out: dict[str, Tensor] = {}
    done = set()
    for key, t in model.state_dict().items():
        parts = key.split(".")
        owner = next((p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1))
                      if p in blocks), None)
        if owner is None:
            out[key] = t
        elif owner not in done:
            done.add(owner)
            out.update(blocks[owner].hf_state_dict(prefix=owner + "."))
    return out


def expert_parameter_names(model: nn.Module) -> list[str]:
    """Names of the converted model's expert weights (``<block>.moe.w1/w3/w2``): their grads already
    sum every rank's contribution, so data parallelism must not reduce them again, e.g.
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)``."""
    return [f"{name}.moe.{w}" for name in converted_blocks(model) for w in ("w1", "w3", "w2")]


__all__ = ["FAMILIES", "Family", "MoonEPBlock", "convert_model", "converted_blocks",
           "expert_parameter_names", "family_of", "full_state_dict", "router_args"]
