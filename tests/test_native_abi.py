"""moonep_ops/native.py's ctypes table against the library headers (CPU, no library needed): the
same exports, the same argument count, compatible types in order and the same return type.  A
prototype changed on one side only fails here, not as a crash on the GPU."""
from __future__ import annotations

import ctypes
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from moonep_ops import native

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_abi", ROOT / "scripts" / "check_abi.py")
check_abi = importlib.util.module_from_spec(_spec)
sys.modules["check_abi"] = check_abi          # dataclasses look their module up by name
_spec.loader.exec_module(check_abi)

# C type of a prototype -> the ctypes types that pass it correctly on x86-64
_COMPAT = {
    "int": {ctypes.c_int}, "int32_t": {ctypes.c_int}, "size_t": {ctypes.c_size_t},
    "int64_t": {ctypes.c_int64, ctypes.c_longlong}, "long long": {ctypes.c_longlong, ctypes.c_int64},
    "void": {None}, "float": {ctypes.c_float},
}


def _compatible(ctype: str, py) -> bool:
    c = " ".join(ctype.replace("const ", "").split()).replace(" *", "*")
    if c == "char*":
        return py is ctypes.c_char_p
    if c in ("float*",):
        return py in (ctypes.POINTER(ctypes.c_float), ctypes.c_void_p)
    if c in ("int*", "int32_t*"):
        return py in (ctypes.POINTER(ctypes.c_int), ctypes.c_void_p)
    if c in ("int64_t*", "long long*"):
        return py in (ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p)
    if c.endswith("**") or c.endswith("* const*") or re.search(r"\*\s*\*", c):
        return py in (ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
    if c.endswith("*") or c == "cudaStream_t":
        return py is ctypes.c_void_p
    return py in _COMPAT.get(c, set())


def _gemm_header_abi() -> int:
    text = (ROOT / "cutlass_kernels/moonep_gemm.h").read_text()
    return int(re.search(r"MOONEP_GEMM_ABI_VERSION\s+(\d+)", text).group(1))


# A header of the FP8 ABI (native.GEMM_FP8_ABI_VERSION) adds the FP8 grouped GEMM (native.GEMM_FP8_PROTOTYPES) to ABI 8's table.
# A header of ABI 12 (native.GEMM_FP8_WGRAD_ABI_VERSION) adds the FP8 wgrad GEMM as well.
_GEMM_TABLE = {**native.GEMM_PROTOTYPES,
               **(native.GEMM_FP8_PROTOTYPES
                  if _gemm_header_abi() >= native.GEMM_FP8_ABI_VERSION else {}),
               **(native.GEMM_FP8_WGRAD_PROTOTYPES
                  if _gemm_header_abi() >= native.GEMM_FP8_WGRAD_ABI_VERSION else {})}

CASES = [("csrc/moonep_ep.h", {**native.EP_PROTOTYPES}, False),
         ("csrc/moonep_ep.h", {**native.EP_DIAGNOSTICS}, True),
         ("cutlass_kernels/moonep_gemm.h", _GEMM_TABLE, False)]


@pytest.mark.parametrize("header,table,diagnostics", CASES,
                         ids=["ep", "ep-diagnostics", "gemm"])
def test_ctypes_table_matches_the_header(header, table, diagnostics):
    protos = {n: p for n, p in check_abi.parse_header(ROOT / header).items()
              if p.diagnostics == diagnostics}
    assert set(table) == set(protos), (f"only in native.py: {sorted(set(table) - set(protos))}; "
                                       f"only in {header}: {sorted(set(protos) - set(table))}")
    for name, (res, args) in table.items():
        p = protos[name]
        assert len(args) == len(p.args), f"{name}: {len(args)} ctypes args, header {p.c()}"
        for i, (py, (ctype, arg)) in enumerate(zip(args, p.args)):
            assert _compatible(ctype, py), f"{name} arg {i} ({arg}): header {ctype}, ctypes {py}"
        assert _compatible(p.ret, res), f"{name}: returns {p.ret}, ctypes {res}"


def test_abi_versions_match_the_headers():
    ep = (ROOT / "csrc/moonep_ep.h").read_text()
    assert re.search(rf"MOONEP_EP_ABI_VERSION\s+{native.EP_ABI_VERSION}\b", ep)
    assert _gemm_header_abi() in native.GEMM_ABI_VERSIONS
    assert native.GEMM_ABI_VERSION in native.GEMM_ABI_VERSIONS
