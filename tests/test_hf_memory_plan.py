"""The memory plan (moonep_ops/integrations/hf/memory.py): a real config at R = 64 in one process
(the fake process group), its numbers against the layout's formulas, FSDP shards that add up, and
a tiny model whose plan is what a real conversion, backward and AdamW step allocate."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moonep_ops import registry  # noqa: E402
from moonep_ops.geometry import align_up  # noqa: E402
from moonep_ops.integrations import hf  # noqa: E402
from moonep_ops.integrations.hf import memory  # noqa: E402
from moonep_ops.ops.moe_experts import ExpertPool  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")
ROOT = Path(__file__).resolve().parent.parent


def _nvs(S, K, tp, B):
    return align_up(S * K + (tp - 1) * 2 * B, tp)


def test_real_config_at_64_ranks_under_a_minute():
    """The command for Qwen3-30B-A3B as rank 0 of 64 (fake process group), dense part FSDP over
    the 64 ranks: the experts are exactly E/R of every block, the pool and the Buffers are the
    layout's formulas (docs/architecture.md, "Memory"), the total is the sum of its parts."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "moonep_ops.integrations.hf.memory",
                          "--model", "qwen3-30b-a3b", "--ep", "64", "--dense-fsdp", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr[-3000:]
    p = json.loads(out.stdout)
    assert wall < 60, f"the command took {wall:.1f} s"

    c = memory.CONFIGS["qwen3-30b-a3b"].fields
    L, E, K = c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"]
    D, F, R, S, tp = c["hidden_size"], c["moe_intermediate_size"], 64, 8192, 128
    B = E // R
    assert (p["R"], p["fsdp"], p["capacity"], p["token_padding"]) == (R, R, S, tp)
    assert p["total_params"] == 30_532_122_624             # transformers 5.24, this config
    assert abs(p["total_params"] / 30.5e9 - 1) < 0.002      # the model card's 30.5B
    assert p["expert_params_total"] == L * E * 3 * D * F
    parts = p["parts"]
    # experts: E/R of every block, exactly 1/R of all of them, bf16
    assert parts["experts"]["numel"] * R == p["expert_params_total"]
    assert parts["experts"]["bytes"] == 2 * L * B * 3 * D * F
    # dense part: every parameter but the experts, ceil(dim0 / 64) rows of each on rank 0
    dense_total = p["total_params"] - p["expert_params_total"]
    assert dense_total / R <= parts["dense"]["numel"] < dense_total / R * 1.01
    # grads: bf16, as large as the stored parameters; AdamW: two fp32 states of them (rank 0's
    # FSDP chunk is the padded size)
    assert parts["grads"]["bytes"] == parts["experts"]["bytes"] + parts["dense"]["bytes"]
    assert parts["optimizer"]["bytes"] == 2 * 4 * (parts["experts"]["numel"]
                                                   + parts["dense"]["numel"])
    assert parts["master"]["bytes"] == 0
    # FSDP2 in flight: the root unit (embeddings, lm_head, final norm) unsharded with its grads,
    # two decoder layers' dense parameters (computing, prefetched) and one layer's grads
    V, H, KV, hd = c["vocab_size"], c["num_attention_heads"], c["num_key_value_heads"], 128
    root = 2 * V * D + D
    layer = D * H * hd + 2 * D * KV * hd + H * hd * D + 2 * hd + 2 * D + E * D
    assert parts["fsdp in flight"]["numel"] == root + 2 * layer
    assert parts["fsdp in flight"]["bytes"] == 2 * (2 * root + 3 * layer)
    # one Buffer, one pool: slot weights + slot grads, 3 B D F each
    assert p["n_buffers"] == 1
    assert p["pool"] == 2 * 3 * B * D * F * 2
    NvS = _nvs(S, K, tp, B)
    assert p["buffer_torch"] == NvS * D * 2 + NvS * 3 * 8 + NvS * 4
    # CUDA backend: (S + NvS) D sizeof + 16 NvS + 8R + 4R(E+3), plus a peer table per region
    # (7 regions of 8R bytes) and the local epoch and error word
    assert p["buffer_symm"] == (S + NvS) * D * 2 + 16 * NvS + 8 * R + 4 * R * (E + 3) \
        + 7 * 8 * R + 8 + 16
    assert p["model_states"] == sum(v["bytes"] for v in parts.values())
    assert p["total"] == p["model_states"] + p["buffer_symm"] + p["pool"]
    assert p["left"] == {card: cap - p["total"] for card, cap in memory.CARDS.items()}


