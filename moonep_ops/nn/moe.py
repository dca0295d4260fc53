"""The MoonEP MoE layer: router -> dispatch -> routed SwiGLU experts -> combine, which applies
the route weights (+ shared experts).

    layer = MoonEPMoE(MoEArgs(num_experts=E, top_k=K, capacity=S, ...), dim=D, hidden_dim=F)
    layer.bind(group=pg)            # or bind_moe(model, group=pg, capacity=S), or lazily
    y = layer(x)                    # x [..., D] -> [..., D]

  ids_sK, w_sK, logits_sE = router(x_sD)                            fp32 weights
  h_MD, w_M, cu_G, plan   = buffer.dispatch(x_sD, ids_sK, w_sK)     exactly the cap of rows real
  y_MD                    = moonep::moe_experts(h_MD, cu_G, plan.experts_to_copy, w1, w3, w2)
  out_sD                  = buffer.combine(plan, y_MD, w_M, weighted=True)  sum_k fp32(y) * w
                            [+ sigmoid(gate(x)) * shared(x_sD)]

The layer knows nothing of parallelism until ``bind``: built, it holds all E experts (or none,
on the meta device); bound, it keeps this rank's home experts ``rank*B .. (rank+1)*B - 1``
(B = E/R) and a ``Buffer`` (shared by every layer of the model with the same settings:
``bind_moe``).  Expert weights (nn.Linear layout): w1 (gate) and w3 (up) [B, F, D], w2 (down)
[B, D, F]; the redundant slots live in the Buffer's ExpertPool (moonep_ops/ops/moe_experts.py,
with the backward and the memory formula).  The weight grads come back holding every rank's
contribution for the home experts.  The router and the shared experts are replicated like any
data-parallel parameter: all-reduce their grads over the EP group (``reduce_router_grad``) as
DDP/FSDP would.  Checkpoints: ``load_state_dict`` takes the experts as this rank's slice or as
the full [E, ...] tensors; ``full_state_dict()`` gathers them back.

On CUDA the shared experts run on a side stream, overlapping dispatch, the routed GEMMs and
combine (events only, no host sync; eager mode: torch.compile keeps one stream).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.functional import silu

from ..buffer import Buffer
from ..geometry import expert_settings, slack_to_ppm
from ..ops import moe_experts as _moe_experts  # registers moonep::moe_experts; its eager entry
from ..ops import moe_experts_fp8 as _moe_experts_fp8  # noqa: F401  (moonep::moe_experts_fp8)
from ..ops.fp8_weight_cache import FP8WeightCache
from ..ops.grouped_mm_fp8 import ALIGN as FP8_ALIGN
from ..ops.moe_experts import PRECISIONS
from ..ops.moe_experts_ext import check_variant, moe_experts_ext
from ..planner import POLICIES
from .router import Router


def check_precision(precision: str, pow2_scales: bool, dtype: torch.dtype, D: int, F: int,
                    weight_cache: bool = False, wgrad: bool = False) -> None:
    """A layer's expert precision, "bf16" (any dtype) or "fp8" (bf16, D and F multiples of 16:
    the FP8 kernels' 16-byte rows), and its FP8 options (bools; the last two need "fp8")."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    for name, v in (("fp8_pow2_scales", pow2_scales), ("fp8_weight_cache", weight_cache),
                    ("fp8_wgrad", wgrad)):
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    if precision != "fp8" and (weight_cache or wgrad):   # ignored, they would run another recipe
        raise ValueError(f"fp8_weight_cache={weight_cache} and fp8_wgrad={wgrad} are options of "
                         f"precision 'fp8', got precision={precision!r}")
    if precision != "fp8":
        return
    if dtype != torch.bfloat16:
        raise ValueError(f"precision='fp8' needs a bfloat16 layer (tokens, weights and outputs "
                         f"of the FP8 recipe are bf16), got dtype={dtype}")
    if D % FP8_ALIGN or F % FP8_ALIGN:
        raise ValueError(f"precision='fp8' needs D and F multiples of {FP8_ALIGN} (16-byte rows of "
                         f"e4m3 for the FP8 grouped GEMM); got D={D}, F={F}")


