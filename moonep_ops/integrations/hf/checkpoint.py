"""Checkpoints of converted models at full size: sharded load and sharded save in the hub layout.

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)           # no memory
    hf.convert_model(model, group=ep, capacity=S)               # each rank: its E/R experts
    report = hf.load_pretrained(model, path)                    # collective: reads its share
    ...train...
    hf.save_pretrained(model, out_dir)                          # collective: writes its share

Both are collective over the default process group (every rank calls them; EP groups and FSDP2
meshes may be any sub-groups of it).  Each rank reads, and writes, only what it keeps:

* Loading.  The checkpoint is a transformers directory: ``model.safetensors`` or several files
  tied by ``model.safetensors.index.json``, with the hub's per-expert keys
  (``...experts.7.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.7.w1.weight``) or
  transformers' fused expert layout (``...experts.gate_up_proj [E, 2F, D]``).  A rank opens a
  tensor only for what it keeps: its home experts' per-expert tensors, the rows ``[e0, e1)`` of a
  fused expert tensor, and of a parameter that FSDP2 shards (a DTensor) the rows of its shard,
  through safetensors' sliced reads.  Meta tensors are materialised first (``Module.to_empty``,
  which FSDP2 supports), non-persistent buffers (rotary tables) are recomputed by transformers'
  own ``initialize_weights`` (every loaded tensor marked initialised, so it touches nothing
  else), tied weights re-tied by ``tie_weights``.
* Saving.  Every rank writes safetensors files of what it is assigned: its home experts (the
  lowest rank among the replicas of an expert under several EP groups), dense tensors it holds
  whole, spread to balance bytes, and tensors that FSDP2 shards, gathered one at a time
  (``DTensor.full_tensor``) by the ranks of their mesh for the one rank that writes them.  A file
  holds at most ``max_shard_size`` bytes (default: the model's largest tensor), so no rank holds
  more than its share plus that many bytes.  Rank 0 writes ``model.safetensors.index.json``, the
  config and the generation config; plain ``from_pretrained(dir)`` loads the unconverted model.

Key names come from transformers' own conversion machinery, not from a table of ours: the
mapping transformers applies between its modules and the hub layout
(``transformers.core_model_loading.revert_weight_conversion``, the function ``save_pretrained``
uses) is run once on small integer probe tensors, one per unconverted state-dict entry, whose
values say which expert and which half of gate/up each hub key holds.  So every family whose
``conversion_mapping`` transformers ships (renamings, merged per-expert lists, concatenated
gate/up) is read and written as transformers itself would.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .convert import converted_blocks
from .hub_layout import Entry, HubKey, hub_keys, hub_shape, layout_entries

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model (missing key, wrong shape, absent file); raised
    on every rank with the rank that found it."""


@dataclasses.dataclass
class LoadReport:
    """What ``load_pretrained`` did on this rank.

    bytes_read: bytes of tensor data requested from the checkpoint (slices counted by their
      size); bytes_kept: bytes of the model's tensors filled on this rank (its share; the
      checkpoint's dtype may differ); files: checkpoint files opened; unexpected: checkpoint
      keys the model has no place for (e.g. a multi-token-prediction layer)."""
    bytes_read: int = 0
    bytes_kept: int = 0
    files: int = 0
    unexpected: tuple = ()


# ---------------------------------------------------------------------------------------------
# Collective agreement: one rank's error is every rank's
# ---------------------------------------------------------------------------------------------


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(err: Optional[BaseException], what: str) -> None:
    """Every rank learns every rank's error; all raise the first one (by rank), so no rank goes
    on to a collective its peers never reach."""
    rank, world = _world()
    if world > 1:
        mine = None if err is None else (type(err).__name__, str(err))
        got = [None] * world
        dist.all_gather_object(got, mine)
        bad = [(r, g) for r, g in enumerate(got) if g is not None]
    else:
        bad = [] if err is None else [(0, (type(err).__name__, str(err)))]
    if not bad:
        return
    r, (kind, msg) = bad[0]
    exc = {"FileNotFoundError": FileNotFoundError, "NotImplementedError": NotImplementedError,
           "TypeError": TypeError}.get(kind, CheckpointError)
    raise exc(f"{what} failed on rank {r}: {msg}") from (err if r == rank else None)


