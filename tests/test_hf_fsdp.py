"""FSDP2 beside expert parallelism (moonep_ops.integrations.hf.fsdp), on 4 gloo ranks, fp32.

A tiny Qwen3-MoE (E = 8, a dense first layer, the router skewed towards one expert by
test_integrations_hf's ``tiny``) converted to MoonEP and sharded by ``hf.fully_shard_dense``, against the unconverted
model under ``fully_shard`` over all 4 ranks (each decoder layer, then the root) on the same
data (rank r: micro-batch r of every step), both with AdamW:

* ``dp_shard 2 x ep 2``: the dense part FSDP over the 4 ranks (a 1-D mesh), the experts
  replicated over dp_shard (``reduce_expert_grads`` sums them over it) or sharded over it
  (``shard_experts``, torchtitan's efsdp); and HSDP (the 2-D mesh itself: replicate over
  dp_shard, shard over ep) with gradient_divide_factor=1 and each loss divided by 4;
* ``ep 4``: EP over all 4 ranks, the dense part sharded over the same 4.

Each checks: every grad of the first step (dense and expert, after ``reduce_expert_grads``)
equals the reference's, 1e-5; the total grad norm of ``hf.clip_grad_norm_`` equals the
reference's ``clip_grad_norm_`` at every step, 1e-5 relative; 5 AdamW steps (clipped) give each
rank the reference's loss, 1e-5 relative; each rank's parameter bytes are its share:

    dense:   sum over non-expert params p of rows(p.shape[0], n, i) * prod(p.shape[1:]) * 4
             (FSDP's torch.chunk split: rows(d, n, i) = clamp(d - i * ceil(d / n), 0, ceil(d / n)),
             n = the shard dim's size, i = this rank's index on it)
    experts: 3 * L_moe * E/R * D * F * 4 when replicated, with rows(E/R, n_edp, i_edp) in place
             of E/R when sharded over expert_mesh.

The meta-device path (built on meta, converted there, sharded while on meta, filled by
``hf.load_pretrained``) passes the same checks, with the experts replicated and sharded; the
user's own ``to_empty`` before ``load_pretrained`` is an expected failure (the rotary tables stay
uninitialised).  Layouts that would miss a reduction are refused before anything is sharded.
All cases run in one spawn of 4 ranks.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="transformers is not installed (the test extra pins it)")

from moonep_ops.integrations import hf  # noqa: E402
from moonep_ops.integrations.hf.fsdp import (clip_grad_norm_, fully_shard_dense,  # noqa: E402
                                             reduce_expert_grads)

from dist_harness import run_cases  # noqa: E402
from test_integrations_hf import CAP, D, E, F, TP, batch, tiny  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")

R_WORLD = 4
STEPS = 5
LR, MAX_NORM = 3e-3, 0.5
RTOL = 1e-5
NAME = "qwen3_moe"


def _rows(d: int, n: int, i: int) -> int:
    c = math.ceil(d / n)
    return max(0, min(c, d - i * c))


def _local_bytes(model) -> int:
    from torch.distributed.tensor import DTensor
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
               for p in model.parameters())


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def _reference(dp):
    """The unconverted model, fully_shard over all 4 ranks: each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard
    ref = tiny(NAME).train()
    for layer in ref.model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(ref, mesh=dp)
    return ref


def _step(model, ids, scale=1.0):
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    (out.loss * scale).backward()
    return out.loss.detach()


def _ours_name(ref_name: str) -> str:
    return ref_name.replace(".mlp.gate.weight", ".mlp.moe.router.gate.weight")


