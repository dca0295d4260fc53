"""Converting a transformers model in place: validation of every block, the converted block
(``MoonEPBlock``), the router-logit hand-off to transformers' output collector, and the
unconverted state dict gathered back (``full_state_dict``)."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers.utils import output_capturing as _capture

from ...geometry import slack_to_ppm
from ...nn.moe import MoEArgs, MoonEPMoE, bind_moe, check_precision
from ...ops.swiglu import check_activation
from ...planner import POLICIES
from .families import FAMILIES, Family, family_of, router_args

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


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
    metas = {t.is_meta for t in tensors}
    if len(metas) > 1:
        raise ValueError(f"{where}: some of the block's tensors are on the meta device and some "
                         "are not; build the model wholly on the meta device (then "
                         "hf.load_pretrained fills it) or wholly materialised")
    _check_experts_code(where, block, ex, fam, config)
    if fam.jitter and float(getattr(block, "jitter_noise", 0.0)) > 0:
        raise NotImplementedError(
            f"{where}: router_jitter_noise={block.jitter_noise} > 0 -- the block then multiplies "
            "the hidden states by random noise in training, which no conversion reproduces")
    router = getattr(block, fam.router_name)
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
    fused = fam.layout == "fused"
    if gu.dim() != 3 or gu.shape[1 if fused else 2] % 2:
        raise NotImplementedError(f"{where}: experts.gate_up_proj has shape {tuple(gu.shape)}, "
                                  f"expected {'[E, 2F, D]' if fused else '[E, D, 2F]'}")
    F, D = (gu.shape[1] // 2, gu.shape[2]) if fused else (gu.shape[2] // 2, gu.shape[1])
    want = ({"experts.gate_up_proj": (E, 2 * F, D), "experts.down_proj": (E, D, F),
             "gate.weight": (E, D)} if fused else
            {"experts.gate_up_proj": (E, D, 2 * F), "experts.gate_up_proj_bias": (E, 2 * F),
             "experts.down_proj": (E, F, D), "experts.down_proj_bias": (E, D),
             "router.weight": (E, D), "router.bias": (E,)})
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


def _check_experts_code(where: str, block: nn.Module, ex: nn.Module, fam: Family, config) -> None:
    """The experts compute what MoonEP's do: layout "fused", SwiGLU (act(gate) * up, act = SiLU,
    no biases, [gate; up] rows); layout "gpt_oss", transformers' own GptOssExperts (biases, the
    clamped SwiGLU with the alpha and limit it holds, which must be valid)."""
    if fam.layout == "gpt_oss":
        cls = type(ex)
        if (cls.__module__, cls.__name__) != (fam.module, "GptOssExperts"):
            raise NotImplementedError(f"{where}: experts are {cls.__module__}.{cls.__name__}, not "
                                      "transformers' GptOssExperts (another forward)")
        for attr, field in (("alpha", "swiglu_alpha"), ("limit", "swiglu_limit")):
            if getattr(ex, attr) != getattr(config, field):
                raise ValueError(f"{where}: the HF experts run with {attr}={getattr(ex, attr)!r} "
                                 f"but the config says {field}={getattr(config, field)!r}")
        check_activation("swiglu_clamped", ex.alpha, ex.limit)
        return
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
    "Ernie4_5_MoeSparseMoeBlock": "ERNIE-4.5-MoE renormalises the top-k weights with a clamp "
                                  "(min=norm_min) and rounds them to the model dtype before the "
                                  "experts, which the built-in Router does not reproduce",
    "HunYuanMoEV1Moe": "HunYuan-A13B's MoE uses its own module names and may give each layer "
                       "its own expert count and top-k (per-layer lists), which the conversion "
                       "does not map",
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
    """A converted HF sparse-MoE block: ``forward(hidden_states [batch, seqlen, D]) -> [batch,
    seqlen, D]`` like the block it replaces, computed by ``self.moe`` (a bound ``MoonEPMoE``).

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
        out = moe(hidden_states, topk_ids=ids_sK, topk_weights=w_sK)
        if self.family.layout == "gpt_oss":          # GptOssMLP returns the router scores too
            return out, w_sK.to(logits_sE.dtype)
        return out

    # -- weights in the HF layout ---------------------------------------------------------------
    def to_moe_keys(self, hf_state: dict[str, Tensor]) -> dict[str, Tensor]:
        """HF block keys (no prefix) -> ``self.moe`` keys; gate_up_proj splits into w1, w3."""
        out = {}
        for key, t in hf_state.items():
            out.update(zip(self._key_map[key], self.family.to_moe(key, t)))
        if f"{self.family.router_name}.weight" in hf_state and "router.expert_bias" not in out:
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
            t = self.family.to_hf(key, [full[t] for t in self._key_map[key]]).to(dtype)
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
           link_gbps: Optional[float], fp8: dict) -> MoonEPBlock:
    """An unbound MoonEPBlock on the meta device (no memory until bind); ``fp8``: precision and
    the FP8 options, MoEArgs' names."""
    fam = c.family
    args = MoEArgs(**router_args(c.config), num_shared_experts=1 if fam.shared else 0,
                   shared_hidden_dim=c.Fs, shared_gate=fam.shared_gate is not None,
                   capacity=capacity, token_padding=token_padding, policy=policy, slack=slack,
                   link_gbps=link_gbps, **fp8, **fam.expert_args(c.config, c.block.experts))
    moe = MoonEPMoE(args, c.D, c.F, dtype=c.dtype, device="meta")
    layout = tuple((k, tuple(t.shape), t.dtype) for k, t in c.block.state_dict().items())
    return MoonEPBlock(moe, fam, layout)


