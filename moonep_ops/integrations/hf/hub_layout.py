"""The two layouts a converted model's checkpoint is read and written in: the unconverted
model's state dict, entry by entry, with the converted model's keys that hold each (``layout_entries``),
and the hub layout that transformers' own reverse conversion makes of it (``hub_keys``, run on
probe tensors).  Used by checkpoint.py's sharded load and save."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor, nn

from .convert import MoonEPBlock, converted_blocks

_PROBE = 1 << 20                # probe value = entry index * _PROBE + expert * 2 + part


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of the unconverted model's state dict and where this rank keeps it."""
    hf_key: str                    # the unconverted model's key (transformers' module layout)
    shape: tuple                   # its full shape in that layout
    dtype: torch.dtype
    targets: tuple                 # ((converted model key, part or None), ...)
    block: Optional[str] = None    # the converted block it belongs to (experts: the offset)
    parts: int = 0                 # an expert entry [E, ...]: 1, or 2 for gate/up; else 0
    family: object = None          # the block's Family (its to_moe / to_hf layout), or None
    block_key: str = ""            # the key inside the block (the Family's key_map key)

    def to_target(self, t: Tensor, part: Optional[int]) -> Tensor:
        """The value of target ``part`` from (rows of) this entry's tensor in the HF layout."""
        return t if self.family is None else self.family.to_moe(self.block_key, t)[part or 0]

    def from_targets(self, parts: list) -> Tensor:
        """This entry's tensor in the HF layout from its targets' values (rows of experts)."""
        return parts[0] if self.family is None else self.family.to_hf(self.block_key, parts)


@dataclasses.dataclass(frozen=True)
class HubKey:
    """One tensor of the hub layout: which entry it is, and of an expert entry which expert and
    which part (0: gate or the whole down_proj, 1: up)."""
    entry: int
    expert: Optional[int]
    part: int


def owner_block(key: str, blocks: dict) -> Optional[str]:
    parts = key.split(".")
    return next((p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1))
                 if p in blocks), None)


def layout_entries(model: nn.Module) -> list[Entry]:
    """The unconverted model's state dict, entry by entry, with the converted model's keys that
    hold each (an expert entry: this rank's slice of it)."""
    blocks = converted_blocks(model)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    out, done = [], set()
    for key, t in model.state_dict(keep_vars=True).items():
        if key in tied:
            continue
        owner = owner_block(key, blocks)
        if owner is None:
            out.append(Entry(key, tuple(t.shape), t.dtype, ((key, None),)))
            continue
        if owner in done:
            continue
        done.add(owner)
        layer: MoonEPBlock = blocks[owner]
        experts = layer.family.expert_keys()
        for hf_key, shape, dtype in layer.hf_layout:
            targets = layer._key_map[hf_key]
            parts = (None,) if len(targets) == 1 else range(len(targets))
            out.append(Entry(f"{owner}.{hf_key}", tuple(shape), dtype,
                              tuple((f"{owner}.moe.{t}", p) for t, p in zip(targets, parts)),
                              owner, experts.get(hf_key, 0), layer.family, hf_key))
    return out


def hub_keys(model: nn.Module, entries: list[Entry]) -> dict[str, HubKey]:
    """{hub key: HubKey}: transformers' reverse conversion run on probe tensors (an expert entry
    [E, parts, 1] of values entry * _PROBE + e * 2 + part, any other entry one value)."""
    from transformers.core_model_loading import revert_weight_conversion
    probes = {}
    for i, en in enumerate(entries):
        if en.parts:
            E, parts = en.shape[0], en.parts
            v = (i * _PROBE + torch.arange(E)[:, None] * 2 + torch.arange(parts)[None, :])
            probes[en.hf_key] = v[:, :, None].to(torch.int64)
        else:
            probes[en.hf_key] = torch.tensor([i * _PROBE], dtype=torch.int64)
    try:
        hub = revert_weight_conversion(model, probes)
    except Exception as e:                               # noqa: BLE001 - say which machinery
        raise NotImplementedError(
            f"transformers' reverse weight conversion failed on {type(model).__name__}'s layout "
            f"({type(e).__name__}: {e}); hf.save_pretrained / load_pretrained follow it") from e
    out = {}
    index = {en.hf_key: i for i, en in enumerate(entries)}
    for key, v in hub.items():
        probe = probes.get(key)
        if probe is not None and v.shape == probe.shape and torch.equal(v, probe):
            out[key] = HubKey(index[key], None, 0)     # the entry itself, whole (gpt-oss's
            continue                                    # fused experts: no hub conversion)
        if v.numel() != 1:
            raise NotImplementedError(f"transformers maps {key!r} to a tensor of {v.numel()} "
                                      "entries; MoonEP reads and writes whole entries or single "
                                      "experts only")
        code = int(v.reshape(-1)[0])
        i, rest = divmod(code, _PROBE)
        en = entries[i]
        out[key] = HubKey(i, rest // 2, rest % 2) if en.parts else HubKey(i, None, 0)
    return out


def hub_shape(en: Entry, hk: HubKey) -> tuple:
    if hk.expert is None:
        return en.shape
    shape = list(en.shape[1:])
    shape[0] //= en.parts
    return tuple(shape)


__all__ = ["Entry", "HubKey", "hub_keys", "hub_shape", "layout_entries", "owner_block"]
