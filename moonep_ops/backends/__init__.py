"""Data-plane backends: the declared contract (base.py) and its implementations.

``make_backend(kind, group, device)`` builds the backend a ``Buffer(backend=kind)`` uses.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import native
from .base import Backend, DispatchFP8Result, DispatchResult
from .collective import CollectiveBackend, SingleRankBackend, TorchDistBackend
from .symm import LocalHeap, SymmBackend, SymmetricHeap, TorchSymmetricHeap

KINDS = ("auto", "symm", "torch", "single")


def resolve_device(device, group: Optional[dist.ProcessGroup]) -> torch.device:
    """``device`` if given, else the current GPU for an NCCL group, else the CPU."""
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    if (dist.is_available() and dist.is_initialized() and torch.cuda.is_available()
            and "nccl" in str(dist.get_backend(group if group is not None else dist.group.WORLD))):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_backend(kind: str, group: Optional[dist.ProcessGroup] = None, device=None) -> Backend:
    """kind "auto", "symm", "torch" or "single".

    "auto": on a CUDA device (``device``, or the current GPU when the group is NCCL) with
    libmoonep_ep.so built -> "symm" (CUDA kernels over symmetric memory); otherwise one rank when
    there is no group or it has one rank, else "torch"."""
    if kind not in KINDS:
        raise ValueError(f"backend must be one of {KINDS}, got {kind!r}")
    dev = resolve_device(device, group)
    if kind == "single":
        return SingleRankBackend(dev)
    if kind == "torch":
        return TorchDistBackend(group, dev)
    if kind == "symm" or (dev.type == "cuda" and native.ep() is not None):
        if dev.type != "cuda":
            raise ValueError(f"backend='symm' needs a CUDA device, got {dev}")
        with torch.cuda.device(dev):
            return SymmBackend(default_heap(group, dev))
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return SingleRankBackend(dev)
    if dist.get_world_size(group if group is not None else dist.group.WORLD) == 1:
        return SingleRankBackend(dev)
    return TorchDistBackend(group, dev)


def default_heap(group, device: torch.device) -> SymmetricHeap:
    """An initialised process group -> torch symmetric memory (one process per GPU, also for a
    group of one); no process group -> a one-rank LocalHeap."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return LocalHeap(device)
    return TorchSymmetricHeap(group)


__all__ = ["Backend", "DispatchResult", "DispatchFP8Result", "CollectiveBackend", "TorchDistBackend",
           "SingleRankBackend", "SymmBackend", "SymmetricHeap", "TorchSymmetricHeap",
           "LocalHeap", "make_backend", "resolve_device", "default_heap", "KINDS"]