# ---------------------------------------------------------------------------------------------
# Local views of the converted model's tensors (plain or FSDP2's DTensors)
# ---------------------------------------------------------------------------------------------


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _local(t: Tensor) -> tuple[Tensor, tuple, tuple]:
    """(the local tensor, its global offset, its local shape): a DTensor's shard, or the whole."""
    if _is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                              t.placements)
        return t.to_local(), tuple(offset), tuple(shape)
    return t, (0,) * t.dim(), tuple(t.shape)


def _local_experts(t: Tensor, moe) -> tuple[Tensor, int, int]:
    """(this rank's rows of an expert weight [B, ...], the global ids [lo, hi) they hold): the
    home experts, or under expert FSDP (``shard_experts``) the rows of its shard of them."""
    local, offset, shape = _local(t)
    lo = moe.expert_offset + offset[0]
    return local, lo, lo + shape[0]


def _state(model: nn.Module) -> dict[str, Tensor]:
    return model.state_dict(keep_vars=True)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _checkpoint_files(path: str) -> dict[str, str]:
    """{checkpoint key: file path} of a transformers safetensors directory."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a directory (a transformers checkpoint "
                                f"directory with {SINGLE} or {INDEX})")
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
        files = {k: os.path.join(path, v) for k, v in weight_map.items()}
        for name in sorted(set(files.values())):
            if not os.path.exists(name):
                raise FileNotFoundError(f"{index} names {os.path.basename(name)!r}, which is not "
                                        f"in {path!r}")
        return files
    single = os.path.join(path, SINGLE)
    if os.path.exists(single):
        from safetensors import safe_open
        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"{path!r} is not a transformers checkpoint: it has neither {SINGLE} "
                            f"nor {INDEX}")


@dataclasses.dataclass
class _Read:
    """One read of a checkpoint tensor (or its slice ``index``) into ``dsts``: (a view of a
    local tensor, (its Entry, target part): what of the read it keeps, or None for all of it)."""
    key: str
    index: tuple
    dsts: list


def _plan_reads(model: nn.Module, files: dict[str, str], shapes: dict[str, tuple]
                ) -> tuple[list[_Read], list[str]]:
    """What this rank reads, and the checkpoint keys the model has no place for."""
    entries = layout_entries(model)
    hub = hub_keys(model, entries)
    state = _state(model)
    blocks = converted_blocks(model)
    by_entry = defaultdict(list)                 # entry index -> [(hub key, HubKey)]
    for key, hk in hub.items():
        by_entry[hk.entry].append((key, hk))
    reads, missing = [], []
    for i, en in enumerate(entries):
        if en.parts:
            locals_ = {t: _local_experts(state[t], blocks[en.block].moe) for t, _ in en.targets}
            _, lo, hi = locals_[en.targets[0][0]]
            if en.hf_key in files:               # transformers' fused layout: rows [lo, hi)
                _check_shape(en.hf_key, shapes[en.hf_key], en.shape)
                reads.append(_Read(en.hf_key, (slice(lo, hi),),
                                   [(locals_[t][0], (en, p)) for t, p in en.targets]))
                continue
            for key, hk in by_entry[i]:
                if not lo <= hk.expert < hi:
                    continue                     # another rank's expert: never opened here
                if key not in files:
                    missing.append(key)
                    continue
                _check_shape(key, shapes[key], hub_shape(en, hk))
                target = en.targets[hk.part][0]
                reads.append(_Read(key, (), [(locals_[target][0][hk.expert - lo], None)]))
            continue
        names = [k for k, _ in by_entry[i]] + [en.hf_key]
        key = next((k for k in names if k in files), names[0])
        if key not in files:
            missing.append(key)
            continue
        _check_shape(key, shapes[key], en.shape)
        for target, part in en.targets:
            t = state[target]
            if _is_dtensor(t):                   # FSDP2: the rows of this rank's shard
                local, offset, lshape = _local(t)
                index = tuple(slice(o, o + n) for o, n in zip(offset, lshape))
                reads.append(_Read(key, index, [(local, None)]))
            else:
                reads.append(_Read(key, (), [(t, (en, part))]))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"the checkpoint lacks {missing[:5]}{more} (another model, or "
                              "an incomplete checkpoint)")
    known = set(hub) | {en.hf_key for en in entries}
    unexpected = sorted(k for k in files if k not in known)
    return reads, unexpected


def _check_shape(key: str, got: tuple, want: tuple) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(f"checkpoint tensor {key!r} has shape {tuple(got)}, the model's "
                              f"config makes it {tuple(want)}")


def _materialise(model: nn.Module, device) -> bool:
    """Meta tensors -> uninitialised tensors on ``device`` (``Module.to_empty``; FSDP2's sharded
    parameters follow it).  Returns whether anything was on the meta device."""
    if not any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        return False
    model.to_empty(device=device)
    return True


def _expert_device(model: nn.Module) -> torch.device:
    blocks = converted_blocks(model)
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no converted sparse-MoE block: call "
                         "hf.convert_model first (plain transformers loads it otherwise)")
    return next(iter(blocks.values())).moe.w1.device


@torch.no_grad()
def load_pretrained(model: nn.Module, path: str, *, device=None) -> LoadReport:
    """Fill a converted model from a transformers checkpoint directory, each rank reading only
    what it keeps.  Collective over the default process group (every rank calls it).

    Args:
      model: a model after ``hf.convert_model`` (built on the meta device, or materialised),
        optionally with FSDP2 applied (``hf.fully_shard_dense``): DTensor parameters get the
        rows of their shard.
      path: the directory (``model.safetensors`` or ``model.safetensors.index.json`` with its
        files), hub per-expert keys or transformers' fused expert layout.
      device: where meta tensors are materialised (default: where the converted experts are).

    Returns a ``LoadReport`` (bytes read and kept, files opened, unexpected keys).  A missing key,
    a shape the config does not make, an absent file or a directory that is not a checkpoint
    raise on every rank (``CheckpointError`` / ``FileNotFoundError``, naming the key or file and
    the rank that found it) before any tensor is written."""
    from safetensors import safe_open
    err, reads, unexpected, files = None, [], [], {}
    try:
        dev = torch.device(device) if device is not None else _expert_device(model)
        files = _checkpoint_files(path)
        shapes = {}
        for name in sorted(set(files.values())):
            with safe_open(name, framework="pt") as f:
                for k in f.keys():
                    shapes[k] = tuple(f.get_slice(k).get_shape())
        absent = [k for k in files if k not in shapes]
        if absent:
            raise CheckpointError(f"the index maps {absent[:3]} to files that do not hold them")
    except (OSError, ValueError, NotImplementedError, KeyError) as e:
        err = e
    _agree(err, "load_pretrained")
    _materialise(model, dev)
    try:
        reads, unexpected = _plan_reads(model, files, shapes)
    except (ValueError, NotImplementedError, KeyError) as e:
        err = e
    _agree(err, "load_pretrained")
    report = LoadReport(unexpected=tuple(unexpected))
    by_file = defaultdict(list)
    for rd in reads:
        by_file[files[rd.key]].append(rd)
    filled = {}
    for name in sorted(by_file):
        report.files += 1
        with safe_open(name, framework="pt") as f:
            for rd in by_file[name]:
                t = f.get_slice(rd.key)[rd.index] if rd.index else f.get_tensor(rd.key)
                report.bytes_read += t.numel() * t.element_size()
                for dst, how in rd.dsts:
                    dst.copy_(t if how is None else how[0].to_target(t, how[1]))
                    filled[id(dst)] = dst
    report.bytes_kept = sum(t.numel() * t.element_size() for t in filled.values())
    _finish(model)
    return report


def _finish(model: nn.Module) -> None:
    """What transformers' from_pretrained does after its reads: zero the selection bias of
    families without one, recompute the non-persistent buffers (garbage after any to_empty, ours
    or the caller's), tie weights."""
    for layer in converted_blocks(model).values():
        if layer.family.score_bias is None:
            layer.moe.router.expert_bias.zero_()
    if hasattr(model, "initialize_weights"):       # also after a caller's own to_empty
        persistent = _state(model)
        for t in list(model.parameters()) + list(persistent.values()):
            t._is_hf_initialized = True                 # loaded: transformers' init skips it
        for m in model.modules():
            m._is_hf_initialized = not any(n in m._non_persistent_buffers_set
                                           for n, _ in m.named_buffers(recurse=False))
        model.initialize_weights()                      # rotary tables and the like
    if getattr(model, "all_tied_weights_keys", None) and hasattr(model, "tie_weights"):
        model.tie_weights()


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    s = str(size).strip().upper()
    for unit, f in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10 ** 9),
                    ("MB", 10 ** 6), ("KB", 10 ** 3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[:-len(unit)]) * f)
    return int(s)


