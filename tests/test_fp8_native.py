"""The FP8 GEMM's backend choice against the library's declared ABI (CPU: stub libraries).

native.py accepts libmoonep_gemm.so of ABI 8 (bf16 GEMMs) or 10 (ABI 8 + the FP8 grouped GEMM;
ABI 9's FP8 export had another signature and is refused), and grouped_mm_fp8 calls the kernel
only when the library *reports* ABI >= 10 and exports every FP8 function; every other case runs
the reference.  The stubs below are tiny C libraries
(gcc) that export the right names and report a chosen version: nothing is ever called but the
version function.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moonep_ops import native
from moonep_ops.ops import grouped_mm_fp8 as g8

ROOT = Path(__file__).resolve().parent.parent
FP8_NAMES = tuple(native.GEMM_FP8_PROTOTYPES)
CC = shutil.which("cc") or shutil.which("gcc")


def _stub(tmp_path: Path, abi: int, fp8: bool) -> native._Lib:
    names = [n for n in native.GEMM_PROTOTYPES if n != "moonep_gemm_abi_version"]
    names += list(FP8_NAMES) if fp8 else []
    src = [f"int moonep_gemm_abi_version(void) {{ return {abi}; }}"]
    src += [f"int {n}(void) {{ return 0; }}" for n in names]
    (tmp_path / "stub.c").write_text("\n".join(src) + "\n")
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(tmp_path / "libmoonep_gemm.so"),
                    str(tmp_path / "stub.c")], check=True)
    return native._Lib("libmoonep_gemm.so", "moonep_gemm_abi_version", native.GEMM_ABI_VERSION,
                       native.GEMM_PROTOTYPES, {}, versions=native.GEMM_ABI_VERSIONS,
                       since=native.GEMM_SINCE)


CUDA_LIKE = SimpleNamespace(device=torch.device("cuda"))   # backend_for_fp8 reads .device only


@pytest.mark.skipif(CC is None, reason="needs a C compiler for the stub library")
@pytest.mark.parametrize("abi,fp8,loads,has_fp8,why", [
    (8, False, True, False, "ABI version 8 (< 10)"),
    (8, True, True, False, "ABI version 8 (< 10)"),     # the version decides, not the symbol
    (10, False, True, False, "lacks moonep_gemm_fp8_num_configs, moonep_gemm_fp8_config_info, "
                             "moonep_gemm_fp8_workspace_bytes, moonep_grouped_gemm_fp8"),
    (10, True, True, True, None),
    (11, True, True, True, None),                      # ABI 10 + MOONEP_GEMM_KEEP_TAIL
    (12, True, True, True, None),                      # ABI 11 + the FP8 wgrad GEMM
    (9, True, False, False, "expects 8 or 10 or 11 or 12"),  # the one-config FP8 signature
    (13, True, False, False, "expects 8 or 10 or 11 or 12"),
    (7, False, False, False, "expects 8 or 10 or 11 or 12"),
])
def test_fp8_kernel_only_from_an_abi10_library(tmp_path, monkeypatch, abi, fp8, loads, has_fp8,
                                              why):
    monkeypatch.setenv("MOONEP_LIB_DIR", str(tmp_path))
    monkeypatch.delenv("MOONEP_DISABLE_NATIVE", raising=False)
    monkeypatch.delenv("MOONEP_GEMM_BACKEND", raising=False)
    lib = _stub(tmp_path, abi, fp8)
    monkeypatch.setattr(native, "_GEMM", lib)
    assert (native.gemm() is not None) == loads
    assert (native.gemm_fp8() is not None) == has_fp8
    assert native.gemm_keep_tail() == (loads and abi >= native.GEMM_KEEP_TAIL_ABI_VERSION)
    if has_fp8:
        assert native.gemm_fp8_unavailable() is None
        assert g8.backend_for_fp8(CUDA_LIKE) == "cutlass"
        monkeypatch.setenv("MOONEP_GEMM_BACKEND", "reference")
        assert g8.backend_for_fp8(CUDA_LIKE) == "reference"
    else:
        assert why in native.gemm_fp8_unavailable()
        assert g8.backend_for_fp8(CUDA_LIKE) == "reference"
        with pytest.raises(native.NativeLibraryMissing, match="FP8"):
            native.require_gemm_fp8()
    assert g8.backend_for_fp8(torch.empty(1)) == "reference"        # CPU: always


def test_missing_library_means_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONEP_LIB_DIR", str(tmp_path))
    monkeypatch.delenv("MOONEP_DISABLE_NATIVE", raising=False)
    lib = native._Lib("libmoonep_gemm.so", "moonep_gemm_abi_version", native.GEMM_ABI_VERSION,
                      native.GEMM_PROTOTYPES, {}, versions=native.GEMM_ABI_VERSIONS,
                      since=native.GEMM_SINCE)
    monkeypatch.setattr(native, "_GEMM", lib)
    assert native.gemm_fp8() is None and "not found" in native.gemm_fp8_unavailable()
    assert g8.backend_for_fp8(CUDA_LIKE) == "reference"


def _function(path: str, name: str) -> ast.FunctionDef:
    tree = ast.parse((ROOT / path).read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _launch_args(path: str) -> int:
    """Arguments of the library call that ``path``'s _launch makes: the operands it hands to
    Fp8Gemm.launch, then the common tail Fp8Gemm.launch appends to them."""
    tail = next(c for c in ast.walk(_function("moonep_ops/ops/grouped_mm_fp8.py", "launch"))
                if isinstance(c, ast.Call) and any(isinstance(a, ast.Starred) for a in c.args))
    after = [isinstance(a, ast.Starred) for a in tail.args].index(True) + 1   # *operands, then
    call = next(c for c in ast.walk(_function(path, "_launch")) if isinstance(c, ast.Call)
                and isinstance(c.func, ast.Attribute) and c.func.attr == "launch")
    return len(call.args[0].elts) + len(tail.args) - after


def test_launch_matches_the_declared_fp8_prototypes():
    """The kernels' contract is the call in each _launch: its argument count is the ctypes
    table's, for the FP8 GEMM and the FP8 wgrad GEMM; the workspace query takes (G, sms)."""
    assert _launch_args("moonep_ops/ops/grouped_mm_fp8.py") == len(
        native.GEMM_FP8_PROTOTYPES["moonep_grouped_gemm_fp8"][1])
    assert _launch_args("moonep_ops/ops/grouped_mm_fp8_wgrad.py") == len(
        native.GEMM_FP8_WGRAD_PROTOTYPES["moonep_grouped_gemm_fp8_wgrad"][1])
    init = _function("moonep_ops/ops/grouped_mm_fp8.py", "__init__")
    query = next(n for n in ast.walk(init) if isinstance(n, ast.Lambda)).body
    for table in (native.GEMM_FP8_PROTOTYPES, native.GEMM_FP8_WGRAD_PROTOTYPES):
        kind = "fp8_wgrad" if table is native.GEMM_FP8_WGRAD_PROTOTYPES else "fp8"
        assert len(query.args) == len(table[f"moonep_gemm_{kind}_workspace_bytes"][1])
