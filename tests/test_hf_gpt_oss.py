"""gpt-oss (transformers ``gpt_oss``) converted to MoonEP: biased experts, the clamped SwiGLU,
the interleaved transposed gate/up layout, the biased top-k-first router; attention sinks and
attention untouched.

A tiny gpt-oss (sliding and full attention, random sinks, swiglu_limit small enough that both
clamps bind, a router skewed so that the planner replicates the hot expert), fp32, gloo:
* R = 1, 2, 4: logits, loss, aux loss, router logits and every grad (input embeddings, every
  replicated parameter, the expert weights and biases: the sum over the ranks) equal the
  unconverted model's within 1e-5 on each rank's batch; full_state_dict equals the unconverted
  state dict bitwise, and a converted model loads both its shard and the full layout;
* R = 2: torch.compile(model, fullgraph=True) equals eager, one graph, no recompile on new
  routings;
* R = 2, 4: the at-scale recipe: a meta build + convert_model + hf.load_pretrained of a
  transformers checkpoint gives from_pretrained's results bitwise, reading about its share; after
  a training step hf.save_pretrained writes a checkpoint that plain from_pretrained loads
  bitwise (the fused expert tensors gathered over the EP group); R = 2 under fully_shard_dense;
* the router options reproduce GptOssTopKRouter bitwise; bad swiglu options are refused; the
  memory plan of the published gpt-oss-120b config; on a GPU (skipped here) bf16 logits.
"""
from __future__ import annotations

import copy
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from moonep_ops.integrations import hf  # noqa: E402

from dist_harness import cached_runner, multi_rank_cases  # noqa: E402
from test_hf_at_scale import _barrier, _destroy, _share_bytes, _shared_dir  # noqa: E402
from test_integrations_hf import (BATCH, CAP, D, E, F, HOT, K, SEQ, TP, V,  # noqa: E402
                                  assert_same_state, batch, maxdiff)

warnings.filterwarnings("ignore", module="transformers")
TOL = 1e-5
LIMIT = 0.5


def config(**kw):
    return transformers.GptOssConfig(**{**dict(
        vocab_size=V, hidden_size=D, intermediate_size=F, num_local_experts=E,
        num_experts_per_tok=K, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=8,
        tie_word_embeddings=False, experts_implementation="eager", attn_implementation="eager",
        router_aux_loss_coef=0.1, swiglu_limit=LIMIT,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), **kw})


def tiny(seed=0):
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config()).eval()
    g = torch.Generator().manual_seed(seed + 1)
    mu = torch.randn(D, generator=g)
    mu /= mu.norm()
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape, generator=g) + 3.0 * mu)
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=g) * 0.1)
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g))
            for pname, p in layer.mlp.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.25 if "router" in pname else 0.07))
            layer.mlp.router.weight[HOT] += 1.5 * mu
    return model


def run(model, ids, **kw):
    emb = model.get_input_embeddings()(ids)
    emb.retain_grad()
    out = model(inputs_embeds=emb, labels=ids, output_router_logits=True, **kw)
    out.loss.backward()
    return out, emb.grad