def _holdings(model, entries, hub, state, blocks) -> tuple[list, list]:
    """This rank's hub keys held whole (indices into the sorted hub keys) and held as a DTensor
    shard."""
    whole, sharded = [], []
    for j, (key, hk) in enumerate(hub):
        en = entries[hk.entry]
        if hk.expert is not None:
            target = en.targets[hk.part][0]
            _, lo, hi = _local_experts(state[target], blocks[en.block].moe)
            if lo <= hk.expert < hi:
                whole.append(j)
            continue
        if en.parts:                    # a fused expert entry: gathered over the EP group
            sharded.append(j)
            continue
        t = state[en.targets[0][0]]
        (sharded if _is_dtensor(t) else whole).append(j)
    return whole, sharded


def _hub_tensor(en: Entry, hk: HubKey, state, blocks) -> Tensor:
    """The hub tensor from this rank's own tensors (an expert: a view of its slot)."""
    if hk.expert is not None:
        local, lo, _ = _local_experts(state[en.targets[hk.part][0]], blocks[en.block].moe)
        return local[hk.expert - lo].detach()
    return en.from_targets([state[t].detach() for t, _ in en.targets])


def _gathered_experts(en: Entry, state, blocks) -> Tensor:
    """A fused expert entry [E, ...] from every rank's home experts (collective over the block's
    EP group; every rank of it calls this, for every such entry, in the same order)."""
    moe = blocks[en.block].moe
    parts = []
    for target, _ in en.targets:
        t = state[target]
        if _is_dtensor(t):
            raise NotImplementedError(f"{en.hf_key}: writing a fused expert tensor from experts "
                                      "sharded by FSDP2 is not supported")
        parts.append(moe.gather_experts(t.detach()))
    return en.from_targets(parts)