@torch.no_grad()
def _load_block(layer: MoonEPBlock, block: nn.Module) -> None:
    """Copy the HF block's weights into the bound layer (this rank's experts only); a block on
    the meta device has none to copy (``hf.load_pretrained`` fills the layer later)."""
    if not getattr(block, layer.family.router_name).weight.is_meta:
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
                  fp8_pow2_scales: bool = False, fp8_weight_cache: bool = False,
                  fp8_wgrad: bool = False, device=None) -> nn.Module:
    """Replace every supported sparse-MoE block of ``model`` by a ``MoonEPBlock``, in place.

    Collective over ``group`` (None: the default group when torch.distributed is initialised,
    else one rank): every rank calls it on the same model.  Rank r keeps experts
    ``r*E/R .. (r+1)*E/R - 1`` of each block; the converted layers share Buffers (``bind_moe``:
    one per distinct setting).

    The model is either materialised (every rank the same full weights: each keeps its slice)
    or built on the meta device (``with torch.device("meta"): AutoModelForCausalLM.from_config
    (cfg)``, the at-scale recipe): then each rank allocates only its E/R home experts per block
    (uninitialised), the blocks' routers and shared experts, the Buffer and the slot pool, on
    ``device``; every other parameter stays on the meta device until ``hf.load_pretrained``
    (or FSDP2 and ``to_empty``) materialises it.  ``device="meta"`` allocates nothing at all
    (a shape-only model for memory planning: ``python -m moonep_ops.integrations.hf.memory``).

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
      fp8_weight_cache (precision "fp8" only, like fp8_wgrad; ValueError otherwise): each layer
        keeps its home experts' e4m3 weights in both layouts (``block.moe.fp8_cache``, an
        FP8WeightCache of ``cache_nbytes(E/R, F, D)`` bytes: the bf16 experts' size again,
        6 (E/R) D F), re-quantised only when a parameter changes (its version counter), so the
        micro-batches of an accumulated step quantise no weight.  Eager and compiled steps need
        nothing more; a CUDA-graph replay reads the cache only when it is refreshed after each
        update: ``moonep_ops.nn.moe.attach_fp8_weight_caches(model, optimizer)`` (a step
        post-hook per layer), else the graph re-quantises on every replay (docs/fp8.md).
      fp8_wgrad: the three expert weight grads in FP8 too (DeepSeek-V3's Wgrad; not with
        gpt-oss's biases and clamped SwiGLU).  Both off by default: what pays, docs/fp8.md.
        Every rank of the group passes the same precision and FP8 options (bind compares
        precision and fp8_pow2_scales over the group).
      device: where a meta-built model's kept parts are allocated (None: the Buffer's default,
        the current GPU for an NCCL group, else the CPU).  A materialised model's blocks stay
        on their device; a different ``device`` is refused.

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
    # the layers' own check (again when each is built, with its dtype and sizes): bad options
    # raise here, before any block is validated or built
    check_precision(precision, fp8_pow2_scales, torch.bfloat16, 16, 16, fp8_weight_cache,
                    fp8_wgrad)
    fp8 = dict(precision=precision, fp8_pow2_scales=fp8_pow2_scales,
               fp8_weight_cache=fp8_weight_cache, fp8_wgrad=fp8_wgrad)
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
    here = devices.pop()
    if here.type != "meta":
        if device is not None and torch.device(device) != here:
            raise ValueError(f"device={device} was given but the model's blocks are materialised "
                             f"on {here}; move the model, or build it on the meta device")
        device = here

    layers = [_build(c, capacity, token_padding, policy, slack, link_gbps, fp8) for c in todo]
    try:
        bind_moe(nn.ModuleList(layers), group=group, device=device)   # collective
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
    """Names of the converted model's expert weights (``<block>.moe.w1/w3/w2``, and ``b1/b3/b2``
    with expert biases): their grads already
    sum every rank's contribution, so data parallelism must not reduce them again, e.g.
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)``."""
    return [f"{name}.moe.{w}" for name, b in converted_blocks(model).items()
            for w in b.moe.expert_params]


__all__ = ["MoonEPBlock", "convert_model", "converted_blocks", "expert_parameter_names",
           "full_state_dict"]