def routed_experts(buf: Buffer, pool_name: str, x_sD: Tensor, ids_sK: Tensor, w_sK: Tensor,
                   w1: Tensor, w3: Tensor, w2: Tensor, *, precision: str = "bf16",
                   pow2_scales: bool = False, total_num_tokens: Optional[int] = None,
                   weight_cache: str = "", fp8_wgrad: bool = False, biases: tuple = (),
                   activation: str = "swiglu", alpha: float = 1.0,
                   limit: float = 1.0) -> Tensor:
    """dispatch -> routed SwiGLU experts -> route weights -> combine, in one precision:
    ``[s, D]``, differentiable in x, the route weights and the experts.

    "bf16": Buffer.dispatch, moonep::moe_experts, combine applying the weights in fp32; with
    expert ``biases`` (b1, b3, b2) or another ``activation`` (gpt-oss's "swiglu_clamped", its
    ``alpha`` and ``limit``), moonep::moe_experts_ext, which applies the weights itself.
    "fp8": Buffer.dispatch_fp8 (e4m3 rows + scales), moonep::moe_experts_fp8 (which applies
    the weights and carries dispatch's transpose in its backward; biases and the activation
    passed on), combine."""
    variant = biases or activation != "swiglu"
    if precision == "fp8":
        h, hs, w_M, cu, plan = buf.dispatch_fp8(x_sD, ids_sK, w_sK,
                                                total_num_tokens=total_num_tokens,
                                                pow2_scales=pow2_scales)
        # positional: torch's custom-op autograd rejects its own grads for a list by keyword
        more = (list(biases), activation, alpha, limit) if variant else ()
        z, _, _, _ = torch.ops.moonep.moe_experts_fp8(h, hs, w_M, cu, plan.experts_to_copy, w1,
                                                      w3, w2, pool_name, x_sD, w_sK, plan.dst,
                                                      plan.total_num_tokens, pow2_scales,
                                                      weight_cache, fp8_wgrad, *more)
    else:
        h, w_M, cu, plan = buf.dispatch(x_sD, ids_sK, w_sK, total_num_tokens=total_num_tokens)
        if not x_sD.requires_grad:   # h's grad could reach only x: the experts skip its dgrads
            h = h.detach()
        if variant:
            z, _, _, _ = moe_experts_ext(h, w_M, cu, plan.experts_to_copy, w1, w3, w2,
                                         list(biases), pool_name, activation, alpha, limit)
        else:    # combine applies the weights: sum_k fp32(y) * w, one rounding, no z pass
            y, _, _ = _moe_experts.moe_experts(h, cu, plan.experts_to_copy, w1, w3, w2,
                                               pool_name)
            return buf.combine(plan, y, w_M, weighted=True)[0]
    out, _ = buf.combine(plan, z)
    return out


def check_backend_dims(device_type: str, dtype: torch.dtype, D: int, F: int) -> None:
    """Hidden sizes the grouped-GEMM backends take: CUDA bf16 rows must be 16-byte multiples
    (TMA / torch._grouped_mm alignment); the CPU reference takes any size."""
    if device_type == "cuda" and dtype == torch.bfloat16 and (D % 8 or F % 8):
        raise ValueError(f"CUDA grouped GEMMs need D and F multiples of 8 (16-byte rows); "
                         f"got D={D}, F={F}")