def compare(ref, model, ids, group, call=None, **kw):
    """The converted model against the unconverted one on this rank's batch; returns the
    largest difference seen (all must be <= TOL)."""
    want, gx_want = run(ref, ids, **kw)
    got, gx_got = run(model if call is None else call, ids, **kw)
    diffs = {"logits": maxdiff(got.logits, want.logits), "loss": maxdiff(got.loss, want.loss),
             "aux_loss": maxdiff(got.aux_loss, want.aux_loss),
             "d inputs_embeds": maxdiff(gx_got, gx_want)}
    assert want.aux_loss is not None and len(got.router_logits) == len(want.router_logits) == 2
    for i, (a, b) in enumerate(zip(got.router_logits, want.router_logits)):
        assert a.shape == b.shape == (ids.numel(), E) and a.requires_grad
        diffs[f"router_logits[{i}]"] = maxdiff(a, b)
    blocks = hf.converted_blocks(model)
    for pname, p in ref.named_parameters():
        owner = pname.rsplit(".mlp.", 1)[0] + ".mlp" if ".mlp." in pname else None
        if owner not in blocks:
            diffs[pname] = maxdiff(model.get_parameter(pname).grad, p.grad)
            continue
        blk, key = blocks[owner], pname.split(".mlp.", 1)[1]
        g = p.grad.clone()
        if key.startswith("experts.") and group is not None:
            dist.all_reduce(g, group=group)            # expert grads: every rank's sum
        lo, hi = blk.moe.owned_experts().start, blk.moe.owned_experts().stop
        for target, part in zip(blk.family.key_map()[key], blk.family.to_moe(key, g)):
            if key.startswith("experts."):
                part = part[lo:hi]
            diffs[f"{pname} -> {target}"] = maxdiff(blk.moe.get_parameter(target).grad, part)
    bad = {k: v for k, v in diffs.items() if not v <= TOL}
    assert not bad, bad
    return max(diffs.values())


def slot_rows_used(model):
    """Slot rows of this rank's pool that hold a prefetched expert (weights and biases) after a
    step: the planner replicated the hot expert here."""
    from moonep_ops import registry
    from moonep_ops.ops.moe_experts import ExpertPool
    moe = next(iter(hf.converted_blocks(model).values())).moe
    pool = registry.lookup(moe.pool_name, ExpertPool)
    used = pool.w1.flatten(1).abs().sum(1) > 0
    assert torch.equal(used, pool.b1.abs().sum(1) > 0)      # the biases travelled with them
    return int(used.sum())


def case_equivalence(ctx):
    model = tiny()
    ref = copy.deepcopy(model)
    group = ctx.group if ctx.R > 1 else None
    hf.convert_model(model, group=ctx.group, capacity=CAP, token_padding=TP)
    for layer in model.model.layers:                  # attention and sinks untouched
        assert type(layer.self_attn).__name__ == "GptOssAttention"
        assert isinstance(layer.mlp, hf.MoonEPBlock)
    worst = compare(ref, model, batch(ctx.rank), group)
    print(f"[gpt_oss R={ctx.R} rank {ctx.rank}] max diff {worst:.2e}")
    if ctx.R > 1:
        used = torch.tensor([slot_rows_used(model)])
        dist.all_reduce(used, group=ctx.group)            # some rank ran a replica
        assert used.item() > 0
    full = hf.full_state_dict(model)
    assert_same_state(full, ref.state_dict())
    fresh = tiny(seed=99)
    fresh.load_state_dict(full, strict=True)
    other = tiny(seed=98)
    hf.convert_model(other, group=ctx.group, capacity=CAP, token_padding=TP)
    other.load_state_dict(model.state_dict(), strict=True)         # the shard layout
    assert_same_state(hf.full_state_dict(other), full)
    other.load_state_dict(full, strict=True)                       # the HF layout
    assert_same_state(hf.full_state_dict(other), full)
    with torch.no_grad():
        ids = batch(ctx.rank, step=1)
        assert torch.equal(fresh(input_ids=ids).logits, ref(input_ids=ids).logits)
        assert maxdiff(other(input_ids=ids).logits, ref(input_ids=ids).logits) <= TOL
    _destroy(model, other)


def case_compiled(ctx):
    from torch._dynamo.testing import CompileCounterWithBackend
    model = tiny()
    ref = copy.deepcopy(model)
    hf.convert_model(model, group=ctx.group, capacity=CAP, token_padding=TP)
    with torch.no_grad():
        model(input_ids=batch(ctx.rank), output_router_logits=True)   # HF installs its hooks
    torch._dynamo.reset()
    cnt = CompileCounterWithBackend("aot_eager")
    cmodel = torch.compile(model, backend=cnt, fullgraph=True)
    try:
        for step in range(3):
            compare(ref, model, batch(ctx.rank, step), ctx.group, call=cmodel, use_cache=False)
            ref.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            if step == 0:
                torch.compiler.set_stance("fail_on_recompile")
    finally:
        torch.compiler.set_stance("default")
    assert cnt.frame_count == 1
    _destroy(model)


