"""Loader for the compiled GPU library (plain C ABI, loaded with ctypes).

The CUDA kernels are built by ``python -m moonep_ops.build`` into ``moonep_ops/lib/*.so``.  They
export ``extern "C"`` functions that take raw device pointers, ints and a ``cudaStream_t``, so the
same binary works with any torch version (no torch C++ ABI involved).  Nothing here imports CUDA
or touches a GPU; :func:`gemm_lib` returns ``None`` when the library is absent or cannot be
loaded (CPU machines, a build for another toolkit), and callers fall back to torch.

Environment:
  MOONEP_LIB_DIR        look for the libraries there instead of ``moonep_ops/lib``.
  MOONEP_DISABLE_NATIVE=1  pretend the library is missing (forces the torch fallbacks).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

# Bumped whenever an exported signature changes; the library reports its own value and a
# mismatch is treated as "not loadable" rather than risking a call with the wrong arguments.
GEMM_ABI_VERSION = 7
EP_ABI_VERSION = 2          # csrc/moonep_ep.h: MOONEP_EP_ABI_VERSION

_LIB_DIR = Path(__file__).resolve().parent / "lib"
_gemm = None
_gemm_error: str | None = None
_gemm_tried = False


class NativeLibraryMissing(RuntimeError):
    """Raised when a CUDA-only code path needs the compiled library and it is not loaded."""


def lib_dir() -> Path:
    return Path(os.environ.get("MOONEP_LIB_DIR", _LIB_DIR))


def _declare_gemm(lib: ctypes.CDLL) -> None:
    c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
    lib.moonep_gemm_abi_version.restype = c_int
    lib.moonep_gemm_abi_version.argtypes = []
    lib.moonep_gemm_last_error.restype = ctypes.c_char_p
    lib.moonep_gemm_last_error.argtypes = []
    lib.moonep_gemm_num_configs.restype = c_int
    lib.moonep_gemm_num_configs.argtypes = [c_int]
    lib.moonep_gemm_config_info.restype = c_int
    # kind, cfg, int[8] out: BM, BN, BK, cluster_m, cluster_n, pingpong, 0, 0
    lib.moonep_gemm_config_info.argtypes = [c_int, c_int, ctypes.POINTER(c_int)]
    lib.moonep_gemm_workspace_bytes.restype = c_size_t
    lib.moonep_gemm_workspace_bytes.argtypes = [c_int, c_int, c_int]
    lib.moonep_grouped_gemm.restype = c_int
    lib.moonep_grouped_gemm.argtypes = [
        c_int, c_int, c_int,            # kind, config (-1: select on device), raster (0 M, 1 N)
        c_void_p, c_void_p, c_void_p,   # A, B_local, B_slot
        c_void_p, c_void_p,             # D (or D_local), D_slot (wgrad only)
        c_void_p,                       # cu_seqlens (int32, device)
        c_int, c_int, c_int, c_int, c_int,  # G, epn, M, N, K
        ctypes.POINTER(ctypes.c_float), c_int, c_int,  # tuning table (host), candidate mask, flags
        c_void_p, c_size_t, c_int,      # workspace (device), its bytes, sm_count
        c_void_p,                       # cudaStream_t
    ]


def gemm_lib():
    """The loaded ``libmoonep_gemm.so`` (a ``ctypes.CDLL``), or ``None``."""
    global _gemm, _gemm_error, _gemm_tried
    if _gemm_tried:
        return _gemm
    _gemm_tried = True
    if os.environ.get("MOONEP_DISABLE_NATIVE", "0") not in ("", "0"):
        _gemm_error = "disabled by MOONEP_DISABLE_NATIVE"
        return None
    path = lib_dir() / "libmoonep_gemm.so"
    if not path.exists():
        _gemm_error = f"{path} not found (build it with `python -m moonep_ops.build`)"
        return None
    try:
        lib = ctypes.CDLL(str(path))
        _declare_gemm(lib)
        version = lib.moonep_gemm_abi_version()
    except (OSError, AttributeError) as e:  # wrong arch, missing symbol, missing libcuda
        _gemm_error = f"could not load {path}: {e}"
        return None
    if version != GEMM_ABI_VERSION:
        _gemm_error = f"{path} has ABI version {version}, this package expects {GEMM_ABI_VERSION}"
        return None
    _gemm = lib
    return _gemm


def gemm_load_error() -> str | None:
    """Why :func:`gemm_lib` returned ``None`` (``None`` if it loaded)."""
    gemm_lib()
    return _gemm_error


def require_gemm_lib():
    lib = gemm_lib()
    if lib is None:
        raise NativeLibraryMissing(
            "moonep grouped GEMM: the CUTLASS library is not available: " + str(_gemm_error))
    return lib


def gemm_last_error() -> str:
    lib = gemm_lib()
    if lib is None:
        return str(_gemm_error)
    msg = lib.moonep_gemm_last_error()
    return msg.decode() if msg else ""


# ---------------------------------------------------------------------------------------------
# libmoonep_ep.so: the GPU data plane (csrc/).  Each Python module that calls into it declares
# the argtypes of its own functions (declare_ep); this loader only checks the ABI version.
# ---------------------------------------------------------------------------------------------
_ep = None
_ep_error: str | None = None
_ep_tried = False


def ep_lib():
    """The loaded ``libmoonep_ep.so`` (a ``ctypes.CDLL``), or ``None``."""
    global _ep, _ep_error, _ep_tried
    if _ep_tried:
        return _ep
    _ep_tried = True
    if os.environ.get("MOONEP_DISABLE_NATIVE", "0") not in ("", "0"):
        _ep_error = "disabled by MOONEP_DISABLE_NATIVE"
        return None
    path = lib_dir() / "libmoonep_ep.so"
    if not path.exists():
        _ep_error = f"{path} not found (build it with `python -m moonep_ops.build`)"
        return None
    try:
        lib = ctypes.CDLL(str(path))
        lib.moonep_ep_abi_version.restype = ctypes.c_int
        lib.moonep_ep_last_error.restype = ctypes.c_char_p
        version = lib.moonep_ep_abi_version()
    except (OSError, AttributeError) as e:
        _ep_error = f"could not load {path}: {e}"
        return None
    if version != EP_ABI_VERSION:
        _ep_error = f"{path} has ABI version {version}, this package expects {EP_ABI_VERSION}"
        return None
    _ep = lib
    return _ep


def require_ep_lib():
    lib = ep_lib()
    if lib is None:
        raise NativeLibraryMissing("moonep GPU data plane: libmoonep_ep.so is not available: "
                                   + str(_ep_error))
    return lib


def declare_ep(name: str, restype, argtypes):
    """Declare one exported function of libmoonep_ep.so and return it."""
    fn = getattr(require_ep_lib(), name)
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def ep_check(rc: int, what: str) -> None:
    """Raise a RuntimeError for a non-zero launcher return code."""
    if rc != 0:
        msg = ep_lib().moonep_ep_last_error()
        raise RuntimeError(f"{what} failed (CUDA error {rc}): {msg.decode() if msg else ''}")