def test_fsdp_shards_add_up_to_the_dense_part():
    """Over the N ranks of the dense part's FSDP group, the unpadded chunks (optimizer states,
    master copy) add up to the whole dense part exactly; every rank stores ceil(dim0 / N) rows
    of each parameter (FSDP2's padding); the experts are the same on every rank."""
    with memory.converted("qwen3-30b-a3b", ep=1) as model:
        experts = set(hf.expert_parameter_names(model))
        dense = {n: p for n, p in model.named_parameters() if n not in experts}
        dense_numel = sum(p.numel() for p in dense.values())
        prec = memory.Precision(master=True)
        for N in (1, 7, 64):
            accs = [memory.account(model, fsdp=N, rank=r, precision=prec) for r in range(N)]
            ex = {a["parts"]["experts"].numel for a in accs}
            assert len(ex) == 1
            ex = ex.pop()
            assert sum(a["parts"]["master"].numel for a in accs) == N * ex + dense_numel
            assert sum(a["parts"]["optimizer"].numel for a in accs) == 2 * (N * ex + dense_numel)
            padded = sum(-(-p.shape[0] // N) * (p.numel() // p.shape[0]) for p in dense.values())
            assert {a["parts"]["dense"].numel for a in accs} == {padded}
            assert {a["parts"]["grads"].numel for a in accs} == {padded + ex}
        # the experts FSDP-sharded too (over the fsdp / R ranks holding them; R = 1 here)
        accs = [memory.account(model, fsdp=4, rank=r, shard_experts=True, precision=prec)
                for r in range(4)]
        whole = sum(model.get_parameter(n).numel() for n in experts)
        assert sum(a["parts"]["master"].numel for a in accs) == whole + dense_numel
        assert {a["parts"]["experts"].numel for a in accs} == {whole // 4}
        with pytest.raises(ValueError, match="needs fsdp > R"):
            memory.account(model, fsdp=1, shard_experts=True)


TINY = {
    "qwen3_moe": dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=48,
                      moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                      tie_word_embeddings=False),
    "deepseek_v3": dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
                        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8,
                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                        tie_word_embeddings=False),
}


@pytest.mark.parametrize("model_type,fp8", [(m, fp8) for m in sorted(TINY)
                                              for fp8 in ({}, dict(precision="fp8",
                                                                   fp8_weight_cache=True))])
def test_tiny_plan_is_what_a_real_conversion_allocates(model_type, fp8):
    """R = 1: the plan of the meta-built model equals what the materialised model holds after
    convert_model, a backward (grads) and an AdamW step (states in the parameters' dtype, the
    plan's --state-dtype param); in bf16, and in fp8 with the FP8 weight caches (their own part,
    not module buffers) and the fp8 pool."""
    cfg = transformers.AutoConfig.for_model(model_type, **TINY[model_type],
                                            attn_implementation="eager",
                                            experts_implementation="eager")
    S, tp = 24, 8
    prec = memory.Precision(state_dtype=None)
    with memory.converted(cfg, ep=1, capacity=S, token_padding=tp, **fp8) as meta:
        plan = memory.account(meta, precision=prec)

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.convert_model(model, capacity=S, token_padding=tp, **fp8)
    try:
        ids = torch.randint(0, cfg.vocab_size, (2, S // 2))
        model(input_ids=ids, labels=ids).loss.backward()
        params = list(model.parameters())
        assert all(p.grad is not None for p in params)
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
        opt.step()
        experts = set(hf.expert_parameter_names(model))
        named = dict(model.named_parameters())
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        caches = [b.moe.fp8_cache for b in hf.converted_blocks(model).values()]
        assert all(c is not None for c in caches) == bool(fp8)
        cached = {id(t) for c in caches if c is not None for t in c.buffers()}
        real = {
            "experts": nbytes(named[n] for n in experts),
            "dense": nbytes(p for n, p in named.items() if n not in experts),
            "module buffers": nbytes(b for b in model.buffers() if id(b) not in cached),
            "fp8 weight cache": sum(c.nbytes() for c in caches if c is not None),
            "grads": nbytes(p.grad for p in params),
            "optimizer": nbytes(opt.state[p][k] for p in params
                                for k in ("exp_avg", "exp_avg_sq")),
            "master": 0,
            "fsdp in flight": 0,
        }
        assert {k: v.bytes for k, v in plan["parts"].items()} == real
        blocks = list(hf.converted_blocks(model).values())
        buf = blocks[0].moe.buffer
        assert all(b.moe.buffer is buf for b in blocks) and plan["n_buffers"] == 1
        assert plan["buffer_torch"] == nbytes([buf.backend.recv_rows, buf.backend.recv_meta,
                                               buf.backend.recv_weights])
        pool = registry.lookup(blocks[0].moe.pool_name, ExpertPool)
        assert plan["pool"] == nbytes(pool.tensors()) == pool.nbytes()
    finally:
        for b in hf.converted_blocks(model).values():
            b.moe.buffer.destroy()


def test_fsdp_must_contain_the_ep_group(capsys):
    """hf.fully_shard_dense's layout: the dense mesh's N ranks contain the EP group (N % R == 0);
    the command says so instead of planning a layout that cannot be built."""
    with pytest.raises(SystemExit) as e:
        memory.main(["--model", "qwen3-30b-a3b", "--ep", "8", "--fsdp", "12"])
    assert e.value.code == 2 and "a multiple of the EP size R=8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        memory.main(["--model", "qwen3-30b-a3b", "--ep", "48"])
    assert "ep must divide qwen3-30b-a3b's 128 experts" in capsys.readouterr().err


def test_fsdp_arithmetic_is_what_fully_shard_makes():
    """torch's fully_shard itself, on the meta-built converted model and the fake process group,
    units as hf.fully_shard_dense makes them (decoder layers and the root, experts ignored): every
    rank's padded shard storage is the plan's dense part, its unpadded shard the optimizer's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    if torch.distributed.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    cfg = transformers.AutoConfig.for_model("deepseek_v3", **dict(TINY["deepseek_v3"],
                                                                   vocab_size=97))
    N = 4
    for rank in range(N):
        with memory.converted(cfg, ep=N, rank=rank, capacity=24, token_padding=8) as model:
            acc = memory.account(model, fsdp=N, rank=rank)
            experts = {model.get_parameter(n) for n in hf.expert_parameter_names(model)}
            mesh = init_device_mesh("cpu", (N,))
            for unit in memory._decoder_layers(model) + [model]:
                fully_shard(unit, mesh=mesh, ignored_params=experts)
            local = sum(p._local_tensor.numel() for p in model.parameters()
                        if p not in experts)
            padded = sum(fp._sharded_param_data.numel() for m in model.modules()
                         if (st := _get_module_fsdp_state(m)) and st._fsdp_param_group
                         for fp in st._fsdp_param_group.fsdp_params)
            parts = acc["parts"]
            assert padded == parts["dense"].numel
            assert local == parts["optimizer"].numel // 2 - parts["experts"].numel
        assert (local < padded) == (rank == N - 1)       # vocab 97: the last rank's is short


def test_table_row_and_report_read_the_plan():
    p = memory.plan("qwen3-30b-a3b", ep=1)
    row = memory.table_row(p)
    assert row.startswith("| qwen3-30b-a3b | 1 | replicated |")
    assert row.count("|") == memory.TABLE_HEAD.splitlines()[0].count("|")
    text = memory.report(p)
    assert "30.532 B parameters" in text and "activations (not counted)" in text


def test_fp8_weight_cache_is_its_own_part_at_deepseek_v3_ep64():
    """DeepSeek-V3 at EP 64 in precision "fp8", with and without the FP8 weight cache: the plans
    differ by exactly layers x cache_nbytes(E/R, F, D) (~0.33 GiB a layer), all of it in the
    "fp8 weight cache" part; the fp8 pool holds e4m3 slot weights with their scales and bf16 slot
    grads; the Buffer's staging is the bf16 formula (fp8 dispatch does not resize it)."""
    from moonep_ops.ops.fp8_weight_cache import cache_nbytes
    from moonep_ops.ops.quantize_fp8 import scale_cols
    c = memory.CONFIGS["deepseek-v3"].fields
    L = c["num_hidden_layers"] - c["first_k_dense_replace"]
    E, K, D, F = c["n_routed_experts"], c["num_experts_per_tok"], c["hidden_size"], \
        c["moe_intermediate_size"]
    R, S, tp = 64, 8192, 128
    B = E // R
    fp8, cached = (memory.plan("deepseek-v3", ep=R, fsdp=R, precision=memory.Precision(
        experts="fp8", fp8_weight_cache=cache)) for cache in (False, True))
    assert (fp8.experts, cached.experts) == ("fp8", "fp8 + weight cache")
    per_layer = cache_nbytes(B, F, D)
    assert 0.32 < per_layer / memory.GiB < 0.34
    assert cached.total - fp8.total == L * per_layer
    assert cached.parts["fp8 weight cache"]["bytes"] == L * per_layer
    assert fp8.parts["fp8 weight cache"]["bytes"] == 0
    assert {k: v for k, v in cached.parts.items() if k != "fp8 weight cache"} == \
        {k: v for k, v in fp8.parts.items() if k != "fp8 weight cache"}
    assert cached.pool == fp8.pool == B * (3 * D * F + 12 * scale_cols(D) * scale_cols(F)) \
        + 2 * B * 3 * D * F
    NvS = _nvs(S, K, tp, B)
    assert cached.buffer_symm == fp8.buffer_symm == (S + NvS) * D * 2 + 16 * NvS + 8 * R \
        + 4 * R * (E + 3) + 7 * 8 * R + 8 + 16
    assert memory.table_row(cached).startswith("| deepseek-v3 (fp8 + weight cache) | 64 |")
    assert "FP8 weight cache" in memory.report(cached)


def test_fp8_weight_cache_needs_precision_fp8(capsys):
    with pytest.raises(SystemExit) as e:
        memory.main(["--model", "qwen3-30b-a3b", "--ep", "8", "--fp8-weight-cache"])
    assert e.value.code == 2 and "options of precision 'fp8'" in capsys.readouterr().err
