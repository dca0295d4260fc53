"""MoonEP inside torchtitan 0.3.0's own MoE models (Qwen3, DeepSeek-V3 and every model built on
``torchtitan.models.common.moe``).

Entry point: torchtitan's own override mechanism.  List ``moonep_ops.integrations.torchtitan.moonep``
in ``override.imports``::

    # CLI (kwargs optional; capacity = local_batch_size * seq_len / (cp * tp))
    torchrun --nproc-per-node 8 -m torchtitan.train --module qwen3 --config qwen3_moe_debug \\
        --parallelism.expert_parallel_degree 8 --training.disable_cuda_graphs \\
        --override.imports 'moonep_ops.integrations.torchtitan.moonep={"capacity": 16384}'

    # Python (a Trainer.Config you build)
    config.override.imports.append(moonep_override(capacity=16384))

    # no Trainer: after model_config.update_from_config(...), before model_config.build()
    apply_moonep(model_config, capacity=16384)

Override kwargs (all optional):
  capacity       S, the most tokens one rank passes to one MoE forward: local_batch_size * seq_len
                 / (cp * tp) in torchtitan.  Default: the dispatcher config's
                 ``num_max_tokens_per_rank`` when it has one (DeepEP / HybridEP / MinimalAsyncEP
                 configs get it from the job), else the token count of the first forward (eager
                 only: under torch.compile give it explicitly; a later, larger forward, e.g. a
                 validation batch, then raises).
  token_padding  segment alignment of MoonEP's receive buffer.  Default: 128 on an NCCL ep group
                 (the CUDA grouped GEMM's tiles), else 1.
  policy         planner policy (``moonep_ops.POLICIES``; "moonep": exact MoonEP; "cost": caps
                 with a slack, moves chosen by a predicted cost).
  slack          policy "cost": the cap slack eps (default 0: exact caps).
  link_gbps      policy "cost": link GB/s per direction (default: the H200 NVLink datasheet's).
  backend        MoonEP data-plane backend ("auto": symmetric memory on CUDA, torch.distributed
                 collectives on gloo).
  precision      the routed experts' precision: "bf16" (default) or "fp8" (the DeepSeek-V3 FP8
                 recipe, docs/fp8.md: tokens dispatched in e4m3 with their scales, FP8 expert
                 GEMMs and dgrads, bf16 weight grads; D and F multiples of 16).
  fp8_pow2_scales  power-of-two FP8 scales (default False).
  fp8_wgrad      precision "fp8" only (else ValueError): the three expert weight grads in FP8 too
                 (DeepSeek-V3's Wgrad; default False, docs/fp8.md: it does not pay yet; not with
                 gpt-oss's biases and clamped SwiGLU).
  fp8_weight_cache  refused (ValueError) when True: the FP8 weight cache keys its e4m3 copy on the
                 weight tensors the expert op receives (their identity, version and storage), and
                 here those are new tensors every forward (``DTensor.to_local``, FSDP's all-gather,
                 the cast to bf16), so it would re-quantise on every call and hold 6·(E/R)·D·F
                 bytes a layer for nothing.  ``hf.convert_model`` and ``MoEArgs`` have it.

Where it sits in torchtitan's flow (``Trainer.__init__``)::

    model_config.update_from_config(config)   sharding configs for every submodule
    apply_overrides(config.override, config)  HERE: every RoutedExperts.Config ->
                                              MoonEPRoutedExperts.Config (derive(): same
                                              inner_experts config, param_init, sharding_config)
    model_config.build() on meta              MoE.routed_experts is a MoonEPRoutedExperts
    parallelize_fn(model, ...)
      model.parallelize(parallel_dims)        experts -> DTensor Shard(0) on the ep mesh, then
                                              MoonEPRoutedExperts.parallelize builds MoonEP's
                                              Buffer on the ep group (collective; one Buffer,
                                              one ExpertPool per expert shape, for all layers)
      AC, torch.compile per block, FSDP2      unchanged (FSDP finds moe.routed_experts.inner_experts)
    to_empty, init_weights                    unchanged (GroupedExperts' param_init, MoE buffers)
    optimizer + register_moe_load_balancing_hook, checkpointer     unchanged

Design: subclass ``RoutedExperts`` (TT_NOTES option "c").  torchtitan's ``MoE`` calls
``routed_experts(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, counts_E)`` (torchtitan's names
and letters: B batch, L sequence) between its router and its shared experts;
``MoonEPRoutedExperts`` keeps that signature, names included (so the ``local_map`` boundary of
its sharding config, which finds the inputs by name, wraps it as before), keeps
``inner_experts`` as torchtitan's ``GroupedExperts`` (same parameters, FQNs, init, DTensor
layout, FSDP wrapping, checkpoint keys), flattens the s = batch * seqlen tokens of this rank and
replaces only the body::

    h_MD, w_M, cu_G, plan = buffer.dispatch(x_sD.bfloat16(), ids_sK.int(), w_sK)
    y_MD = moonep::moe_experts(h_MD, cu_G, plan.experts_to_copy, w1, w3, w2, pool)
    out_sD = buffer.combine(plan, y_MD, w_M, weighted=True)

Why this level and not the others: a custom ``BaseEPTokenDispatcher`` (option "a") would have to
smuggle MoonEP's 2B-group ``cu_seqlens``, slot table and pool name to the experts through the
contract's "counts" slot, and replace ``GroupedExperts`` too; swapping the whole ``MoE`` (option
"b") would drop torchtitan's router (node-limited groups, its exact fp32 math), its aux-loss-free
balancing, its shared experts and the MoE boundary's sharding, and would have to rebuild the
DTensor expert layout that ``clip_grad_norm_``, DCP and the HF adapters need.  At this level all
of those stay torchtitan's, by construction.

What is kept: torchtitan's router (``TokenChoiceTopKRouter``, groups, route_norm/scale), its
load balancing (``expert_bias_E``, ``tokens_per_expert_E`` counted by ``MoE.forward`` over all E
for this rank's tokens, the optimizer pre-hook that all-reduces and updates the bias), shared
experts, parameter names and the state-dict layout (``...routed_experts.inner_experts.w1_EFD``
etc., DTensors of global shape [E, F, D] / [E, D, F], Shard(0) on ``ep``), init, AC, compile and
FSDP.  What MoonEP changes: the experts run over B = E/R home experts plus B redundant slots;
rank r owns experts r*E/R .. (r+1)*E/R - 1 (exactly torchtitan's Shard(0) block on the ep mesh);
a hot expert's whole chunks of tokens go to underloaded ranks that run it in a slot (its weights
pushed into the Buffer's ExpertPool, not a parameter: not in the state dict, not seen by FSDP or
the optimizer), and every slot's weight grad is added into its owner's grad inside the MoE
backward, so FSDP's reduce-scatter and the optimizer see complete grads of the owned experts.
At EP = 1 (no ``ep`` mesh) torchtitan's local path runs unchanged.

Numerics: torchtitan computes the experts in bf16 with fp32 accumulation (``GroupedExperts``
casts); so does MoonEP (the Buffer and the weights handed to ``moe_experts`` are bf16).  The
differences are rounding points: MoonEP's SwiGLU rounds ``silu(g) * u`` once (torchtitan rounds
``silu(g)`` and the product), MoonEP sums a token's K expert outputs in fp32 and rounds the sum to
bf16 once (torchtitan scatter-adds in the activation dtype: fp32 under fp32 activations, bf16
under torchtitan's default bf16 FSDP params), and a hot expert's weight grad is the fp32 sum of
its home and slot parts.  So losses agree to bf16 rounding, not bitwise (tests/
test_integrations_torchtitan.py states the tolerance).

What was run (CPU, gloo, torch 2.13; tests/test_integrations_torchtitan.py and
examples/torchtitan_moonep.py): Qwen3-MoE and DeepSeek-V3 tiny configs at EP = 2 and 4 (also EP = 2
on 4 ranks, experts FSDP-sharded over efsdp = 2) with spmd_backend "partial_dtensor"; the same
with "full_dtensor", full and selective activation checkpointing, FSDP params in bf16, and
torch.compile of every block (fullgraph=True; aot_eager: no graph break and no recompile over 4
steps, inductor: runs).
Not run: spmd_backend "spmd_types" (torchtitan's default; on this CPU torch torchtitan's own FSDP
wrapping fails there before any MoE code runs; the expert weights are then plain local slices,
which ``bind`` accepts), CUDA (the symmetric-memory data plane and CUTLASS grouped GEMMs are
MoonEP's CUDA path; its own CUDA tests cover them, not inside torchtitan), pipeline parallelism,
TP or CP together with EP, Float8/MXFP8 converters (they target GroupedExperts' ``_grouped_mm``
seam, which MoonEP's experts do not call).

Limits: torchtitan's Trainer CUDA graphs (``training.disable_cuda_graphs`` is required with EP and
the standard dispatcher config kept here, as for torchtitan's own all-to-all); expert tensor
parallelism does not exist in torchtitan 0.3.0 (with EP, the tp axis only shards tokens, which
MoonEP takes per rank).  The capacity must be the same on every rank (torchtitan pads every rank
to the same token count; the Buffer checks the settings at construction).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from torchtitan.config import OverrideConfig, apply_overrides, derive, override
from torchtitan.distributed.spmd_types import maybe_set_sparse_mesh
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

from ..buffer import Buffer
from ..geometry import expert_settings, slack_to_ppm
from ..nn.moe import check_backend_dims, check_precision
from ..ops import moe_experts as _moe_experts_ops  # noqa: F401  (registers moonep::moe_experts)
from ..ops.moe_experts_ext import check_variant, moe_experts_ext
from ..planner import POLICIES

#: The ``override.imports`` target that turns MoonEP on.
OVERRIDE = f"{__name__}.moonep"

#: Compute dtype of the routed experts (torchtitan's GroupedExperts always computes in bf16).
COMPUTE_DTYPE = torch.bfloat16

#: The inner experts the override runs: torchtitan's SwiGLU GroupedExperts, and gpt-oss's
#: GptOssGroupedExperts (biases, the clamped SwiGLU with torchtitan's fixed alpha 1.702 and the
#: config's swiglu_limit, gate and up interleaved in ``mlp1_weight_EGD [E, 2F, D]``).
INNER_EXPERTS = (GroupedExperts.Config, GptOssGroupedExperts.Config)
GPT_OSS_ALPHA = 1.702

# One Buffer per (EP group, settings), shared by every MoE layer of the process (and so one
# ExpertPool per expert shape).  Weak: the Buffer is freed with the last layer holding it.
_BUFFERS: "weakref.WeakValueDictionary[tuple, Buffer]" = weakref.WeakValueDictionary()


def _shared_buffer(group: dist.ProcessGroup, S: int, D: int, K: int, E: int, *,
                   token_padding: Optional[int], policy: str, backend: str, F: int = 0,
                   slack: float = 0.0, link_gbps: Optional[float] = None) -> Buffer:
    """The process's Buffer for these settings on ``group`` (collective when it is built).
    ``token_padding`` None: 128 on an NCCL group (the CUDA grouped GEMM's tiles), else 1.
    Policy "cost": ``slack``, ``link_gbps`` and the experts' FFN dim ``F`` (its cost model)."""
    if token_padding is None:
        token_padding = 128 if dist.get_backend(group) == "nccl" else 1
    cost = dict(slack=slack, link_gbps=link_gbps, expert_dim=F) if policy == "cost" else {}
    # id(group) is unique while the Buffer lives: the Buffer's backend holds the group.
    key = (id(group), S, D, K, E, COMPUTE_DTYPE, token_padding, policy, backend) + tuple(
        cost.values())
    buf = _BUFFERS.get(key)
    if buf is None or not buf.alive or buf.group is not group:
        buf = Buffer(S, D, K, E, group=group, token_padding=token_padding, dtype=COMPUTE_DTYPE,
                     policy=policy, backend=backend, **cost)
        _BUFFERS[key] = buf
    return buf


class MoonEPRoutedExperts(RoutedExperts):
    """torchtitan's ``RoutedExperts`` with the expert-parallel body run by MoonEP (module docstring).

    ``inner_experts`` (torchtitan's ``GroupedExperts``) and ``token_dispatcher`` are built as in
    the parent; the dispatcher only serves the EP = 1 path.  After ``parallelize`` on an ``ep``
    mesh the layer holds ``moonep_buffer`` (a ``moonep_ops.Buffer``, shared with the model's other
    MoE layers) and ``pool_name`` (its ExpertPool for this expert shape); both are plain
    attributes, outside the state dict.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        capacity: Optional[int] = None
        token_padding: Optional[int] = None
        policy: str = "moonep"
        backend: str = "auto"
        slack: float = 0.0
        link_gbps: Optional[float] = None
        precision: str = "bf16"
        fp8_pow2_scales: bool = False
        fp8_wgrad: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        if config.capacity is not None and (not isinstance(config.capacity, int)
                                            or isinstance(config.capacity, bool)
                                            or config.capacity < 1):
            raise ValueError(f"capacity must be a positive int or None, got {config.capacity!r}")
        if config.token_padding is not None and (not isinstance(config.token_padding, int)
                                                 or config.token_padding < 1):
            raise ValueError(f"token_padding must be a positive int or None, got "
                             f"{config.token_padding!r}")
        if config.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {config.policy!r}")
        if slack_to_ppm(config.slack) and config.policy != "cost":
            raise ValueError(f"slack is a setting of policy 'cost', got policy {config.policy!r}")
        self.capacity = config.capacity
        self.token_padding = config.token_padding
        self.policy = config.policy
        self.backend = config.backend
        self.slack = config.slack
        self.link_gbps = config.link_gbps
        check_precision(config.precision, config.fp8_pow2_scales, COMPUTE_DTYPE, 16, 16,
                        wgrad=config.fp8_wgrad)
        self.precision = config.precision
        self.fp8_pow2_scales = config.fp8_pow2_scales
        self.fp8_wgrad = config.fp8_wgrad
        self.ep_group: Optional[dist.ProcessGroup] = None
        self._ep_local_rank: Optional[int] = None
        self.moonep_buffer: Optional[Buffer] = None
        self.pool_name: Optional[str] = None

    # -- parallelism ------------------------------------------------------------------------------
    def parallelize(self, parallel_dims) -> None:
        """torchtitan's parallelize (experts -> DTensor Shard(0) on ``ep``, local_map, dispatcher
        wiring), then MoonEP's Buffer on the ep group when the capacity is known (collective)."""
        super().parallelize(parallel_dims)
        ep_mesh = parallel_dims.get_optional_mesh("ep")
        if ep_mesh is None:
            return
        self.ep_group = ep_mesh.get_group()
        self._ep_local_rank = ep_mesh.get_local_rank()
        if self.capacity is not None:
            self.bind(self.capacity)

    def bind(self, capacity: Optional[int] = None, *, group: Optional[dist.ProcessGroup] = None,
             buffer: Optional[Buffer] = None) -> Buffer:
        """Attach the layer to a MoonEP Buffer: ``buffer`` as given (its S, D, K, E must fit), or
        the process's shared Buffer of capacity S = ``capacity`` on ``group`` (default: the ep
        group ``parallelize`` found).  Collective; every rank, same order of layers."""
        if self.moonep_buffer is not None:
            raise RuntimeError("this MoonEPRoutedExperts is already bound to a Buffer")
        ie = self.inner_experts
        # Under partial_dtensor / full_dtensor the experts are DTensors of global shape [E, F, D];
        # under spmd_types they are this rank's plain [E/R, F, D] slice (gpt-oss: [.., 2F, D]).
        gpt_oss = isinstance(ie, GptOssGroupedExperts)
        w = ie.mlp1_weight_EGD if gpt_oss else ie.w1_EFD
        local = w.to_local() if isinstance(w, DTensor) else w
        E, (F, D) = ie.num_experts, tuple(local.shape[1:])
        F = F // 2 if gpt_oss else F
        K = self.token_dispatcher.top_k
        if buffer is None:
            group = group if group is not None else self.ep_group
            if group is None:
                raise RuntimeError("MoonEPRoutedExperts.bind needs the EP process group: call "
                                   "model.parallelize(parallel_dims) with an ep mesh first")
            if capacity is None:
                raise ValueError("MoonEPRoutedExperts.bind needs the capacity S")
            buffer = _shared_buffer(group, capacity, D, K, E, token_padding=self.token_padding,
                                    policy=self.policy, backend=self.backend, F=F,
                                    slack=self.slack, link_gbps=self.link_gbps)
        if not isinstance(buffer, Buffer):
            raise TypeError(f"buffer must be a moonep_ops.Buffer, got {type(buffer).__name__}")
        try:
            if (buffer.D, buffer.K, buffer.E, buffer.dtype) != (D, K, E, COMPUTE_DTYPE):
                raise ValueError(f"the Buffer has (D, K, E, dtype) = "
                                 f"{(buffer.D, buffer.K, buffer.E, buffer.dtype)}, the layer needs "
                                 f"{(D, K, E, COMPUTE_DTYPE)}")
            check_backend_dims(buffer.device.type, COMPUTE_DTYPE, D, F)
            check_precision(self.precision, self.fp8_pow2_scales, COMPUTE_DTYPE, D, F,
                            wgrad=self.fp8_wgrad)
            if gpt_oss:
                check_variant(True, "swiglu_clamped", GPT_OSS_ALPHA, ie.swiglu_limit,
                              self.fp8_wgrad)
            if local.shape[0] != buffer.epn:
                raise ValueError(f"this rank holds {local.shape[0]} experts but MoonEP's group of "
                                 f"R={buffer.R} expects E/R={buffer.epn}: the experts must be "
                                 "Shard(0) on the same ep mesh")
            if self._ep_local_rank is not None and self._ep_local_rank != buffer.rank:
                raise ValueError(f"ep mesh coordinate {self._ep_local_rank} != rank {buffer.rank} "
                                 "of the ep process group: expert ownership would not match")
        except (TypeError, ValueError) as e:
            buffer.reject_expert_pool(e)     # collective: the peers are in expert_pool below
            raise
        # collective: the ranks' layers agree on precision and pow2 scales, or all raise
        pool = buffer.expert_pool(D, F, COMPUTE_DTYPE, precision=self.precision,
                                  pow2_scales=self.fp8_pow2_scales, expert_settings=(
                                      expert_settings(True, "swiglu_clamped", GPT_OSS_ALPHA,
                                                      ie.swiglu_limit, self.fp8_wgrad)
                                      if gpt_oss else expert_settings(False, "swiglu", None,
                                                                      None, self.fp8_wgrad)))
        if gpt_oss:
            pool.add_bias_slots()        # collective: every rank's layers bind alike
        self.pool_name = pool.name
        self.capacity = buffer.S
        self.moonep_buffer = buffer
        return buffer

    def owned_experts(self) -> range:
        """Global ids of this rank's home experts: r*E/R .. (r+1)*E/R - 1."""
        buf = self.moonep_buffer
        if buf is None:
            return range(self.inner_experts.num_experts)
        return range(buf.rank * buf.epn, (buf.rank + 1) * buf.epn)

    # -- forward ----------------------------------------------------------------------------------
    def _expert_weights(self) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's [B, F, D] / [B, D, F] experts as bf16 (differentiable: grads flow back
        through the cast and ``to_local`` into the DTensor parameters)."""
        ie = self.inner_experts
        out = []
        for w in (ie.w1_EFD, ie.w3_EFD, ie.w2_EDF):
            if isinstance(w, DTensor):
                w = w.to_local()
            out.append(w.to(COMPUTE_DTYPE).contiguous())
        return out[0], out[1], out[2]

    def _gpt_oss_weights(self) -> tuple[list[Tensor], list[Tensor]]:
        """gpt-oss's experts as MoonEP's: ([w1, w3 [B, F, D], w2 [B, D, F]], [b1, b3 [B, F],
        b2 [B, D]]) in bf16, gate and up taken from the interleaved rows (differentiable)."""
        ie = self.inner_experts
        W1, b13, w2, b2 = (t.to_local() if isinstance(t, DTensor) else t
                           for t in (ie.mlp1_weight_EGD, ie.mlp1_bias_EG, ie.mlp2_weight_EDF,
                                     ie.mlp2_bias_ED))
        ws = [W1[:, 0::2], W1[:, 1::2], w2]
        bs = [b13[:, 0::2], b13[:, 1::2], b2]
        return ([t.to(COMPUTE_DTYPE).contiguous() for t in ws],
                [t.to(COMPUTE_DTYPE).contiguous() for t in bs])

    # torchtitan's parameter names (its letters: B batch, L sequence): the sharding config's
    # local_map finds the inputs by name.
    def forward(self, x_BLD: Tensor, topk_scores_BLK: Tensor, topk_expert_ids_BLK: Tensor,
                num_local_tokens_per_expert_E: Tensor) -> Tensor:
        """Same contract as ``RoutedExperts.forward``: ``[batch, seqlen, D]`` out, the routed
        experts' weighted sum per token.  ``num_local_tokens_per_expert_E`` is unused under MoonEP
        (the Buffer exchanges its own histograms)."""
        if self.moonep_buffer is None:
            if self.ep_group is None:            # EP = 1 and unbound: torchtitan's local path
                return super().forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK,
                                       num_local_tokens_per_expert_E)
            if torch.compiler.is_compiling():
                raise RuntimeError("MoonEP under torch.compile needs its capacity up front: pass "
                                   "capacity=local_batch_size*seq_len/(cp*tp) to the override")
            self.bind(x_BLD.shape[0] * x_BLD.shape[1])
        buf = self.moonep_buffer
        batch, seqlen, D = x_BLD.shape
        K = topk_scores_BLK.shape[-1]
        s = batch * seqlen
        if s > buf.S:
            raise ValueError(f"MoonEP got {s} tokens on this rank, more than its capacity "
                             f"S={buf.S}: pass a larger capacity to the override")
        x_sD = x_BLD.reshape(s, D).to(COMPUTE_DTYPE)
        ids_sK = topk_expert_ids_BLK.reshape(s, K).to(torch.int32)
        w_sK = topk_scores_BLK.reshape(s, K).float()
        w_rows = None                          # the rows' route weights when combine applies them
        if self.precision == "fp8":
            h_MD, hs_MC, w_M, cu_G, plan = buf.dispatch_fp8(x_sD, ids_sK, w_sK,
                                                            pow2_scales=self.fp8_pow2_scales)
            with maybe_set_sparse_mesh():
                if isinstance(self.inner_experts, GptOssGroupedExperts):
                    (w1, w3, w2), biases = self._gpt_oss_weights()
                    more = (biases, "swiglu_clamped", GPT_OSS_ALPHA,
                            self.inner_experts.swiglu_limit)
                else:
                    (w1, w3, w2), more = self._expert_weights(), ()
                z_MD, _, _, _ = torch.ops.moonep.moe_experts_fp8(
                    h_MD, hs_MC, w_M, cu_G, plan.experts_to_copy, w1, w3, w2, self.pool_name,
                    x_sD, w_sK, plan.dst, plan.total_num_tokens, self.fp8_pow2_scales, "",
                    self.fp8_wgrad, *more)
        elif isinstance(self.inner_experts, GptOssGroupedExperts):
            h_MD, w_M, cu_G, plan = buf.dispatch(x_sD, ids_sK, w_sK)
            with maybe_set_sparse_mesh():
                (w1, w3, w2), biases = self._gpt_oss_weights()
                z_MD, _, _, _ = moe_experts_ext(h_MD, w_M, cu_G, plan.experts_to_copy, w1, w3,
                                                w2, biases, self.pool_name, "swiglu_clamped",
                                                GPT_OSS_ALPHA, self.inner_experts.swiglu_limit)
        else:
            h_MD, w_M, cu_G, plan = buf.dispatch(x_sD, ids_sK, w_sK)
            with maybe_set_sparse_mesh():      # as RoutedExperts does (spmd_types only)
                w1, w3, w2 = self._expert_weights()
                z_MD, _, _ = torch.ops.moonep.moe_experts(h_MD, cu_G, plan.experts_to_copy, w1,
                                                          w3, w2, self.pool_name)
            w_rows = w_M       # applied inside combine: fp32 products summed in fp32, rounded once
        out_sD, _ = buf.combine(plan, z_MD, w_rows, weighted=w_rows is not None)
        return out_sD.to(x_BLD.dtype).view(batch, seqlen, D)

    def extra_repr(self) -> str:
        buf = self.moonep_buffer
        where = f"rank {buf.rank}/{buf.R}, S={buf.S}" if buf is not None else "unbound"
        return (f"moonep: {where}, token_padding={self.token_padding}, policy={self.policy}, "
                f"precision={self.precision}")


@override(target=RoutedExperts.Config, exact=True,
          description="MoonEP expert parallelism (perfect load balance) for the routed experts")
def moonep(cfg: RoutedExperts.Config, *, capacity: Optional[int] = None,
           token_padding: Optional[int] = None, policy: str = "moonep",
           backend: str = "auto", slack: float = 0.0, link_gbps: Optional[float] = None,
           precision: str = "bf16", fp8_pow2_scales: bool = False, fp8_wgrad: bool = False,
           fp8_weight_cache: bool = False) -> MoonEPRoutedExperts.Config:
    """The override factory: ``RoutedExperts.Config`` -> ``MoonEPRoutedExperts.Config``, every
    field of the matched config kept (``derive``).  Exact match: a model's own subclass of
    ``RoutedExperts`` is left alone (its behaviour would be lost).  The token dispatcher becomes torchtitan's
    standard one (used only at EP = 1; DeepEP/HybridEP buffers are not allocated), and its
    ``num_max_tokens_per_rank``, when it has one, is the default capacity.  Routed experts
    whose inner experts are not exactly ``GroupedExperts`` or gpt-oss's ``GptOssGroupedExperts``
    (``INNER_EXPERTS``) raise ``ValueError``, and so does ``fp8_weight_cache=True`` (the module
    docstring says why)."""
    if fp8_weight_cache is not False:
        raise ValueError(f"moonep override: fp8_weight_cache={fp8_weight_cache!r}: the FP8 weight "
                         "cache would re-quantise on every forward here (the experts reach the "
                         "op as new tensors each call: to_local, FSDP all-gather, bf16 cast) and "
                         "cost 6*(E/R)*D*F bytes a layer; use fp8_weight_cache=False")
    inner = type(cfg.inner_experts)
    if inner not in INNER_EXPERTS:
        # MoonEP runs those two's math on their parameters; another subclass would be computed
        # wrongly or fail deep inside the forward
        raise ValueError(
            f"moonep override: these routed experts are {inner.__qualname__}, not torchtitan's "
            "GroupedExperts.Config (SwiGLU over w1_EFD, w3_EFD, w2_EDF) or GptOssGroupedExperts"
            ".Config (gpt-oss); MoonEP does not run them: leave this model without the override")
    if inner is GptOssGroupedExperts.Config:
        check_variant(True, "swiglu_clamped", GPT_OSS_ALPHA, cfg.inner_experts.swiglu_limit,
                      fp8_wgrad and precision == "fp8")    # bf16: check_precision's message
    disp = cfg.token_dispatcher
    if capacity is None:
        capacity = getattr(disp, "num_max_tokens_per_rank", None)
    standard = AllToAllTokenDispatcher.Config(num_experts=disp.num_experts, top_k=disp.top_k)
    return derive(cfg, MoonEPRoutedExperts.Config, token_dispatcher=standard, capacity=capacity,
                  token_padding=token_padding, policy=policy, backend=backend, slack=slack,
                  link_gbps=link_gbps, precision=precision, fp8_pow2_scales=fp8_pow2_scales,
                  fp8_wgrad=fp8_wgrad)


def moonep_override(**kwargs: Any):
    """The ``override.imports`` entry for ``Trainer.Config.override.imports`` (kwargs: capacity,
    token_padding, policy, backend, slack, link_gbps, precision, fp8_pow2_scales, fp8_wgrad,
    fp8_weight_cache: the module docstring)."""
    return (OVERRIDE, dict(kwargs)) if kwargs else OVERRIDE


def apply_moonep(config, **kwargs: Any) -> int:
    """Apply the override to a config tree (a model config, or a Trainer.Config) without the
    Trainer: call it after ``update_from_config`` and before ``build``.  Returns the number of
    RoutedExperts replaced."""
    return len(apply_overrides(OverrideConfig(imports=[moonep_override(**kwargs)]), config))


def moonep_layers(model: torch.nn.Module) -> list[MoonEPRoutedExperts]:
    """The model's MoonEP routed-expert modules, in module order."""
    return [m for m in model.modules() if isinstance(m, MoonEPRoutedExperts)]


__all__ = ["MoonEPRoutedExperts", "moonep", "moonep_override", "apply_moonep", "moonep_layers",
           "OVERRIDE", "COMPUTE_DTYPE", "INNER_EXPERTS", "GPT_OSS_ALPHA"]
