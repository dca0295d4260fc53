"""What the launchers need of the running process: SM counts, the raw current stream, the
current device (``on_device_of``, ``call_on``), and whether value checks run (``MOONEP_VALIDATE``, moonep_ops/settings.py).
Shape, dtype and device checks always run: they read no data.
"""
from __future__ import annotations

import torch

from . import settings

_SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device (cached: the launchers need it on every call)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNTS:
        _SM_COUNTS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNTS[idx]


def validate_mode() -> str:
    return settings.get("MOONEP_VALIDATE").lower()


_OFF, _ON = ("0", "off", "false"), ("1", "on", "true")


def should_validate(t: torch.Tensor) -> bool:
    mode = validate_mode()
    if mode in _OFF:
        return False
    if t.is_cpu:                        # (device.type costs 0.6 us a read, is_cpu 0.05)
        return True
    if mode in _ON:
        return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    return False


def may_validate(device: torch.device) -> bool:
    """Whether ``should_validate`` can be true for a tensor on ``device`` under the current
    MOONEP_VALIDATE (a caller that keeps this per device, with the switch's value in its key,
    asks should_validate only where it can be)."""
    mode = validate_mode()
    return mode not in _OFF and (device.type == "cpu" or mode in _ON)


def current_raw_stream(device: torch.device) -> int:
    """The current CUDA stream of ``device`` as a raw ``cudaStream_t`` (an int): what the C
    launchers take.  ``torch.cuda.current_stream(device).cuda_stream`` builds a Stream object
    on every call (~2 us); this is the same value, as torch's compiled code reads it."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return _raw_stream(idx)


def _raw_stream_fallback(idx: int) -> int:
    return torch.cuda.current_stream(idx).cuda_stream


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _raw_stream_fallback


class on_device_of:
    """``with on_device_of(dev):`` makes ``dev`` the current CUDA device for the block, as
    ``torch.cuda.device(dev)`` does, but costs one C call when it already is (the common case:
    the launchers' streams belong to the current device, and the ops run on it)."""

    __slots__ = ("idx", "prev")

    def __init__(self, device: torch.device):
        self.idx = device.index if device.index is not None else -1
        self.prev = -1

    def __enter__(self):
        if self.idx >= 0:
            cur = torch.cuda.current_device()
            if cur != self.idx:
                torch.cuda.set_device(self.idx)
                self.prev = cur
        return self

    def __exit__(self, *exc):
        if self.prev >= 0:
            torch.cuda.set_device(self.prev)
        return False


# The current CUDA device's index without torch.cuda.current_device's lazy-init test: call_on
# reads it for a tensor's device, so CUDA is initialised (a CPU-only build: the public function).
current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def call_on(device: torch.device, fn, *args):
    """``fn(*args)`` with ``device`` the current CUDA device, as inside ``on_device_of(device)``,
    but without the context manager's object and calls when it already is current (a caller on
    the hot path may test ``device.index`` against ``current_device()`` itself and call ``fn``)."""
    idx = device.index
    if idx is None or idx == current_device():
        return fn(*args)
    with on_device_of(device):
        return fn(*args)
