"""Run-time switches (environment-driven) and the few constants that are not tuned numbers.

MOONEP_VALIDATE  auto (default): value checks (expert ids in range, histogram == bincount(topk),
                 row sums) run for CPU tensors only, since on CUDA they need a host sync;
                 1: also on CUDA outside CUDA-graph capture (debugging); 0: never.
Shape, dtype and device checks always run: they read no data.
"""
from __future__ import annotations

import os

import torch


_SM_COUNTS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device (cached: the launchers need it on every call)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNTS:
        _SM_COUNTS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNTS[idx]


def validate_mode() -> str:
    return os.environ.get("MOONEP_VALIDATE", "auto").lower()


def should_validate(t: torch.Tensor) -> bool:
    mode = validate_mode()
    if mode in ("0", "off", "false"):
        return False
    if t.device.type == "cpu":
        return True
    if mode in ("1", "on", "true"):
        return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    return False
