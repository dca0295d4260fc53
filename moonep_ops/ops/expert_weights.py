"""Op family ``moonep::prefetch_weight`` / ``moonep::reduce_grad``: expert weights to and from
the redundant slots named by the plan's global ``experts_to_copy`` table.

  prefetch_weight(experts_to_copy [R,epn] i32, local_weights Tensor[], slot_weights(a!) Tensor[],
                  buffer) -> ()
      for every (d, b) with e = experts_to_copy[d, b] >= 0 and e // epn == rank (the owner):
      slot_weights[i] of rank d, row b  <-  local_weights[i][e % epn]   (bitwise copy);
      rows of -1 slots are untouched.
  reduce_grad(experts_to_copy, local_grads(a!) Tensor[], slot_grads(b!) Tensor[], buffer) -> ()
      owner: local_grads[i][le] += slot_grads[i] row b of rank src, for every (src, b) holding
      expert rank*epn + le, added one at a time in ascending src*epn + b in fp32
      (deterministic): fp32 grads in place; bf16 grads read once, summed in fp32, rounded once;
      then every rank zeroes its own consumed slots (experts_to_copy[rank, b] >= 0); unconsumed
      slots are untouched.

Every tensor of the lists is [epn, ...] and contiguous; local[i] and slot[i] share shape and
dtype (reduce_grad: all fp32 or all bf16); no written tensor may share memory with another
argument (real byte ranges, ops/checks.py).  All checks run before anything is written or
communicated, and a failed one reaches every rank (ops/checks.py ``reject_call``).  Every
tensor is on the Buffer's device, or every tensor on meta (a shape-only call: nothing happens).
Neither op is differentiable; Buffer.prefetch_weight / reduce_grad pass detached tensors.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import registry, runtime
from ..backends.base import Backend
from .checks import (ARG_ERRORS, call_device, check_no_overlap, device_error, has_real_tensor,
                     named, on_device, reject_call)

_TAGS = ()   # capturable on the CUDA backend (see dispatch.py)


GRAD_DTYPES = (torch.float32, torch.bfloat16)


def check_pool_args(etc, local, slots, be, op: str, grads: bool) -> None:
    if not isinstance(etc, Tensor) or etc.dtype != torch.int32:
        raise TypeError(f"{op}: experts_to_copy must be an int32 tensor")
    if tuple(etc.shape) != (be.spec.R, be.spec.epn):
        raise ValueError(f"{op}: experts_to_copy must be [R={be.spec.R}, epn={be.spec.epn}], got "
                         f"{tuple(etc.shape)}")
    # the CUDA kernels read the table through its data pointer: strides would be ignored
    if not etc.is_contiguous():
        raise ValueError(f"{op}: experts_to_copy must be contiguous (got strides {etc.stride()})")
    dev = call_device(etc, be.device)      # the Buffer's, or meta for a shape-only call
    if not on_device(etc, dev):
        raise ValueError(f"{op}: " + device_error("experts_to_copy", etc, dev, be.device,
                                                  "experts_to_copy"))
    ln, sn = ("local_grads", "slot_grads") if grads else ("local_weights", "slot_weights")
    if len(local) != len(slots):
        raise ValueError(f"{op}: {len(local)} {ln} but {len(slots)} {sn}")
    if len(local) == 0:
        raise ValueError(f"{op}: give at least one tensor")
    for i, (lt, st) in enumerate(zip(local, slots)):
        for name, t in ((f"{ln}[{i}]", lt), (f"{sn}[{i}]", st)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
            if grads and t.dtype not in GRAD_DTYPES:
                raise TypeError(f"{op}: {name} must be float32 or bfloat16, got {t.dtype}")
            if t.dim() < 1 or t.shape[0] != be.spec.epn:
                raise ValueError(f"{op}: {name} must be [epn={be.spec.epn}, ...], got {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{op}: {name} must be contiguous")
            if not on_device(t, dev):
                raise ValueError(f"{op}: " + device_error(name, t, dev, be.device,
                                                          "experts_to_copy"))
        if lt.dtype != st.dtype or lt.shape != st.shape:
            raise ValueError(f"{op}: {ln}[{i}] {tuple(lt.shape)} {lt.dtype} and {sn}[{i}] "
                             f"{tuple(st.shape)} {st.dtype} must match")
        if grads and lt.dtype != local[0].dtype:
            raise TypeError(f"{op}: all grads of one call must share a dtype; {ln}[0] is "
                            f"{local[0].dtype}, {ln}[{i}] {lt.dtype}")


def check_no_alias(etc, local, slots, op: str, grads: bool) -> None:
    """No written tensor may share memory with another argument (ops/checks.py; real kernels
    only: fake tensors have no storage).  prefetch_weight writes the slots and reads the local
    tensors; reduce_grad writes both lists; both read experts_to_copy."""
    if grads:
        written, read = named("local_grads", local) + named("slot_grads", slots), []
    else:
        written, read = named("slot_weights", slots), named("local_weights", local)
    read = read + [("experts_to_copy", etc)]
    check_no_overlap(op, written, read)


def check_etc_values(etc: Tensor, be) -> None:
    if not runtime.should_validate(etc) or etc.numel() == 0:
        return
    if int(etc.min()) < -1 or int(etc.max()) >= be.spec.E:
        raise ValueError(f"experts_to_copy values must lie in [-1, E={be.spec.E}), got "
                         f"[{int(etc.min())}, {int(etc.max())}]")


@torch.library.custom_op("moonep::prefetch_weight", mutates_args=("slot_weights",), tags=_TAGS)
def _prefetch_weight(experts_to_copy: Tensor, local_weights: list[Tensor],
                     slot_weights: list[Tensor], buffer: str) -> None:
    be = registry.lookup(buffer, Backend)
    _checks(be, "prefetch_weight", experts_to_copy, local_weights, slot_weights, False)
    be.prefetch_weight(experts_to_copy, local_weights, slot_weights)


def _checks(be, op: str, etc, local, slots, grads: bool, real: bool = True) -> None:
    """Every check of the op, before anything is written or communicated; an error reaches the
    peers through the backend's first collective (checks.reject_call).  ``real``: the real
    kernel (memory overlap and values checked too); else the fake kernel, which communicates
    only when real tensors reached it (a meta tensor among them routed an eager call there)."""
    try:
        check_pool_args(etc, local, slots, be, op, grads)
        if real:
            check_no_alias(etc, local, slots, op, grads)
            check_etc_values(etc, be)
    except ARG_ERRORS as e:
        eager = real or has_real_tensor(etc, local, slots)
        raise reject_call(be, op, op, e, eager) from None


@_prefetch_weight.register_fake
def _prefetch_weight_fake(experts_to_copy, local_weights, slot_weights, buffer):
    _checks(registry.lookup(buffer, Backend), "prefetch_weight", experts_to_copy, local_weights,
            slot_weights, False, real=False)


@torch.library.custom_op("moonep::reduce_grad", mutates_args=("local_grads", "slot_grads"),
                         tags=_TAGS)
def _reduce_grad(experts_to_copy: Tensor, local_grads: list[Tensor], slot_grads: list[Tensor],
                 buffer: str) -> None:
    be = registry.lookup(buffer, Backend)
    _checks(be, "reduce_grad", experts_to_copy, local_grads, slot_grads, True)
    be.reduce_grad(experts_to_copy, local_grads, slot_grads)


@_reduce_grad.register_fake
def _reduce_grad_fake(experts_to_copy, local_grads, slot_grads, buffer):
    _checks(registry.lookup(buffer, Backend), "reduce_grad", experts_to_copy, local_grads,
            slot_grads, True, real=False)
