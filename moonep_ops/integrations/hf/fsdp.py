"""FSDP2 beside expert parallelism: shard everything but the routed experts with ``fully_shard``.

    mesh = init_device_mesh("cuda", (N // ep, ep), mesh_dim_names=("dp_shard", "ep"))
    dp = init_device_mesh("cuda", (N,), mesh_dim_names=("dp",))   # every rank: its micro-batch
    hf.convert_model(model, group=mesh["ep"].get_group(), capacity=S)
    hf.fully_shard_dense(model, dp, expert_mesh=mesh["dp_shard"])  # None when ep == N
    opt = torch.optim.AdamW(model.parameters(), lr=...)
    for ids in batches:                                    # each rank its own micro-batch
        model(input_ids=ids, labels=ids).loss.backward()
        hf.reduce_expert_grads(model)                      # after the last backward of a step
        hf.clip_grad_norm_(model, 1.0)                     # optional
        opt.step(); opt.zero_grad()

Ranks.  The N ranks of the dense mesh each run their own micro-batch: they are the data-parallel
ranks.  An EP group of R ranks (the model's MoonEP group) holds all E experts, E/R per rank; the
N / R ranks that hold the same experts as this rank (one per EP group: the ``dp_shard`` dim of a
``dp_shard x ep`` mesh) form ``expert_mesh`` (None when R = N: EP spans every rank).

Grads.  FSDP reduces the dense grads (embeddings, attention, dense MLPs, norms, routers, shared
experts) over the N ranks and divides them by its gradient divide factor f (default N: the grad
of the mean of the ranks' losses).  A routed expert's grad already holds the sum over its EP
group's R ranks of their contributions (MoonEP's backward adds them), so the expert grads need:

* a sum over ``expert_mesh`` (the other EP groups' sums for the same experts), which makes the
  sum over all N ranks -- no communication when R = N;
* a division by the same f;
* and nothing else: a reduction over the EP group (or over all N ranks) would count every
  contribution R times again.

``reduce_expert_grads(model)`` does exactly that, once per optimizer step (it is linear: after
several accumulated backwards it reduces the accumulated grads once).  With
``shard_experts=True`` (torchtitan's efsdp) the experts are ``fully_shard``-ed over
``expert_mesh`` instead: FSDP sums their grads over it and divides them by f, and
``reduce_expert_grads`` has nothing left to do.  The built-in Router's ``expert_bias`` (a
buffer, never updated here: every transformers family runs with Quantile Balancing off) is not
sharded and stays the same on every rank.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...nn.router import Router
from .convert import converted_blocks, expert_parameter_names

_ATTR = "_moonep_fsdp"


@dataclasses.dataclass(frozen=True)
class FSDPLayout:
    """How ``fully_shard_dense`` laid out a converted model (``model._moonep_fsdp``).

    ``dense_size``: N, the ranks of the dense mesh; ``ep_size``: R, the EP group's size
    (``ep_group``); ``expert_replicas``: N / R, the ranks holding this rank's experts
    (``expert_group`` over them, None when 1);
    ``shard_experts``: the experts are FSDP-sharded over those ranks; ``divide_factor``: f, the
    factor every grad is divided by (FSDP's for the dense part, ``reduce_expert_grads``'s for
    the experts)."""
    dense_size: int
    ep_size: int
    ep_group: Optional[dist.ProcessGroup]
    expert_replicas: int
    expert_group: Optional[dist.ProcessGroup]
    shard_experts: bool
    divide_factor: float


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (the classes transformers lists in ``_no_split_modules``), the
    FSDP units below the root."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if m is not model and type(m).__name__ in names]


def _mesh_ranks(mesh) -> set[int]:
    return set(mesh.mesh.flatten().tolist())


def _ep_group(model: nn.Module):
    blocks = converted_blocks(model).values()
    if any(b.moe.buffer is None for b in blocks):
        raise ValueError("the converted blocks have no Buffer (a shape-only conversion, "
                         "device='meta'); convert over the EP process group first")
    groups = {id(b.moe.buffer.group): b.moe.buffer for b in blocks}
    if len(groups) > 1:
        raise ValueError("the converted blocks use several EP groups; fully_shard_dense takes a "
                         "model converted over one group")
    buf = next(iter(groups.values()))
    return buf.group, buf.R


def _divide_by(unit, f: float) -> None:
    """FSDP's reduction of ``unit``: the sum over its mesh, divided by f.  A factor other than
    the mesh size would use NCCL's PreMulSum, which gloo lacks: a plain sum and one division
    (none for f = 1) serve every backend."""
    unit.set_gradient_divide_factor(f)
    unit.set_force_sum_reduction_for_comms(True)


def _not_a_view(module, args, out):
    # FSDP hangs the unit's pre-backward hook (the experts' all-gather) on its output; the layer
    # returns a view, which an in-place op downstream would replace, losing the hook.
    return out.clone() if isinstance(out, Tensor) and out._is_view() else out


def fully_shard_dense(model: nn.Module, mesh, *, expert_mesh=None, shard_experts: bool = False,
                      reshard_after_forward: Optional[bool] = None, mp_policy=None,
                      offload_policy=None,
                      gradient_divide_factor: Optional[float] = None) -> nn.Module:
    """``fully_shard`` everything of a converted model except the routed experts, in place.

    Each decoder layer (the model's ``_no_split_modules`` classes) and then the root become FSDP
    units over ``mesh``; the routed experts (``expert_parameter_names``) are left out of them
    (``ignored_params``): each rank keeps its E/R home experts as plain tensors.  Collective
    over ``mesh``.

    Args:
      mesh: the dense part's data-parallel DeviceMesh over all N ranks that run their own
        micro-batch: 1-D (FSDP over N) or 2-D (HSDP: replicate over dim 0, shard over dim 1).
        It must contain the model's EP group.
      expert_mesh: the 1-D mesh of the N / R ranks that hold this rank's experts (the
        ``dp_shard`` dim of a ``dp_shard x ep`` mesh); None when the EP group is all N ranks.
      shard_experts: also shard the experts, over ``expert_mesh`` (one FSDP unit per MoE layer;
        the router and shared experts become a unit of their own over ``mesh``).
      reshard_after_forward, mp_policy, offload_policy: ``fully_shard``'s, for every unit
        (reshard_after_forward None: FSDP's default, reshard all but the root).
        ``mp_policy.param_dtype`` must be None or the experts' dtype (a MoonEP layer computes in
        the dtype it was converted in).
      gradient_divide_factor: f, the divisor of every grad after the sum over the N ranks
        (None: N, FSDP's default, i.e. the grad of the mean loss; 1.0: the sum).  Set on every
        FSDP unit made here, and used by ``reduce_expert_grads``.

    Returns ``model``.  Call ``reduce_expert_grads(model)`` after the backward of every step.
    """
    from torch.distributed.fsdp import fully_shard
    blocks = converted_blocks(model)
    N = mesh.size()
    if blocks:
        ep_group, R = _ep_group(model)
    else:
        ep_group, R = None, N
    if mesh.ndim not in (1, 2):
        raise ValueError(f"mesh must be 1-D (FSDP) or 2-D (HSDP), got {mesh.ndim}-D")
    replicas = 1 if expert_mesh is None else expert_mesh.size()
    if expert_mesh is not None and expert_mesh.ndim != 1:
        raise ValueError(f"expert_mesh must be 1-D, got {expert_mesh.ndim}-D")
    if shard_experts and expert_mesh is None:
        raise ValueError("shard_experts needs expert_mesh (the ranks holding the same experts)")
    if R * replicas != N:
        raise ValueError(f"the dense mesh has N={N} ranks, but EP groups of R={R} ranks times "
                         f"expert_mesh's {replicas} replica(s) make {R * replicas}: every "
                         "data-parallel rank must hold E/R experts of one EP group "
                         "(expert_mesh=None only when EP spans the dense mesh)")
    dense = _mesh_ranks(mesh)
    if blocks and dist.is_initialized():
        me = dist.get_rank()
        ep = set(dist.get_process_group_ranks(ep_group)) if ep_group is not None else {me}
        edp = _mesh_ranks(expert_mesh) if expert_mesh is not None else {me}
        if not ep <= dense or not edp <= dense or ep & edp != {me}:
            raise ValueError(f"rank {me}: the EP group {sorted(ep)} and expert_mesh "
                             f"{sorted(edp)} must lie in the dense mesh {sorted(dense)} and "
                             "meet in this rank only")
    dtypes = {b.moe.dtype for b in blocks.values()}
    pdt = getattr(mp_policy, "param_dtype", None)
    if pdt is not None and dtypes - {pdt}:
        raise ValueError(f"mp_policy.param_dtype={pdt} but the MoonEP layers compute in "
                         f"{sorted(map(str, dtypes))}; convert the model in the compute dtype")
    # A Router's Quantile Balancing (off in every transformers family) averages its quantiles
    # over balance_group, the EP group by default: beside data parallelism over more ranks
    # every copy of expert_bias must see all N ranks' tokens.
    balancing = [b.moe.router for b in blocks.values()
                 if isinstance(b.moe.router, Router) and b.moe.router.balance_rate > 0]
    if balancing and mesh.ndim != 1:
        raise NotImplementedError("Quantile Balancing beside HSDP: the routers' balance group "
                                  "must span the whole 2-D mesh; use a 1-D dense mesh")
    for router in balancing:
        router.balance_group = mesh.get_group()

    kw = dict(reshard_after_forward=reshard_after_forward)
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if offload_policy is not None:
        kw["offload_policy"] = offload_policy
    experts = {model.get_parameter(n) for n in expert_parameter_names(model)}
    f = float(N if gradient_divide_factor is None else gradient_divide_factor)
    units = []                          # FSDP units over ``mesh``: FSDP's divide factor is N
    if shard_experts:
        for b in blocks.values():
            moe = b.moe
            rest = [m for m in (moe.router, moe.shared, moe.shared_gate)
                    if m is not None and any(True for _ in m.parameters())]
            if rest:                    # claimed first: they belong to the dense mesh
                units.append(fully_shard(rest, mesh=mesh, **kw))
            # the experts alone: FSDP sums them over expert_mesh and divides by f, not by
            # expert_mesh's size
            _divide_by(fully_shard(moe, mesh=expert_mesh, **kw), f)
            moe.register_forward_hook(_not_a_view, prepend=True)
        ignored = None
    else:
        ignored = experts or None
    for layer in _decoder_layers(model):
        units.append(fully_shard(layer, mesh=mesh, ignored_params=ignored, **kw))
    units.append(fully_shard(model, mesh=mesh, ignored_params=ignored, **kw))
    if gradient_divide_factor is not None:
        for u in units:
            _divide_by(u, f)
    edp_group = expert_mesh.get_group() if replicas > 1 else None
    setattr(model, _ATTR, FSDPLayout(N, R, ep_group, replicas, edp_group, shard_experts, f))
    return model


def fsdp_layout(model: nn.Module) -> FSDPLayout:
    """The layout ``fully_shard_dense`` gave ``model`` (ValueError if it was not applied)."""
    layout = getattr(model, _ATTR, None)
    if layout is None:
        raise ValueError("the model was not sharded by hf.fully_shard_dense")
    return layout


@torch.no_grad()
def reduce_expert_grads(model: nn.Module) -> None:
    """Collective over the ranks holding the same experts: turn the routed experts' grads into
    what FSDP makes of the dense ones -- the sum over all N data-parallel ranks, divided by f.

    Call once per optimizer step, after the last backward (and before clipping / ``step``).
    Replicated experts: all-reduce (sum) over ``expert_mesh`` (skipped when EP spans the dense
    mesh), then divide by f.  Sharded experts (``shard_experts``): FSDP has already summed them
    over ``expert_mesh`` and divided by f; nothing to do.  Never reduces over the EP group: the
    grads already hold its ranks' sum."""
    layout = fsdp_layout(model)
    if layout.shard_experts:
        return
    grads = [g for g in (model.get_parameter(n).grad for n in expert_parameter_names(model))
             if g is not None]
    if layout.expert_group is not None:
        works = [dist.all_reduce(g, group=layout.expert_group, async_op=True) for g in grads]
        for w in works:
            w.wait()
    if layout.divide_factor != 1.0:
        torch._foreach_div_(grads, layout.divide_factor)


def _norm(grads: list[Tensor], p: float, device: torch.device) -> Tensor:
    """The p-norm of ``grads`` (DTensors: over their whole mesh), fp32, on ``device``."""
    from torch.distributed.tensor import DTensor
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    n = torch.nn.utils.get_total_norm(grads, p)
    return (n.full_tensor() if isinstance(n, DTensor) else n).float()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model sharded by ``fully_shard_dense`` (after
    ``reduce_expert_grads``): the norm of the whole model's grads -- the dense DTensors' and
    every expert once (the EP group's ranks hold distinct experts, their replicas the same ones)
    -- and every grad scaled by ``min(1, max_norm / norm)``.  Collective over the dense mesh;
    returns the total norm (a plain tensor, the same on every rank)."""
    layout = fsdp_layout(model)
    expert_names = set(expert_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    dense = [p for n, p in named if n not in expert_names]
    experts = [p for n, p in named if n in expert_names]
    p = float(norm_type)
    device = next(model.parameters()).device
    dense_norm = _norm([q.grad for q in dense], p, device)
    expert_norm = _norm([q.grad for q in experts], p, device)
    if layout.ep_size > 1:             # the EP group's ranks hold distinct experts
        if math.isinf(p):
            dist.all_reduce(expert_norm, op=dist.ReduceOp.MAX, group=layout.ep_group)
        else:
            expert_norm = expert_norm ** p
            dist.all_reduce(expert_norm, group=layout.ep_group)
            expert_norm = expert_norm ** (1.0 / p)
    if math.isinf(p):
        total = torch.maximum(dense_norm, expert_norm)
    else:
        total = (dense_norm ** p + expert_norm ** p) ** (1.0 / p)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
    for params in (dense, experts):
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


__all__ = ["FSDPLayout", "clip_grad_norm_", "fsdp_layout", "fully_shard_dense",
           "reduce_expert_grads"]
