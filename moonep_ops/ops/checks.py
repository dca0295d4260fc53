"""Argument checks shared by the ops: memory overlap of written tensors, and devices.

Overlap.  An op that writes tensors it was given (``prefetch_weight``, ``reduce_grad``,
``grouped_mm_wgrad_accumulate``, ``grouped_mm_wgrad_into``, and ``moe_experts`` through the
pool it stages) must not be handed two arguments that share memory: a write to one would
silently change the other (a home expert overwritten by a replica, a grad zeroed).  Comparing
start addresses is not enough: ``base[4:12]`` and ``base[:8]`` start at different addresses and
still share four rows.  ``check_no_overlap`` compares real byte ranges:

  * two tensors can only overlap if they view the same storage
    (``untyped_storage().data_ptr()``) on the same device;
  * a tensor covers at most the bytes ``[storage_offset * itemsize,
    (storage_offset + sum((size_i - 1) * stride_i) + 1) * itemsize)`` of its storage (strides
    are never negative in torch); for a dense tensor (contiguous up to a permutation of its
    dims, as every written tensor of the ops is) that span is exactly the bytes it covers;
  * when a span intersects a non-dense tensor's span, its elements are enumerated (up to
    ``_EXACT_LIMIT`` of them) to decide; past that the intersection of the spans counts as an
    overlap (a false positive needs strided views interleaved with the written block).

Checked: every pair of written tensors (a tensor repeated in a list included) and every written
tensor against every read tensor.  Read tensors are not compared with each other (reading the
same memory twice is harmless).  Empty tensors never overlap.  Fake and meta tensors have no
storage: they are skipped, so the check costs nothing at trace time; the real kernel runs it
before anything is written or communicated.  A hit raises ValueError naming both arguments.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

Named = Sequence[tuple[str, Optional[Tensor]]]

_EXACT_LIMIT = 1 << 20      # elements enumerated for an exact answer on a non-dense tensor


def _has_storage(t) -> bool:
    if not isinstance(t, Tensor) or t.numel() == 0 or t.device.type == "meta":
        return False
    return not is_fake(t)


def _span(t: Tensor) -> tuple[int, int]:
    """[lo, hi) bytes of the storage that t may touch."""
    isz = t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    lo = t.storage_offset() * isz
    return lo, lo + (last + 1) * isz


def _is_dense(t: Tensor) -> bool:
    """Contiguous up to a permutation of the dims: the span is exactly the bytes covered."""
    expected = 1
    for n, st in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1),
                        key=lambda p: p[1]):
        if st != expected:
            return False
        expected *= n
    return True


def _element_bytes(t: Tensor) -> Optional[Tensor]:
    """Start byte of every element of t (int64, flat), or None when there are too many."""
    if t.numel() > _EXACT_LIMIT:
        return None
    off = torch.tensor(t.storage_offset(), dtype=torch.int64)
    for n, st in zip(t.shape, t.stride()):
        off = (off[..., None] + torch.arange(n, dtype=torch.int64) * st)
    return off.reshape(-1) * t.element_size()


def _hits(t: Tensor, lo: int, hi: int) -> bool:
    """Does any element of t share a byte with [lo, hi)?"""
    if _is_dense(t):
        return True                       # its span intersects [lo, hi) and it covers its span
    starts = _element_bytes(t)
    if starts is None:
        return True                       # too many elements to enumerate: conservative
    isz = t.element_size()
    return bool(((starts < hi) & (starts + isz > lo)).any())


def overlaps(a: Tensor, b: Tensor) -> bool:
    """True when a and b share at least one byte of memory (False for fake/meta/empty)."""
    if not (_has_storage(a) and _has_storage(b)) or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (alo, ahi), (blo, bhi) = _span(a), _span(b)
    lo, hi = max(alo, blo), min(ahi, bhi)
    if lo >= hi:
        return False
    if _is_dense(a) and _is_dense(b):
        return True
    if _is_dense(a):
        return _hits(b, alo, ahi)
    if _is_dense(b):
        return _hits(a, blo, bhi)
    sa, sb = _element_bytes(a), _element_bytes(b)
    if sa is None or sb is None:
        return True
    ia, ib = a.element_size(), b.element_size()
    # bytes of a as [start, start + ia); b's elements as [start, start + ib)
    sb_sorted = torch.sort(sb).values
    # for every element of a: the first b element starting at or after a_start - ib + 1
    idx = torch.searchsorted(sb_sorted, sa - ib + 1)
    ok = idx < sb_sorted.numel()
    first = sb_sorted[idx.clamp(max=sb_sorted.numel() - 1)]
    return bool((ok & (first < sa + ia)).any())


def check_no_overlap(op: str, written: Named, read: Named = ()) -> None:
    """Raise ValueError when two written tensors, or a written and a read tensor, share memory.

    ``written`` / ``read``: (argument name, tensor or None) pairs; None and non-tensors are
    skipped (the ops' type checks report those)."""
    w = [(n, t) for n, t in written if _has_storage(t)]
    r = [(n, t) for n, t in read if _has_storage(t)]
    for i, (na, a) in enumerate(w):
        for nb, b in w[i + 1:]:
            if overlaps(a, b):
                raise ValueError(f"{op}: {na} and {nb} overlap in memory; the op writes {na} and "
                                 f"{nb}, so each must have memory of its own")
        for nb, b in r:
            if overlaps(a, b):
                raise ValueError(f"{op}: {na} (written) and {nb} (read) overlap in memory; "
                                 f"writing {na} would change {nb} while the op reads it")


def named(prefix: str, tensors: Iterable[Tensor]) -> list[tuple[str, Tensor]]:
    """[(f"{prefix}[i]", t)] for a tensor list argument."""
    return [(f"{prefix}[{i}]", t) for i, t in enumerate(tensors)]


def on_device(t: Tensor, device: torch.device) -> bool:
    """t lives on ``device`` (the same GPU, not just any GPU), or on meta (shape-only calls).
    A device without an index (``cuda``) matches any index of its type."""
    if t.device.type == "meta":
        return True
    if t.device.type != device.type:
        return False
    return device.index is None or t.device.index is None or t.device.index == device.index