class SwiGLU(nn.Module):
    """Dense SwiGLU FFN (the shared expert)."""

    def __init__(self, dim: int, hidden: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False, dtype=dtype, device=device)
        self.w3 = nn.Linear(dim, hidden, bias=False, dtype=dtype, device=device)
        self.w2 = nn.Linear(hidden, dim, bias=False, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(silu(self.w1(x)) * self.w3(x))


@dataclass
class MoEArgs:
    """Everything about a MoE layer but its sizes (``MoonEPMoE(args, dim, hidden_dim)``).

    Routing (the built-in ``Router``; ignored when the layer is given a router):
      num_experts, top_k: E and K.
      score_func: "softmax" or "sigmoid".  topk_before_score: top-k on the logits, softmax over
      the K (gpt-oss).  route_norm: renormalise the K weights; route_norm_eps: added to the
      denominator (DeepSeek-V3 1e-20).  route_scale: factor on the weights (DeepSeek-V3
      routed_scaling_factor).  num_expert_groups / num_limited_groups: group-limited top-k
      (DeepSeek-V3 n_group / topk_group).  sorted_topk: the top-k's ``sorted`` flag.
      router_dtype: the gate's dtype (None: the layer's).  round_weights: round the weights to
      the logits' dtype (Qwen, OLMoE).  gate_bias: a bias on the gate.  balance_rate: Quantile
      Balancing step (0: off).
    Shared experts: num_shared_experts (0: none) of width shared_hidden_dim in total (default:
      num_shared_experts * hidden_dim); shared_gate: multiply their output by
      sigmoid(x @ shared_gate^T) (Qwen2-MoE).
    Expert parallelism (used when the layer binds its own Buffer; see ``MoonEPMoE.bind``):
      capacity: S, the most tokens one rank passes to one forward (s = product of the input's
      leading dims).  token_padding: segment alignment of the receive buffer (128 suits the CUDA
      grouped GEMM's tiles).  policy: planner policy.  slack, link_gbps: policy "cost"'s cap
      slack eps and link bandwidth (the Buffer's arguments; the layer's hidden_dim is the cost
      model's F).  backend: data-plane backend.
      side_stream: run the shared experts on a side stream on CUDA (eager mode).
    Routed experts (gpt-oss; moonep_ops/ops/moe_experts_ext.py):
      expert_bias: biases on the gate, up and down projections (parameters b1, b3 [E, F] and
      b2 [E, D] beside w1, w3, w2, sharded, prefetched into the slots and reduced home with
      them).  activation: "swiglu" (silu(gate) * up) or "swiglu_clamped", gpt-oss's:
      gate = min(gate, swiglu_limit), up = clamp(up, -swiglu_limit, swiglu_limit),
      (up + 1) * gate * sigmoid(swiglu_alpha * gate); swiglu_alpha and swiglu_limit are finite
      and > 0 (gpt-oss: 1.702 and 7.0); either runs in both precisions, not with fp8_wgrad.
    Expert precision (docs/fp8.md):
      precision: "bf16" (default) or "fp8", the DeepSeek-V3 recipe: tokens dispatched in e4m3
      with 1 x 128-tile scales, expert weights quantised per 128 x 128 block, the three expert
      GEMMs and their dgrads in FP8 with fp32 accumulation and bf16 outputs, weight grads in
      bf16, combine in bf16 with fp32 accumulation.  Needs a bf16 layer with D and F multiples
      of 16.  fp8_pow2_scales: round every scale up to a power of two.
      fp8_weight_cache: keep the home experts' e4m3 weights of both layouts in an FP8WeightCache
      (``layer.fp8_cache``; the bf16 experts' size), re-quantised only when the parameters
      change (version counters): micro-batches between optimizer steps quantise no weight
      (ops/fp8_weight_cache.py; CUDA-graph capture: ``attach_fp8_weight_caches(model,
      optimizer)`` or ``layer.refresh_fp8_weights()``).  fp8_wgrad: the three weight grads in
      FP8 too, both operands per 1 x 128 tile along each expert's tokens (DeepSeek-V3's Wgrad),
      bf16 out.  Both need precision "fp8" (else ValueError); defaults: what pays (docs/fp8.md).
    """

    num_experts: int = 8
    top_k: int = 2
    score_func: str = "softmax"
    topk_before_score: bool = False
    route_norm: bool = False
    route_norm_eps: float = 0.0
    route_scale: float = 1.0
    num_expert_groups: int = 1
    num_limited_groups: int = 1
    sorted_topk: bool = True
    router_dtype: Optional[torch.dtype] = torch.float32
    round_weights: bool = False
    gate_bias: bool = False
    balance_rate: float = 0.0
    num_shared_experts: int = 0
    shared_hidden_dim: Optional[int] = None
    shared_gate: bool = False
    capacity: Optional[int] = None
    token_padding: int = 1
    policy: str = "moonep"
    slack: float = 0.0
    link_gbps: Optional[float] = None
    backend: str = "auto"
    side_stream: bool = True
    precision: str = "bf16"
    fp8_pow2_scales: bool = False
    fp8_weight_cache: bool = False
    fp8_wgrad: bool = False
    expert_bias: bool = False
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def router_kwargs(self) -> dict:
        names = ("score_func", "topk_before_score", "route_norm", "route_norm_eps", "route_scale",
                 "num_expert_groups", "num_limited_groups", "sorted_topk", "router_dtype",
                 "round_weights", "gate_bias", "balance_rate")
        return {n: getattr(self, n) for n in names}

    def replace(self, **kw) -> "MoEArgs":
        return dataclasses.replace(self, **kw)


_EXPERT_PARAMS = ("w1", "w3", "w2")
_BIAS_PARAMS = ("b1", "b3", "b2")


class MoonEPMoE(nn.Module):
    """The MoonEP MoE layer (see the module docstring), built like torchtitan's
    ``MoE(moe_args, dim, hidden_dim)``: the model knows nothing of parallelism.

    Args:
      args: ``MoEArgs``.
      dim: model dim D.
      hidden_dim: expert FFN dim F.
      router: a module meeting the router contract (moonep_ops/nn/router.py); default: the
        built-in ``Router`` configured by ``args``.
      dtype: parameter and activation dtype of the experts (default: torch's default dtype).
      device: where the parameters are made; ``"meta"`` defers the memory to ``bind``.

    Until ``bind`` the layer holds all E experts (``w1, w3 [E, F, D]``, ``w2 [E, D, F]``);
    ``bind`` keeps this rank's home experts ``rank*B .. (rank+1)*B - 1`` (B = E/R) and attaches a
    ``Buffer``.  ``load_state_dict`` takes the experts either as this rank's ``[B, ...]`` slice or
    as the full ``[E, ...]`` tensors (keeping this rank's slice); ``full_state_dict()`` gathers
    them back (collective).
    """

    def __init__(self, args: MoEArgs, dim: int, hidden_dim: int, *, router: Optional[nn.Module] = None,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        if not isinstance(args, MoEArgs):
            raise TypeError(f"args must be a moonep_ops.nn.MoEArgs, got {type(args).__name__}")
        E, K = args.num_experts, args.top_k
        for name, v in (("dim", dim), ("hidden_dim", hidden_dim), ("num_experts", E),
                        ("top_k", K)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if K > E:
            raise ValueError(f"top_k={K} > num_experts={E}")
        if args.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {args.policy!r}")
        if slack_to_ppm(args.slack) and args.policy != "cost":
            raise ValueError(f"slack is a setting of policy 'cost', the layer's policy is "
                             f"{args.policy!r}")
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        check_precision(args.precision, args.fp8_pow2_scales, dtype, dim, hidden_dim,
                        args.fp8_weight_cache, args.fp8_wgrad)
        check_variant(args.expert_bias, args.activation, args.swiglu_alpha, args.swiglu_limit,
                      args.fp8_wgrad)
        self.args = args
        self.dim, self.hidden_dim, self.num_experts, self.top_k = dim, hidden_dim, E, K
        self.dtype = dtype
        self.router = router if router is not None else Router(
            dim, E, K, **args.router_kwargs(), dtype=dtype, device=device)
        self.w1 = nn.Parameter(torch.empty(E, hidden_dim, dim, dtype=dtype, device=device))
        self.w3 = nn.Parameter(torch.empty(E, hidden_dim, dim, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(E, dim, hidden_dim, dtype=dtype, device=device))
        self.expert_params = _EXPERT_PARAMS
        if args.expert_bias:
            self.b1 = nn.Parameter(torch.empty(E, hidden_dim, dtype=dtype, device=device))
            self.b3 = nn.Parameter(torch.empty(E, hidden_dim, dtype=dtype, device=device))
            self.b2 = nn.Parameter(torch.empty(E, dim, dtype=dtype, device=device))
            self.expert_params = _EXPERT_PARAMS + _BIAS_PARAMS
        self.shared = self.shared_gate = None
        if args.num_shared_experts:
            width = args.shared_hidden_dim or args.num_shared_experts * hidden_dim
            self.shared = SwiGLU(dim, width, dtype, device)
            if args.shared_gate:
                self.shared_gate = nn.Linear(dim, 1, bias=False, dtype=dtype, device=device)
        elif args.shared_gate:
            raise ValueError("shared_gate needs num_shared_experts >= 1")
        # EP state, set by bind (plain attributes, not submodules: traced through, not lifted)
        self.buffer: Optional[Buffer] = None
        self.fp8_cache: Optional[FP8WeightCache] = None   # bind: precision "fp8" with the cache
        self.expert_offset = 0          # global id of this rank's first home expert
        self._side = None
        self.last_logits: Optional[Tensor] = None
        self.register_load_state_dict_pre_hook(self._slice_full_experts)
        if torch.device(device if device is not None else "cpu").type != "meta":
            self.init_weights()

    @classmethod
    def for_buffer(cls, buffer: Buffer, hidden_dim: int, *, router: Optional[nn.Module] = None,
                   **args) -> "MoonEPMoE":
        """A layer bound to an existing Buffer: E, K, D, dtype and device come from the Buffer,
        ``args`` are the other MoEArgs fields.  Initialised with ``init_weights``; the same seed
        gives every rank the same full weights, of which each keeps its slice."""
        if not isinstance(buffer, Buffer):
            raise TypeError(f"buffer must be a moonep_ops.Buffer, got {type(buffer).__name__}")
        a = MoEArgs(num_experts=buffer.E, top_k=buffer.K, capacity=buffer.S,
                    token_padding=buffer.token_padding, policy=buffer.policy,
                    slack=buffer.slack, **args)
        layer = cls(a, buffer.D, hidden_dim, router=router, dtype=buffer.dtype)
        layer.bind(buffer)
        return layer

    # -- weights ------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, init_std: float = 0.02) -> None:
        """Normal(0, init_std) experts, gate and shared experts (the bias buffer is zeroed)."""
        for w in (self.w1, self.w3, self.w2):
            w.normal_(0.0, init_std)
        for b in self.biases():
            b.zero_()
        if isinstance(self.router, Router):
            self.router.gate.weight.normal_(0.0, init_std)
            if self.router.gate.bias is not None:
                self.router.gate.bias.zero_()
            self.router.expert_bias.zero_()
        for mod in (self.shared.w1, self.shared.w3, self.shared.w2) if self.shared else ():
            mod.weight.normal_(0.0, init_std)
        if self.shared_gate is not None:
            self.shared_gate.weight.normal_(0.0, init_std)

    def biases(self) -> tuple:
        """(b1, b3, b2) with MoEArgs.expert_bias, else ()."""
        return tuple(getattr(self, n) for n in self.expert_params[len(_EXPERT_PARAMS):])

    @property
    def num_local_experts(self) -> int:
        """Experts this layer holds: E before ``bind``, B = E/R after."""
        return self.w1.shape[0]

    def owned_experts(self) -> range:
        """Global ids of the experts this rank owns (its home experts)."""
        return range(self.expert_offset, self.expert_offset + self.num_local_experts)

    def _slice_full_experts(self, module, state_dict, prefix, *args) -> None:
        # A full [E, ...] checkpoint tensor becomes this rank's [B, ...] slice.
        B, E = self.num_local_experts, self.num_experts
        if B == E:
            return
        for name in self.expert_params:
            t = state_dict.get(prefix + name)
            if t is not None and t.dim() == getattr(self, name).dim() and t.shape[0] == E:
                state_dict[prefix + name] = t[self.expert_offset:self.expert_offset + B]

    @torch.no_grad()
    def full_state_dict(self, prefix: str = "") -> dict[str, Tensor]:
        """Collective over the layer's EP group: ``state_dict()`` with the experts gathered to
        their full ``[E, ...]`` shape (same keys, same order), on every rank."""
        sd = self.state_dict(prefix=prefix)
        for name in self.expert_params:
            sd[prefix + name] = self.gather_experts(getattr(self, name)).detach()
        return sd

    def gather_experts(self, w_B: Tensor) -> Tensor:
        """This rank's [B, ...] experts -> every rank's, concatenated in rank order [E, ...]."""
        if self.buffer is None or self.buffer.R == 1:
            return w_B.detach().clone()
        group = self.buffer.group
        if group is None:
            raise NotImplementedError("gathering experts needs a torch.distributed process group "
                                      "(virtual ranks have none)")
        parts = [torch.empty_like(w_B) for _ in range(self.buffer.R)]
        dist.all_gather(parts, w_B.detach().contiguous(), group=group)
        return torch.cat(parts)

    # -- expert parallelism --------------------------------------------------------------------
    def buffer_key(self) -> tuple:
        """The Buffer settings this layer needs (layers with the same key can share one)."""
        a = self.args
        cost = (a.slack, a.link_gbps, self.hidden_dim) if a.policy == "cost" else ()
        return (self.dim, self.top_k, self.num_experts, self.dtype, a.capacity, a.token_padding,
                a.policy, a.backend) + cost

    def bind(self, buffer: Optional[Buffer] = None, *, group: Optional[dist.ProcessGroup] = None,
             device=None) -> Buffer:
        """Attach the layer to an EP group and keep this rank's home experts.

        ``buffer``: a Buffer to share with other layers (its D, K, E and dtype must match the
        layer's); None: build one from ``args`` (capacity, token_padding, policy, backend) over
        ``group`` (None: the default group when torch.distributed is initialised, else one rank).
        Collective.  The ranks' layers are compared first (``Buffer.expert_pool``: D, F, dtype,
        precision, fp8_pow2_scales): ranks that differ, e.g. one launched with precision "fp8"
        and one with "bf16", raise the same ValueError on every rank, and a rank whose layer
        fails a local check makes its peers raise, before anything of the layer changes.
        Parameters made on the meta device are materialised (uninitialised) on the Buffer's
        device: call ``init_weights`` or load a checkpoint next.  Returns the Buffer."""
        if self.buffer is not None:
            raise RuntimeError("this MoonEPMoE is already bound to a Buffer")
        a = self.args
        if buffer is None:
            if not a.capacity:
                raise ValueError("MoEArgs.capacity (the most tokens per rank per forward) must be "
                                 "set to bind the layer")
            cost = (dict(slack=a.slack, link_gbps=a.link_gbps, expert_dim=self.hidden_dim)
                    if a.policy == "cost" else {})
            buffer = Buffer(a.capacity, self.dim, self.top_k, self.num_experts, group=group,
                            token_padding=a.token_padding, dtype=self.dtype, device=device,
                            policy=a.policy, backend=a.backend, **cost)
        if not isinstance(buffer, Buffer):
            raise TypeError(f"buffer must be a moonep_ops.Buffer, got {type(buffer).__name__}")
        try:
            mine = (self.dim, self.top_k, self.num_experts, self.dtype)
            theirs = (buffer.D, buffer.K, buffer.E, buffer.dtype)
            if mine != theirs:
                raise ValueError(f"the Buffer has (D, K, E, dtype) = {theirs}, the layer {mine}")
            check_backend_dims(buffer.device.type, self.dtype, self.dim, self.hidden_dim)
            check_precision(a.precision, a.fp8_pow2_scales, self.dtype, self.dim, self.hidden_dim,
                            a.fp8_weight_cache, a.fp8_wgrad)
        except (TypeError, ValueError) as e:
            buffer.reject_expert_pool(e)     # collective: the peers are in expert_pool below
            raise
        # Collective, before anything changes: the ranks' layers agree on their pool, or all raise
        pool = buffer.expert_pool(self.dim, self.hidden_dim, self.dtype, precision=a.precision,
                                  pow2_scales=a.fp8_pow2_scales, expert_settings=expert_settings(
                                      a.expert_bias, a.activation, a.swiglu_alpha,
                                      a.swiglu_limit, a.fp8_wgrad))
        if a.expert_bias:
            pool.add_bias_slots()            # collective: every rank's layers bind alike
        B, r, dev = buffer.epn, buffer.rank, buffer.device
        with torch.no_grad():
            for name in self.expert_params:
                w = getattr(self, name)
                if w.shape[0] != self.num_experts:
                    raise RuntimeError(f"{name} holds {w.shape[0]} experts, not all {self.num_experts}")
                if w.is_meta:
                    local = torch.empty((B,) + tuple(w.shape[1:]), dtype=w.dtype, device=dev)
                else:
                    local = w[r * B:(r + 1) * B].to(dev).clone()
                setattr(self, name, nn.Parameter(local, requires_grad=w.requires_grad))
        for mod in (self.router, self.shared, self.shared_gate):
            if mod is not None:
                if any(p.is_meta for p in mod.parameters()) or any(b.is_meta for b in mod.buffers()):
                    mod.to_empty(device=dev)
                else:
                    mod.to(dev)
        if isinstance(self.router, Router) and self.router.balance_group is None:
            self.router.balance_group = buffer.group
        self.pool_name = pool.name
        if a.precision == "fp8" and a.fp8_weight_cache:
            # a submodule of non-persistent buffers: moves with the layer, never in state_dict
            self.fp8_cache = FP8WeightCache(B, self.hidden_dim, self.dim,
                                            pow2_scales=a.fp8_pow2_scales, device=dev)
            self.fp8_cache.bind(self.w1, self.w3, self.w2)
        self.buffer, self.expert_offset = buffer, r * B
        self._side = (torch.cuda.Stream(device=dev) if self.args.side_stream and dev.type == "cuda"
                      and self.shared is not None else None)
        return buffer

    # -- forward --------------------------------------------------------------------------------
    def forward(self, x: Tensor, total_num_tokens: Optional[int] = None, *,
                topk_ids: Optional[Tensor] = None, topk_weights: Optional[Tensor] = None) -> Tensor:
        """``x [..., D]`` -> ``[..., D]``.  ``topk_ids`` / ``topk_weights`` ([s, K] int32 / fp32,
        s = the product of x's leading dims): route with them instead of the router.
        ``total_num_tokens``: the group's token count when ranks pass different s."""
        if self.buffer is None:
            if torch.compiler.is_compiling():
                raise RuntimeError("bind MoonEPMoE layers before compiling (moonep_ops.nn.bind_moe)")
            self.bind()
        D = self.dim
        if not isinstance(x, Tensor) or x.dim() < 2 or x.shape[-1] != D:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"MoonEPMoE expects input of shape [..., D={D}] with at least one "
                             f"leading (token) dim, got {shape}")
        if x.dtype != self.dtype:
            raise TypeError(f"MoonEPMoE holds {self.dtype} experts, the input is {x.dtype}")
        x_sD = x.reshape(-1, D)
        s, S = x_sD.shape[0], self.buffer.S
        if s > S:
            raise ValueError(f"MoonEPMoE got {s} tokens on this rank, more than its capacity S={S} "
                             "(MoEArgs.capacity / the Buffer's S)")
        if (topk_ids is None) != (topk_weights is None):
            raise ValueError("give both topk_ids and topk_weights, or neither")
        if topk_ids is None:
            ids_sK, w_sK, logits_sE = self.router(x_sD)
            self.last_logits = logits_sE.detach()
        else:
            ids_sK, w_sK = topk_ids, topk_weights
        buf = self.buffer
        shared_out = None
        side = self._side if not torch.compiler.is_compiling() else None
        if self.shared is not None and side is not None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                shared_out = self._shared(x_sD)
        a = self.args                 # fp8_wgrad only with "fp8" (check_precision)
        out = routed_experts(buf, self.pool_name, x_sD, ids_sK, w_sK, self.w1, self.w3, self.w2,
                             precision=a.precision, pow2_scales=a.fp8_pow2_scales,
                             total_num_tokens=total_num_tokens, fp8_wgrad=a.fp8_wgrad,
                             weight_cache=self.fp8_cache.name if self.fp8_cache is not None else "",
                             biases=self.biases(), activation=a.activation,
                             alpha=a.swiglu_alpha, limit=a.swiglu_limit)
        if self.shared is not None:
            if side is not None:
                main.wait_stream(side)
                shared_out.record_stream(main)
            else:
                shared_out = self._shared(x_sD)
            out = out + shared_out
        return out.view(x.shape)

    def _shared(self, x_sD: Tensor) -> Tensor:
        out = self.shared(x_sD)
        if self.shared_gate is not None:
            out = torch.sigmoid(self.shared_gate(x_sD)) * out
        return out

    # -- training-step hooks --------------------------------------------------------------------
    def refresh_fp8_weights(self) -> None:
        """Re-quantise the FP8 weight cache now (after a parameter update; a no-op without a
        cache).  Eagerly this only saves the next forward the work; inside a compiled or
        captured step, after the update, it is the step refresh that CUDA-graph replays rely on
        (the cache is then told so: ``refresh_by_step``)."""
        if self.fp8_cache is not None:
            if not torch.compiler.is_compiling():
                self.fp8_cache.refresh_by_step(True)
            with torch.no_grad():
                self.fp8_cache.refresh(self.w1, self.w3, self.w2)

    @torch.no_grad()
    def update_balance(self) -> None:
        """Quantile-Balancing step of the built-in router from the last forward's logits (after
        backward).  A user router balances itself."""
        if isinstance(self.router, Router) and self.last_logits is not None:
            self.router.update_balance(self.router.scores(self.last_logits))

    def reduce_router_grad(self) -> None:
        """All-reduce (sum) the replicated router's and shared experts' grads over the EP group,
        as DDP/FSDP would (not needed when those wrap the model)."""
        group = self.buffer.group if self.buffer is not None else None
        if group is None or not dist.is_initialized():
            return
        mods = (self.router, self.shared, self.shared_gate)
        for p in (p for m in mods if m is not None for p in m.parameters()):
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)

    def extra_repr(self) -> str:
        bound = f"rank {self.buffer.rank}/{self.buffer.R}" if self.buffer is not None else "unbound"
        return (f"dim={self.dim}, hidden_dim={self.hidden_dim}, experts={self.num_experts} "
                f"({self.num_local_experts} held), top_k={self.top_k}, {bound}")


def moe_layers(model: nn.Module) -> Iterable[MoonEPMoE]:
    return (m for m in model.modules() if isinstance(m, MoonEPMoE))


def attach_fp8_weight_caches(model: nn.Module, optimizer: torch.optim.Optimizer) -> list:
    """Refresh every bound FP8 layer's weight cache after each ``optimizer.step()`` (a step
    post-hook per layer; CUDA-graph captures then read the caches).  Returns the hooks' handles."""
    return [layer.fp8_cache.attach(optimizer, layer.w1, layer.w3, layer.w2)
            for layer in moe_layers(model) if layer.fp8_cache is not None]


def bind_moe(model: nn.Module, *, group: Optional[dist.ProcessGroup] = None,
             capacity: Optional[int] = None, device=None, **args_overrides) -> list[Buffer]:
    """Bind every unbound ``MoonEPMoE`` of ``model`` (collective; every rank, same model).

    Layers that need the same Buffer settings (``MoonEPMoE.buffer_key``) share one Buffer, and so
    one ExpertPool per expert shape: one Buffer for a model whose MoE layers are alike.
    ``capacity`` and ``args_overrides`` (e.g. token_padding, policy, backend) replace the layers'
    MoEArgs fields first.  Returns the Buffers, in the order of the layers' first appearance."""
    buffers: dict[tuple, Buffer] = {}
    for layer in moe_layers(model):
        if layer.buffer is not None:
            continue
        over = dict(args_overrides)
        if capacity is not None:
            over["capacity"] = capacity
        if over:
            layer.args = layer.args.replace(**over)
        key = layer.buffer_key()
        buf = buffers.get(key)
        if buf is None:
            buf = buffers[key] = layer.bind(group=group, device=device)
        else:
            layer.bind(buf)
    return list(buffers.values())


__all__ = ["MoEArgs", "MoonEPMoE", "SwiGLU", "bind_moe", "moe_layers", "check_backend_dims",
           "check_precision", "routed_experts", "attach_fp8_weight_caches"]