def case_checkpoints(ctx):
    """The at-scale recipe: meta build, sharded load, a training step, sharded save."""
    path = _shared_dir(ctx)
    if ctx.rank == 0:
        tiny().save_pretrained(path)
    _barrier(ctx)
    want = transformers.AutoModelForCausalLM.from_pretrained(path)
    hf.convert_model(want, group=ctx.group, capacity=CAP, token_padding=TP)
    with torch.device("meta"):
        got = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(path))
    hf.convert_model(got, group=ctx.group, capacity=CAP, token_padding=TP, device="cpu")
    report = hf.load_pretrained(got, path)
    share = _share_bytes(got)
    assert abs(report.bytes_read - share) <= 0.05 * share, (report.bytes_read, share)
    assert report.unexpected == ()
    ids = batch(ctx.rank)
    a = want(input_ids=ids, labels=ids)
    b = got(input_ids=ids, labels=ids)
    a.loss.backward()
    b.loss.backward()
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    ga = {n: p.grad for n, p in want.named_parameters() if p.grad is not None}
    gb = {n: p.grad for n, p in got.named_parameters() if p.grad is not None}
    assert list(ga) == list(gb) and all(torch.equal(ga[n], gb[n]) for n in ga)
    experts = set(hf.expert_parameter_names(got))
    assert {n.rsplit(".", 1)[1] for n in experts} == {"w1", "w3", "w2", "b1", "b3", "b2"}
    for n, p in got.named_parameters():            # the replicated parameters: DP's mean
        if n not in experts and p.grad is not None and ctx.R > 1:
            dist.all_reduce(p.grad, group=ctx.group)
            p.grad /= ctx.R
    torch.optim.SGD(got.parameters(), lr=0.1).step()
    full = hf.full_state_dict(got)
    out = _shared_dir(ctx)
    hf.save_pretrained(got, out, max_shard_size="30KB")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    sd = reloaded.state_dict()
    assert list(sd) == list(full) and all(torch.equal(sd[k], full[k]) for k in full)
    fresh = transformers.AutoModelForCausalLM.from_pretrained(path)
    fresh.load_state_dict(full, strict=True)
    with torch.no_grad():
        ids = batch(ctx.rank, step=1)
        assert torch.equal(reloaded(input_ids=ids).logits, fresh(input_ids=ids).logits)
        assert maxdiff(got(input_ids=ids).logits, fresh(input_ids=ids).logits) <= TOL
    _destroy(want, got)
    _barrier(ctx)
    if ctx.rank == 0:
        shutil.rmtree(path)
        shutil.rmtree(out)


