"""The transformers integration at full size, on tiny models: meta build, convert, sharded load,
sharded save (moonep_ops/integrations/hf/checkpoint.py).

At R = 2 and 4 gloo ranks, from checkpoints written by transformers' ``save_pretrained`` with a
small ``max_shard_size`` (several files, the hub's per-expert keys) and in transformers' fused
expert layout (one file):
* meta build + ``convert_model`` + ``hf.load_pretrained`` gives the same logits, loss and grads as
  ``from_pretrained`` + ``convert_model``, bitwise, and each rank reads within 5 % of its share;
* ``hf.save_pretrained`` after a training step writes a directory that plain ``from_pretrained``
  loads into the trained model (state and logits bitwise equal to ``full_state_dict``'s), while
  no rank allocates more than the largest tensor beyond its own share;
* bad checkpoints raise on every rank, naming the key or file and the rank, and never hang.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from moonep_ops.integrations import hf  # noqa: E402

from dist_harness import cached_runner, multi_rank_cases  # noqa: E402
from test_integrations_hf import CAP, TP, batch, make_config, tiny  # noqa: E402

warnings.filterwarnings("ignore", module="transformers")


def _shared_dir(ctx) -> str:
    """A temporary directory every rank of the group agrees on (rank 0 makes it)."""
    box = [tempfile.mkdtemp(prefix="moonep_ckpt_") if ctx.rank == 0 else None]
    if ctx.R > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier(ctx):
    if ctx.R > 1:
        dist.barrier()


def _hub_checkpoint(ctx, name, fused=False):
    """Rank 0 writes the tiny model's checkpoint: several files with per-expert keys, or one
    file with transformers' fused expert tensors; every rank gets the path."""
    path = _shared_dir(ctx)
    if ctx.rank == 0:
        ref = tiny(name)
        ref.save_pretrained(path, max_shard_size="20KB")
        if fused:                       # transformers' module layout, one file
            from safetensors.torch import save_file
            for f in os.listdir(path):
                if f.endswith(".safetensors") or f.endswith(".json") and "index" in f:
                    os.remove(os.path.join(path, f))
            save_file({k: v.contiguous() for k, v in ref.state_dict().items()},
                      os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _barrier(ctx)
    return path


def _meta_converted(path, ctx, **kw):
    cfg = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    hf.convert_model(model, group=ctx.group, capacity=CAP, token_padding=TP, device="cpu", **kw)
    return model


def _share_bytes(model) -> int:
    """The bytes this rank keeps: every tensor of its state dict (its E/R experts per block)."""
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    return sum(t.numel() * t.element_size() for k, t in model.state_dict().items()
               if k not in tied)


def _step(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _destroy(*models):
    for m in models:
        blocks = hf.converted_blocks(m)
        if blocks:
            next(iter(blocks.values())).moe.buffer.destroy()


def _load_equals_from_pretrained(ctx, name, fused=False):
    path = _hub_checkpoint(ctx, name, fused)
    want = transformers.AutoModelForCausalLM.from_pretrained(path)
    hf.convert_model(want, group=ctx.group, capacity=CAP, token_padding=TP)
    got = _meta_converted(path, ctx)
    for n, p in got.named_parameters():        # experts and routers real, the rest not yet
        assert p.is_meta == (".moe." not in n), n
    report = hf.load_pretrained(got, path)
    assert not any(t.is_meta for t in list(got.parameters()) + list(got.buffers()))
    share = _share_bytes(got)
    print(f"[{name}{' fused' if fused else ''} R={ctx.R} rank {ctx.rank}] read "
          f"{report.bytes_read} B of a {share} B share ({report.bytes_read / share:.3f}), "
          f"{report.files} files")
    assert abs(report.bytes_read - share) <= 0.05 * share, (report.bytes_read, share)
    # kept = share but for the zero selection bias of a family without one (not in checkpoints)
    assert 0.95 * share <= report.bytes_kept <= share and report.unexpected == ()
    ids = batch(ctx.rank)
    a, b = _step(want, ids), _step(got, ids)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    ga, gb = _grads(want), _grads(got)
    assert list(ga) == list(gb)
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n
    _destroy(want, got)
    _barrier(ctx)
    if ctx.rank == 0:
        shutil.rmtree(path)


def case_load_qwen3_moe(ctx):
    _load_equals_from_pretrained(ctx, "qwen3_moe")


def case_load_deepseek_v3(ctx):
    _load_equals_from_pretrained(ctx, "deepseek_v3")


def case_load_fused_layout(ctx):
    _load_equals_from_pretrained(ctx, "qwen3_moe", fused=True)


class _NewTensorBytes(TorchDispatchMode):
    """Bytes of the tensors that ops allocate while the mode is on and that are still alive: the
    peak is what a call added beyond what existed before it."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, n):
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(
            (args, kwargs)) if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" \
                    and t.untyped_storage().data_ptr() not in inputs:
                n = t.untyped_storage().nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, n)
        return out


def _save_after_training(ctx, name):
    path = _hub_checkpoint(ctx, name)
    model = _meta_converted(path, ctx)
    hf.load_pretrained(model, path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, batch(ctx.rank))
    experts = set(hf.expert_parameter_names(model))
    for n, p in model.named_parameters():      # the replicated parameters: the mean, as DDP
        if n not in experts and p.grad is not None and ctx.R > 1:
            dist.all_reduce(p.grad, group=ctx.group)
            p.grad /= ctx.R
    opt.step()
    full = hf.full_state_dict(model)                        # the trained model, unconverted
    out = _shared_dir(ctx)
    largest = max(t.numel() * t.element_size() for t in full.values())
    with _NewTensorBytes() as mem:
        written = hf.save_pretrained(model, out, max_shard_size=largest)
    print(f"[save {name} R={ctx.R} rank {ctx.rank}] {len(written)} tensors, peak new tensor "
          f"bytes {mem.peak} (largest tensor {largest}, share {_share_bytes(model)})")
    assert 0 < mem.peak <= largest, (mem.peak, largest)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > ctx.R      # several files per rank
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    fresh = transformers.AutoModelForCausalLM.from_pretrained(path)
    fresh.load_state_dict(full, strict=True)
    sd = reloaded.state_dict()
    assert list(sd) == list(full)
    for k in full:
        assert torch.equal(sd[k], full[k]), k
    ids = batch(ctx.rank, step=1)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, fresh(input_ids=ids).logits)
    _destroy(model)
    _barrier(ctx)
    if ctx.rank == 0:
        shutil.rmtree(path)
        shutil.rmtree(out)


def case_save_qwen3_moe(ctx):
    _save_after_training(ctx, "qwen3_moe")


def case_save_deepseek_v3(ctx):
    _save_after_training(ctx, "deepseek_v3")


def _raises_everywhere(ctx, exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def case_bad_checkpoints(ctx):
    """Every rank raises the same kind of error, naming the key or file, for a problem that
    only one rank may see (a missing expert of rank R-1), and nothing hangs."""
    path = _hub_checkpoint(ctx, "qwen3_moe")
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    last = max(int(k.split(".experts.")[1].split(".")[0])
               for k in index["weight_map"] if ".experts." in k)
    gone = f"model.layers.1.mlp.experts.{last}.up_proj.weight"
    if ctx.rank == 0:                   # a missing expert key: only the last rank reads it
        bad = dict(index, weight_map={k: v for k, v in index["weight_map"].items() if k != gone})
        with open(index_path, "w") as f:
            json.dump(bad, f)
    _barrier(ctx)
    model = _meta_converted(path, ctx)
    _raises_everywhere(ctx, hf.CheckpointError, rf"rank {ctx.R - 1}.*lacks.*{gone}",
                       lambda: hf.load_pretrained(model, path))
    _barrier(ctx)
    if ctx.rank == 0:                   # an index naming a file that is absent
        with open(index_path, "w") as f:
            json.dump(index, f)
        os.remove(os.path.join(path, index["weight_map"]["model.norm.weight"]))
    _barrier(ctx)
    _raises_everywhere(ctx, FileNotFoundError, r"names 'model-\d+-of-\d+\.safetensors', which is "
                       r"not in", lambda: hf.load_pretrained(model, path))
    # a directory that is not a checkpoint
    empty = _shared_dir(ctx)
    _raises_everywhere(ctx, FileNotFoundError, "is not a transformers checkpoint",
                       lambda: hf.load_pretrained(model, empty))
    _destroy(model)
    # a shape that does not match the config (the checkpoint's F is 24)
    _barrier(ctx)
    good = _hub_checkpoint(ctx, "qwen3_moe")
    cfg = transformers.AutoConfig.from_pretrained(good)
    cfg.moe_intermediate_size = 32
    with torch.device("meta"):
        other = transformers.AutoModelForCausalLM.from_config(cfg)
    hf.convert_model(other, group=ctx.group, capacity=CAP, token_padding=TP, device="cpu")
    _raises_everywhere(ctx, hf.CheckpointError, r"experts\.\d+\.\w+_proj\.weight' has shape "
                       r"\(\d+, \d+\), the model's config makes it",
                       lambda: hf.load_pretrained(other, good))
    _destroy(other)
    # E not divisible by R: refused at conversion, on every rank, before any allocation
    if ctx.R > 1:
        cfg = make_config("qwen3_moe", num_experts=ctx.R + 1)
        with torch.device("meta"):
            odd = transformers.AutoModelForCausalLM.from_config(cfg)
        _raises_everywhere(ctx, ValueError, rf"num_experts={ctx.R + 1} is not divisible by the "
                           rf"EP group size R={ctx.R}",
                           lambda: hf.convert_model(odd, group=ctx.group, capacity=CAP))
    _barrier(ctx)
    if ctx.rank == 0:
        for d in (path, empty, good):
            shutil.rmtree(d)


MULTI_RANK = multi_rank_cases(globals(), ranks=(2, 4),
                              only_at={"case_load_fused_layout": (2,),
                                       "case_save_deepseek_v3": (4,)})
_results = cached_runner(__name__, MULTI_RANK, timeout_s=420, pg_timeout_s=120)


@pytest.mark.parametrize("R,case", MULTI_RANK)
def test_multi_rank(R, case):
    res = _results(R)[case]
    assert res.ok, res.error


def test_meta_conversion_allocates_only_what_a_rank_keeps():
    """R = 1, device="meta": nothing is allocated at all (a shape-only model); device="cpu": the
    experts, routers and shared experts are real, every other parameter stays meta."""
    cfg = make_config("deepseek_v3")
    with torch.device("meta"):
        shapes_only = transformers.AutoModelForCausalLM.from_config(cfg)
    hf.convert_model(shapes_only, capacity=CAP, token_padding=TP, device="meta")
    assert all(t.is_meta for t in shapes_only.state_dict().values())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    hf.convert_model(model, capacity=CAP, token_padding=TP, device="cpu")
    for n, p in model.named_parameters():
        assert p.is_meta == (".moe." not in n), n
    _destroy(shapes_only, model)


def test_mixed_meta_block_and_materialised_device_are_refused():
    model = tiny("qwen3_moe")
    with pytest.raises(ValueError, match="materialised on cpu"):
        hf.convert_model(model, capacity=CAP, device="meta")
    blk = model.model.layers[1].mlp
    blk.gate.weight = torch.nn.Parameter(torch.empty_like(blk.gate.weight, device="meta"))
    with pytest.raises(ValueError, match="some of the block's tensors are on the meta device"):
        hf.convert_model(model, capacity=CAP)