@torch.no_grad()
def save_pretrained(model: nn.Module, save_directory: str, *, max_shard_size=None) -> dict:
    """Write a converted model as the unconverted transformers checkpoint, each rank writing
    what it owns.  Collective over the default process group.

    Every rank writes ``model-rank{r:05d}-{i:05d}.safetensors`` files; rank 0 writes
    ``model.safetensors.index.json`` (every key to its file), ``config.json`` and
    ``generation_config.json``.  ``max_shard_size`` (int bytes or "500MB"; default: the largest
    tensor of the model) bounds a file, and so what a rank holds beyond its own tensors.
    Returns {key: file name} of this rank's writes."""
    from safetensors.torch import save_file
    rank, world = _world()
    err = None
    try:
        if not converted_blocks(model):
            raise ValueError(f"{type(model).__name__} has no converted sparse-MoE block; "
                             "use model.save_pretrained")
        entries = layout_entries(model)
        hub = sorted(hub_keys(model, entries).items())
        state = _state(model)
        if any(t.is_meta for t in state.values()):
            raise ValueError("the model still has meta tensors: load or initialise it first")
        os.makedirs(save_directory, exist_ok=True)
    except (OSError, ValueError, NotImplementedError) as e:
        err = e
    _agree(err, "save_pretrained")
    blocks = converted_blocks(model)
    nbytes = [torch.Size(hub_shape(entries[hk.entry], hk)).numel()
              * entries[hk.entry].dtype.itemsize for _, hk in hub]
    limit = _parse_size(max_shard_size) if max_shard_size is not None else max(nbytes)
    whole, sharded = _holdings(model, entries, hub, state, blocks)
    if world > 1:
        got = [None] * world
        dist.all_gather_object(got, (whole, sharded))
    else:
        got = [(whole, sharded)]
    # one writer per key, balancing bytes; whole holders first (no gather needed)
    holders = defaultdict(list)
    shard_holders = defaultdict(list)
    for r, (w, s) in enumerate(got):
        for j in w:
            holders[j].append(r)
        for j in s:
            shard_holders[j].append(r)
    load = [0] * world
    writer = {}
    for j in range(len(hub)):
        cands = holders.get(j) or shard_holders.get(j)
        if not cands:
            raise RuntimeError(f"no rank holds {hub[j][0]!r}")       # a bug, not user input
        w = min(cands, key=lambda r: (load[r], r))
        writer[j] = w
        load[w] += nbytes[j]

    written, batch, batch_bytes, nfile = {}, {}, 0, 0

    def flush():
        nonlocal batch, batch_bytes, nfile
        if batch:
            name = f"model-rank{rank:05d}-{nfile:05d}.safetensors"
            save_file(batch, os.path.join(save_directory, name), metadata={"format": "pt"})
            written.update({k: name for k in batch})
            nfile += 1
        batch, batch_bytes = {}, 0

    mine, shards = set(whole), set(sharded)
    for j, (key, hk) in enumerate(hub):
        en = entries[hk.entry]
        gathered = en.parts and hk.expert is None       # every rank of the EP group gathers
        if not gathered:
            if j in shards:
                src = state[en.targets[0][0]]
                if holders.get(j) or writer[j] not in src.device_mesh.mesh.flatten().tolist():
                    continue                             # written by a rank outside this mesh
            elif j not in mine or writer[j] != rank:
                continue
        if writer[j] == rank and batch_bytes and batch_bytes + nbytes[j] > limit:
            flush()                                      # before the next tensor is made
        if gathered:
            t = _gathered_experts(en, state, blocks)
        elif j in mine:
            t = _hub_tensor(en, hk, state, blocks)
        else:
            t = src.full_tensor()                        # collective over the shard's mesh
        if writer[j] != rank:
            del t
            continue
        t = t.to(device="cpu", dtype=en.dtype)
        # safetensors refuses tensors that share storage (one expert of w1 and the next): a view
        # is copied, within the file's bound
        batch[key] = t.clone() if t.untyped_storage().nbytes() != t.nbytes else t.contiguous()
        batch_bytes += nbytes[j]
    flush()
    if world > 1:
        maps = [None] * world
        dist.all_gather_object(maps, written)
    else:
        maps = [written]
    if rank == 0:
        weight_map = {k: v for m in maps for k, v in m.items()}
        total = sum(nbytes)
        with open(os.path.join(save_directory, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        _save_configs(model, save_directory)
    if world > 1:
        dist.barrier()
    return written


def _save_configs(model: nn.Module, save_directory: str) -> None:
    config = getattr(model, "config", None)
    if config is None:
        return
    import copy
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(save_directory)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(save_directory)


__all__ = ["CheckpointError", "LoadReport", "load_pretrained", "save_pretrained"]