def case_fsdp_dense(ctx):
    """hf.fully_shard_dense over the EP group (FSDP2 on everything but the experts and their
    biases): the unconverted model's loss and logits, the expert grads (weights and biases) the
    sum over the ranks, and save_pretrained of the FSDP model reloads bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    model = tiny()
    ref = copy.deepcopy(model)
    hf.convert_model(model, group=ctx.group, capacity=CAP, token_padding=TP)
    hf.fully_shard_dense(model, init_device_mesh("cpu", (ctx.R,)))
    ids = batch(ctx.rank)
    a, b = ref(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    a.loss.backward()
    b.loss.backward()
    assert maxdiff(a.loss, b.loss) <= TOL and maxdiff(a.logits, b.logits) <= TOL
    for name, blk in hf.converted_blocks(model).items():
        lo, hi = blk.moe.owned_experts().start, blk.moe.owned_experts().stop
        for key in blk.family.expert_keys():
            g = ref.get_parameter(f"{name}.{key}").grad.clone()
            dist.all_reduce(g, group=ctx.group)
            for target, part in zip(blk.family.key_map()[key], blk.family.to_moe(key, g)):
                assert maxdiff(blk.moe.get_parameter(target).grad, part[lo:hi]) <= TOL, target
    out = _shared_dir(ctx)
    hf.save_pretrained(model, out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    want = ref.state_dict()
    assert list(reloaded) == list(want) and all(torch.equal(reloaded[k], want[k]) for k in want)
    _destroy(model)
    _barrier(ctx)
    if ctx.rank == 0:
        shutil.rmtree(out)


MULTI_RANK = multi_rank_cases(globals(), ranks=(1, 2, 4),
                              only_at={"case_compiled": (2,), "case_checkpoints": (2, 4),
                                       "case_fsdp_dense": (2,)})
_results = cached_runner(__name__, MULTI_RANK, timeout_s=420, pg_timeout_s=120)


@pytest.mark.parametrize("R,case", MULTI_RANK)
def test_multi_rank(R, case):
    res = _results(R)[case]
    assert res.ok, res.error


def test_router_args_reproduce_the_hf_router():
    from moonep_ops.nn.router import Router
    model = tiny()
    blk = model.model.layers[0].mlp
    router = Router(D, E, K, **{k: v for k, v in hf.router_args(model.config).items()
                                if k not in ("num_experts", "top_k")}, dtype=torch.float32)
    router.gate.load_state_dict({"weight": blk.router.weight, "bias": blk.router.bias})
    x = torch.randn(BATCH * SEQ, D)
    logits, scores, ids = blk.router(x)
    got_ids, got_w, got_logits = router(x)
    assert torch.equal(got_ids.long(), ids) and torch.equal(got_w, scores)
    assert torch.equal(got_logits, logits)


def test_bad_gpt_oss_options_are_refused():
    model = tiny()
    model.config.swiglu_limit = -1.0
    for layer in model.model.layers:
        layer.mlp.experts.limit = -1.0
    with pytest.raises(ValueError, match="finite limit > 0"):
        hf.convert_model(model, capacity=CAP)
    model = tiny()
    model.config.swiglu_limit = 3.0                  # the experts still run with LIMIT
    with pytest.raises(ValueError, match="swiglu_limit"):
        hf.convert_model(model, capacity=CAP)
    assert all(type(layer.mlp).__name__ == "GptOssMLP" for layer in model.model.layers)


def test_memory_plan_of_gpt_oss_120b():
    """The memory plan builds and converts the published gpt-oss-120b config: the model card's
    116.8B parameters, every rank E/R of each block's experts and their biases."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    out = subprocess.run([sys.executable, "-m", "moonep_ops.integrations.hf.memory", "--model",
                          "gpt-oss-120b", "--ep", "8", "--json"], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    p = json.loads(out.stdout)
    L, E, D, F = 36, 128, 2880, 2880
    assert p["total_params"] == 116_829_156_672
    assert p["expert_params_total"] == L * E * (3 * D * F + 2 * F + D)
    assert p["parts"]["experts"]["numel"] * 8 == p["expert_params_total"]



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and the moonep libraries")
def test_cuda_bf16_close_to_hf():
    """One GPU (the CUDA backend, the fused gated SwiGLU and route-weight kernels), bf16: logits
    within a few bf16 ulps of the unconverted model's, and the backward runs with finite grads."""
    from moonep_ops import native
    if native.ep() is None or native.gemm() is None:
        pytest.skip("the moonep libraries are not built")
    ref = tiny().to(device="cuda", dtype=torch.bfloat16)
    model = copy.deepcopy(ref)
    hf.convert_model(model, capacity=BATCH * SEQ, token_padding=128)
    ids = batch(0).cuda()
    with torch.no_grad():
        want = ref(input_ids=ids).logits.float()
        got = model(input_ids=ids).logits.float()
    tol = 4 * 2 ** -8 * float(want.abs().max())
    assert float((got - want).abs().max()) <= tol, (float((got - want).abs().max()), tol)
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    next(iter(hf.converted_blocks(model).values())).moe.buffer.check_errors()