def _check_grads(model, ref, ep_rank: int, R: int):
    """Every grad of ``model`` (after reduce_expert_grads) against the reference's."""
    sl = slice(ep_rank * E // R, (ep_rank + 1) * E // R)
    n_checked = 0
    for name, p in ref.named_parameters():              # the same order on every rank
        g = _full(p.grad)
        if name.endswith("experts.gate_up_proj"):
            blk = name[:-len(".experts.gate_up_proj")]
            pairs = [(f"{blk}.moe.w1", g[sl, :F]), (f"{blk}.moe.w3", g[sl, F:])]
        elif name.endswith("experts.down_proj"):
            pairs = [(name[:-len(".experts.down_proj")] + ".moe.w2", g[sl])]
        else:
            pairs = [(_ours_name(name), g)]
        for ours, want in pairs:
            got = _full(model.get_parameter(ours).grad)
            err = (got - want).abs().max().item()
            assert err <= 1e-5 * max(1.0, want.abs().max().item()), (ours, err)
            n_checked += 1
    return n_checked


def _train_and_compare(ctx, model, ref, ep_rank: int, R: int, scale: float = 1.0):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        ids = batch(ctx.rank, step)
        loss = _step(model, ids, scale)
        reduce_expert_grads(model)
        rloss = _step(ref, ids)
        if step == 0:
            assert _check_grads(model, ref, ep_rank, R) > 10
        norm = clip_grad_norm_(model, MAX_NORM)
        rnorm = _full(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        assert abs(norm.item() - rnorm.item()) <= RTOL * rnorm.item(), (step, norm, rnorm)
        assert rnorm.item() > MAX_NORM                     # the clipping really scales
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        assert abs(loss.item() - rloss.item()) <= RTOL * abs(rloss.item()), (step, loss, rloss)
        losses.append(loss.item())
    assert losses[-1] != losses[0]


def _dense_share(ref_shapes, n: int, i: int, skip) -> int:
    return sum(_rows(s[0], n, i) * math.prod(s[1:]) * 4 for k, s in ref_shapes.items()
               if not skip(k))


def _is_expert(name: str) -> bool:
    return name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def _case(ctx, *, ep: int, shard_experts: bool = False, hsdp: bool = False,
          summed: bool = False):
    """summed: gradient_divide_factor=1 (grads are sums) and each rank's loss divided by N
    before backward (torchtitan's convention): the same grads as the mean."""
    from torch.distributed.device_mesh import init_device_mesh
    assert ctx.R == R_WORLD
    dp_shard = R_WORLD // ep
    mesh = init_device_mesh("cpu", (dp_shard, ep), mesh_dim_names=("dp_shard", "ep"))
    world = init_device_mesh("cpu", (R_WORLD,), mesh_dim_names=("dp",))
    if hsdp:
        dense_mesh, n, i = mesh, ep, mesh["ep"].get_local_rank()
    else:
        dense_mesh, n, i = world, R_WORLD, ctx.rank
    expert_mesh = mesh["dp_shard"] if dp_shard > 1 else None
    ref_shapes = {k: tuple(v.shape) for k, v in tiny(NAME).named_parameters()}
    n_moe = sum(k.endswith("experts.gate_up_proj") for k in ref_shapes)

    model = tiny(NAME).train()
    hf.convert_model(model, group=mesh["ep"].get_group(), capacity=CAP, token_padding=TP)
    fully_shard_dense(model, dense_mesh, expert_mesh=expert_mesh, shard_experts=shard_experts,
                      gradient_divide_factor=1.0 if summed else None)
    ref = _reference(world)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    assert isinstance(model, FSDPModule)
    assert all(isinstance(layer, FSDPModule) for layer in model.model.layers)
    experts = [model.get_parameter(n) for n in hf.expert_parameter_names(model)]
    assert experts and all(isinstance(p, DTensor) == shard_experts for p in experts)
    assert all(isinstance(p, DTensor) for n, p in model.named_parameters() if ".moe.w" not in n)

    # parameter bytes: each rank its share
    B = E // ep
    if shard_experts:
        j = mesh["dp_shard"].get_local_rank()
        expert_bytes = n_moe * 3 * _rows(B, dp_shard, j) * D * F * 4
    else:
        expert_bytes = n_moe * 3 * B * D * F * 4
    dense_bytes = _dense_share(ref_shapes, n, i, _is_expert)
    assert _local_bytes(model) == dense_bytes + expert_bytes
    assert _local_bytes(ref) == _dense_share(ref_shapes, R_WORLD, ctx.rank, lambda k: False)
    totals = torch.tensor([_local_bytes(model)], dtype=torch.float64)
    dist.all_reduce(totals)
    all_bytes = sum(math.prod(s) * 4 for s in ref_shapes.values())
    expert_all = sum(math.prod(s) * 4 for k, s in ref_shapes.items() if _is_expert(k))
    copies = (1 if shard_experts else dp_shard, dp_shard if hsdp else 1)   # (experts, dense)
    assert totals.item() == (all_bytes - expert_all) * copies[1] + expert_all * copies[0]

    _train_and_compare(ctx, model, ref, mesh["ep"].get_local_rank(), ep,
                       scale=1.0 / R_WORLD if summed else 1.0)
    next(iter(hf.converted_blocks(model).values())).moe.buffer.destroy()


def _meta_case(ctx, *, to_empty: bool, shard_experts: bool = False):
    """The at-scale path: the model built on the meta device, converted there (each rank
    allocates its experts only), sharded while still on meta, then filled from a transformers
    checkpoint by ``hf.load_pretrained`` -- which materialises it (``to_empty``) itself, or after
    the user's own ``model.to_empty``; then trained as the materialised cases."""
    import shutil
    import tempfile

    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from test_integrations_hf import TINY, make_config
    path = [tempfile.mkdtemp(prefix="moonep_fsdp_") if ctx.rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    path = path[0]
    try:
        if ctx.rank == 0:
            tiny(NAME).save_pretrained(path)
        dist.barrier()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
        world = init_device_mesh("cpu", (R_WORLD,), mesh_dim_names=("dp",))
        with torch.device("meta"):
            model = getattr(transformers, TINY[NAME][1])(make_config(NAME))
        hf.convert_model(model, group=mesh["ep"].get_group(), capacity=CAP, token_padding=TP,
                         device="cpu")
        fully_shard_dense(model, world, expert_mesh=mesh["dp_shard"], shard_experts=shard_experts)
        dense = [p for n, p in model.named_parameters() if ".moe.w" not in n]
        assert all(isinstance(p, DTensor) for p in dense)
        assert any(p.is_meta for p in dense)
        if to_empty:
            model.to_empty(device="cpu")
            assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
        hf.load_pretrained(model, path)
        model.train()
        want = dict(tiny(NAME).named_buffers())
        for name, b in model.named_buffers():     # rotary tables: transformers recomputes them
            if name in want:
                assert torch.equal(b, want[name]), f"buffer {name} differs after loading"
        ref_shapes = {k: tuple(v.shape) for k, v in tiny(NAME).named_parameters()}
        n_moe = sum(k.endswith("experts.gate_up_proj") for k in ref_shapes)
        B = E // 4 if shard_experts else E // 2
        assert _local_bytes(model) == (_dense_share(ref_shapes, R_WORLD, ctx.rank, _is_expert)
                                       + n_moe * 3 * B * D * F * 4)
        ref = _reference(world)
        _train_and_compare(ctx, model, ref, mesh["ep"].get_local_rank(), 2)
        next(iter(hf.converted_blocks(model).values())).moe.buffer.destroy()
    finally:
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def case_meta_load_materialises(ctx):
    _meta_case(ctx, to_empty=False)


def case_meta_to_empty_then_load(ctx):
    _meta_case(ctx, to_empty=True)


def case_meta_sharded_experts(ctx):
    _meta_case(ctx, to_empty=False, shard_experts=True)


def case_dp_shard2_ep2(ctx):
    _case(ctx, ep=2)


def case_dp_shard2_ep2_sharded_experts(ctx):
    _case(ctx, ep=2, shard_experts=True)


def case_dp_shard2_ep2_hsdp_summed(ctx):
    _case(ctx, ep=2, hsdp=True, summed=True)


def case_ep4(ctx):
    _case(ctx, ep=4)


def case_refusals(ctx):
    """Layouts where some rank's micro-batch would miss a reduction, refused before anything is
    sharded; reduce_expert_grads on a model fully_shard_dense did not shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    world = init_device_mesh("cpu", (R_WORLD,), mesh_dim_names=("dp",))
    model = tiny(NAME)
    hf.convert_model(model, group=mesh["ep"].get_group(), capacity=CAP, token_padding=TP)
    types = [(n, type(m)) for n, m in model.named_modules()]
    with pytest.raises(ValueError, match=r"N=4 ranks, but EP groups of R=2 ranks times "
                       r"expert_mesh's 1 replica\(s\) make 2"):
        fully_shard_dense(model, world)                                 # no expert_mesh
    with pytest.raises(ValueError, match=r"must lie in the dense mesh"):
        fully_shard_dense(model, mesh["dp_shard"])                      # dense misses ep ranks
    with pytest.raises(ValueError, match=r"shard_experts needs expert_mesh"):
        fully_shard_dense(model, world, shard_experts=True)
    with pytest.raises(ValueError, match=r"param_dtype=torch.bfloat16 but the MoonEP layers"):
        fully_shard_dense(model, world, expert_mesh=mesh["dp_shard"],
                          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"not sharded by hf.fully_shard_dense"):
        reduce_expert_grads(model)
    assert [(n, type(m)) for n, m in model.named_modules()] == types      # nothing sharded
    # a Router that balances (Quantile Balancing, off in every family) averages over all ranks
    routers = [b.moe.router for b in hf.converted_blocks(model).values()]
    assert all(r.balance_rate == 0 for r in routers)
    routers[0].balance_rate = 0.1
    fully_shard_dense(model, world, expert_mesh=mesh["dp_shard"])
    assert dist.get_process_group_ranks(routers[0].balance_group) == list(range(R_WORLD))
    next(iter(hf.converted_blocks(model).values())).moe.buffer.destroy()


CASES = ["case_dp_shard2_ep2", "case_dp_shard2_ep2_sharded_experts",
         "case_dp_shard2_ep2_hsdp_summed", "case_ep4", "case_meta_load_materialises",
         "case_meta_to_empty_then_load", "case_meta_sharded_experts", "case_refusals"]
_results = {}


def _run():
    if not _results:
        _results.update(run_cases(R_WORLD, __name__, CASES, timeout_s=300, pg_timeout_s=120))
    return _results


@pytest.mark.parametrize("case", CASES)
def test_fsdp_beside_ep(case):
    res = _run()[case]
    assert res.ok, res.error
