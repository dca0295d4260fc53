"""Every environment switch of moonep_ops, declared once: name, default, values, what it does.

The library reads the environment only here (tests/test_layout.py enforces it), through ``get``,
which refuses an undeclared name.  Switches are read on every use, not cached at import: tests
and users change them at run time.  docs/api.md ("Environment switches") lists the same table.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Switch:
    name: str
    default: str
    values: str
    what: str


# One switch a paragraph: its name, its default in quotes ("" when unset), its values; then,
# indented, what it does.  The last three are not ours: read as their owners define them.
_DECLARED = """
MOONEP_VALIDATE "auto": auto / 1 / 0
    value checks (expert ids in range, histogram == bincount(topk), row sums): auto runs them
    on CPU tensors only (on CUDA they need a host sync), 1 also on CUDA outside CUDA-graph
    capture, 0 never; shape, dtype and device checks always run
MOONEP_GEMM_BACKEND "auto": auto / cutlass / torch / reference
    force the grouped GEMMs' backend among those the data allows (the FP8 GEMMs: reference or
    auto)
MOONEP_GEMM_FAMILY "auto": auto / moonep / torch
    force the bf16 GEMM's kernel family instead of the device-side selector's choice
MOONEP_GEMM_CANDIDATES "": name,name,...
    narrow the bf16 GEMM's candidate configs (one family)
MOONEP_GEMM_PDL "1": 1 / 0
    programmatic dependent launch of the GEMM kernels after their prep kernel
MOONEP_GEMM_FP8_CONFIG "": c128x128 / p64x128
    force the FP8 forward / dgrad GEMM's config
MOONEP_GEMM_FP8_WGRAD_CONFIG "": a config name of gemm/fp8_wgrad_cost.py
    force the FP8 wgrad GEMM's config
MOONEP_FP8_QUANT "auto": auto / reference
    reference: the FP8 quantisers' torch reference on CUDA too (instead of Triton)
MOONEP_LIB_DIR "": a directory
    where libmoonep_gemm.so and libmoonep_ep.so are loaded from (default: moonep_ops/lib)
MOONEP_DISABLE_NATIVE "0": 0 / 1
    1: never load the CUDA libraries
MOONEP_BARRIER_TIMEOUT_S "60": seconds
    the CUDA data plane's cross-rank barrier timeout (read when a backend is built)
MOONEP_PLANNER "auto": auto / device / torch
    the CUDA symmetric backend's planner: the device planner's kernel or moonep::plan on device
    tensors
MOONEP_COMBINE "auto": auto / stage / direct
    the CUDA symmetric backend's combine: staged copies, or direct reads (one rank)
CUDA_MODULE_LOADING "LAZY": LAZY / EAGER
    CUDA's own: virtual ranks prime the libraries when kernels load lazily
CUTLASS_INCLUDE "": a CUTLASS include directory
    python -m moonep_ops.build: the CUTLASS headers (default: the nvidia-cutlass package)
NVCC "": a path
    python -m moonep_ops.build: the nvcc to run (default: PATH)
"""


def _parse(text: str) -> dict[str, Switch]:
    """The Switches of ``_DECLARED``; a line that is neither a switch nor its description
    raises (so no switch goes missing quietly)."""
    rows: dict[str, list[str]] = {}
    for line in text.strip("\n").splitlines():
        if line.startswith("    ") and rows:
            rows[name].append(line.strip())
            continue
        m = re.fullmatch(r'(\w+) "([^"]*)": (.+)', line)
        if m is None:
            raise ValueError(f"moonep_ops.settings: not a switch declaration: {line!r}")
        name = m.group(1)
        rows[name] = [m.group(2), m.group(3)]
    return {n: Switch(n, default, values, " ".join(what))
            for n, (default, values, *what) in rows.items()}


SWITCHES = _parse(_DECLARED)

# name -> (its key in os.environ's bytes mapping, its default)
_KEYS = {n: (os.fsencode(n), s.default) for n, s in SWITCHES.items()}
_POSIX = os.name == "posix"
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


def get(name: str) -> str:
    """The switch's value, its default when unset.  ``os.environ.get`` raises and catches a
    KeyError for every unset name (~1 us, and a GEMM call reads four switches): on POSIX this
    reads the bytes mapping os.environ keeps in step with every set and delete (monkeypatch and
    ``os.environ[...] = v`` included), decoded as os.fsdecode does; elsewhere os.environ
    itself."""
    key, default = _KEYS[name]                          # KeyError: declare the switch above
    data = getattr(os.environ, "_data", None)
    if not _POSIX or type(data) is not dict:
        return os.environ.get(name, default)
    v = data.get(key)
    return default if v is None else v.decode(_FS_ENCODING, _FS_ERRORS)


def snapshot(names) -> Callable[[], tuple]:
    """A function returning the raw values of these switches (bytes, or None when unset) as one
    tuple: a cache key that changes with any of them, read in one call (five ``get`` calls cost
    a GEMM call ~0.7 us of its ~8 us of Python).  Not for their meaning: use ``get``."""
    keys = tuple(_KEYS[n][0] for n in names)           # KeyError: declare the switch above
    names = tuple(names)

    def read() -> tuple:
        data = getattr(os.environ, "_data", None)
        if not _POSIX or type(data) is not dict:
            return tuple(map(os.environ.get, names))
        return tuple(map(data.get, keys))

    return read


def flag(name: str) -> bool:
    """A 0/1 switch: anything but "" and "0" is on."""
    return get(name) not in ("", "0")


__all__ = ["SWITCHES", "Switch", "flag", "get", "snapshot"]
