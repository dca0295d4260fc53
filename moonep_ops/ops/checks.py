"""Argument checks shared by the ops: memory overlap of written tensors, devices, and how a
rank's argument error reaches its peers (``reject_call``).

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


_PLAIN = (Tensor, torch.nn.Parameter)


def _has_storage(t) -> bool:
    # is_fake costs ~2 us (and device.type 0.6): a plain tensor that is no functionalization
    # wrapper is real, and is_meta says what its device says.
    if type(t) in _PLAIN:
        if t.is_meta or t.numel() == 0:
            return False
        if not torch._is_functional_tensor(t):
            return True
    elif not isinstance(t, Tensor) or t.numel() == 0 or t.device.type == "meta":
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


def _extent(t):
    """(storage address, lo, hi) of t: the bytes [lo, hi) of its storage it may touch; None
    when t has no storage (not a tensor, empty, meta, fake)."""
    if not _has_storage(t):
        return None
    lo, hi = _span(t)
    return t.untyped_storage().data_ptr(), lo, hi


def _extents_overlap(a: Tensor, b: Tensor, ea, eb) -> bool:
    """a and b (extents ea, eb: ``_extent``) share at least one byte."""
    if ea[0] != eb[0] or a.device != b.device:
        return False
    alo, ahi = ea[1], ea[2]
    blo, bhi = eb[1], eb[2]
    if max(alo, blo) >= min(ahi, bhi):
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


def overlaps(a: Tensor, b: Tensor) -> bool:
    """True when a and b share at least one byte of memory (False for fake/meta/empty)."""
    ea, eb = _extent(a), _extent(b)
    return ea is not None and eb is not None and _extents_overlap(a, b, ea, eb)


def _stored(pairs: Named) -> list:
    """[(name, tensor, storage address)] of the pairs whose tensor has storage."""
    return [(n, t, t.untyped_storage().data_ptr()) for n, t in pairs if _has_storage(t)]


def shares_storage(written: Sequence[Tensor], read: Sequence[Tensor]) -> bool:
    """Some written tensor views the same storage as another written or a read one: only then
    can two of them share a byte, and ``check_no_overlap`` has byte ranges to compare.  For
    real tensors of plain types on a device other than meta (every tensor has a storage
    address to read; empty ones may share address 0, which the full check then clears)."""
    w = {t.untyped_storage().data_ptr() for t in written}
    if len(w) < len(written):
        return True
    for t in read:
        if t.untyped_storage().data_ptr() in w:
            return True
    return False


def check_no_overlap(op: str, written: Named, read: Named = ()) -> None:
    """Raise ValueError when two written tensors, or a written and a read tensor, share memory.

    ``written`` / ``read``: (argument name, tensor or None) pairs; None and non-tensors are
    skipped (the ops' type checks report those).  Tensors of different storages never share a
    byte, so only pairs in one storage get their byte ranges compared (an op's arguments are
    nearly always in storages of their own: one address read per tensor is the usual cost)."""
    w = _stored(written)
    if not w:
        return
    ptrs = {p for _, _, p in w}
    r = [x for x in _stored(read) if x[2] in ptrs]
    ext = {}

    def hit(a, b) -> bool:
        for t in (a, b):
            if id(t) not in ext:
                ext[id(t)] = _extent(t)
        return _extents_overlap(a, b, ext[id(a)], ext[id(b)])

    for i, (na, a, pa) in enumerate(w):
        for nb, b, pb in w[i + 1:]:
            if pa == pb and hit(a, b):
                raise ValueError(f"{op}: {na} and {nb} overlap in memory; the op writes {na} and "
                                 f"{nb}, so each must have memory of its own")
        for nb, b, pb in r:
            if pa == pb and hit(a, b):
                raise ValueError(f"{op}: {na} (written) and {nb} (read) overlap in memory; "
                                 f"writing {na} would change {nb} while the op reads it")


# ---------------------------------------------------------------------------------------------
# Static checks once per call signature
# ---------------------------------------------------------------------------------------------
# An op's shape, dtype, device and contiguity checks read only its arguments' types, shapes,
# dtypes, devices and contiguity, and the op's other arguments (config, pool name, ...): a call
# with the same signature passes them again, so the ops' bodies run them on a signature's first
# call only.  A signature holds everything its checks read (a check that reads more, e.g. a
# stride or storage offset, must add it).  Value checks (cu_seqlens's values where validation
# runs, experts_to_copy's values, memory overlap) run on every call.

_PASSED: set = set()
_PASSED_MAX = 4096


def signature(head: tuple, tensors, dense=()) -> Optional[tuple]:
    """``head`` (the op and its non-tensor arguments, each with its type where a bool could
    pass for an int: True == 1 as a key), then (type, shape, dtype, device) of each of
    ``tensors`` and the contiguity of each of ``dense``; None when one is no tensor (the full
    checks then say which)."""
    key = list(head)
    try:
        for t in tensors:
            key += (type(t), t.shape, t.dtype, t.device)
        for t in dense:
            key.append(t.is_contiguous())
    except AttributeError:
        return None
    return tuple(key)


def passed(key: Optional[tuple]) -> bool:
    """The checks passed before for the signature ``key`` (a None key never did)."""
    return key is not None and key in _PASSED


def mark_passed(key: Optional[tuple]) -> None:
    """The checks passed for ``key`` (a signature, or None: nothing recorded)."""
    if key is not None:
        if len(_PASSED) >= _PASSED_MAX:
            _PASSED.clear()
        _PASSED.add(key)


def named(prefix: str, tensors: Iterable[Tensor]) -> list[tuple[str, Tensor]]:
    """[(f"{prefix}[i]", t)] for a tensor list argument."""
    return [(f"{prefix}[{i}]", t) for i, t in enumerate(tensors)]


def call_device(first, home: torch.device) -> torch.device:
    """The device every tensor of one call of a Buffer (or pool) op must live on: ``home`` (the
    Buffer's), or meta when the call's first tensor is on meta: a shape-only call, every
    tensor meta (the fake kernels answer it: meta outputs, nothing computed or
    communicated).  A meta tensor among real ones is an error: the dispatcher would route the
    whole call to the fake kernel, which returns uninitialised real tensors and does nothing."""
    return first.device if isinstance(first, Tensor) and first.device.type == "meta" else home


def on_device(t: Tensor, device: torch.device) -> bool:
    """t lives on ``device`` (the same GPU, not just any GPU; meta only for meta).  A device
    without an index (``cuda``) matches any index of its type.  One comparison on the usual
    path (the same device object)."""
    d = t.device
    if d == device:
        return True
    if d.type != device.type:
        return False
    return device.index is None or d.index is None


def device_error(name: str, t: Tensor, dev: torch.device, home: torch.device,
                 first: str) -> str:
    """The message of a tensor ``name`` on the wrong device (``dev`` from ``call_device``)."""
    if dev.type == "meta":
        return (f"{name} is on {t.device} but {first} is on meta: the tensors of one call are all "
                f"on the Buffer's device {home}, or all on meta (a shape-only call)")
    return f"{name} is on {t.device} but the Buffer lives on {home}"


# ---------------------------------------------------------------------------------------------
# Argument errors of the group ops reach every rank
# ---------------------------------------------------------------------------------------------

ARG_ERRORS = (TypeError, ValueError)


def _real(t) -> bool:
    return isinstance(t, Tensor) and t.device.type != "meta" and not is_fake(t)


def has_real_tensor(*args) -> bool:
    """Some argument (a tensor, or a tensor in a list) is a real tensor: a fake kernel running
    on it was reached by an eager call that a meta tensor routed there, not by tracing."""
    for a in args:
        if isinstance(a, (list, tuple)):
            if any(_real(t) for t in a):
                return True
        elif _real(a):
            return True
    return False


def reject_call(be, op: str, first_collective: str, error: BaseException,
                eager: bool = True) -> BaseException:
    """A Buffer op's argument ``error`` on this rank, before the op's first collective.

    ``eager`` (the real kernel; or the fake kernel on real tensors, where a meta argument routed
    an eager call): this rank takes the place it would have had in ``first_collective`` (the op
    whose collective the peers are in: the data plane's first, moonep_ops/backends/base.py
    ``Backend.reject``), flagged, so that every peer raises a ValueError naming this rank and
    the reason instead of waiting there.  Tracing (fake tensors) and shape-only calls
    communicate nothing.  Returns the exception to raise here: ``error``'s type and message,
    the op and the rank appended."""
    msg = f"{error} (moonep {op}, rank {be.rank})"
    if eager:
        be.reject(first_collective, f"{type(error).__name__}: {msg}")
    try:
        out = type(error)(msg)
    except Exception:                   # noqa: BLE001  (an exception type with another signature)
        out = error
    return out.with_traceback(error.__traceback__)
