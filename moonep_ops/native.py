"""The C ABI of the two GPU libraries, declared once: loading, versions, every export's prototype.

The CUDA kernels are built by ``python -m moonep_ops.build`` into ``moonep_ops/lib/``:

  libmoonep_gemm.so   cutlass_kernels/  (header cutlass_kernels/moonep_gemm.h)  CUTLASS grouped GEMMs
  libmoonep_ep.so     csrc/             (header csrc/moonep_ep.h)               data plane, device
                                                                                planner, SwiGLU

Both export ``extern "C"`` functions that take raw device pointers, ints and a ``cudaStream_t``, so
one binary serves every torch version (no torch C++ ABI).  Nothing here touches a GPU: ``gemm()``
and ``ep()`` return ``None`` when a library is absent or cannot be loaded (CPU machines, a build
for another toolkit), and the ops fall back to torch.  ``tests/test_native_abi.py`` checks this
table against the headers, so a prototype changed on one side only fails on CPU.

Every launcher returns 0, or a CUDA error code with the message in ``*_last_error()``; none of
them synchronises the host.

Environment:
  MOONEP_LIB_DIR           look for the libraries there instead of ``moonep_ops/lib``;
  MOONEP_DISABLE_NATIVE=1  pretend the libraries are missing (forces the torch fallbacks).
"""
from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_float, c_int, c_int64, c_longlong, c_size_t, c_void_p
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from . import settings

# Bumped with every exported signature change; the library reports its own value, and a mismatch
# makes the library "not loadable" rather than risking a call with the wrong arguments.
GEMM_ABI_VERSION = 8       # cutlass_kernels/moonep_gemm.h (the bf16 exports' ABI)
EP_ABI_VERSION = 7         # csrc/moonep_ep.h: MOONEP_EP_ABI_VERSION

# The FP8 grouped GEMM (moonep_ops/ops/grouped_mm_fp8.py) is a later ABI of libmoonep_gemm.so:
# ABI 10 = every ABI 8 export unchanged plus GEMM_FP8_PROTOTYPES (ABI 9 had a one-config FP8
# GEMM with another signature: such a library is refused, rebuild it).  So a library of either
# loads and serves the bf16 GEMMs, and the FP8 ops use the kernel only when the library reports
# ABI >= GEMM_FP8_ABI_VERSION and exports every one of them (``gemm_fp8()``); otherwise they run
# their reference.  The decision reads the version the library reports, never ``hasattr``
# alone, so an ABI 8 library that happens to carry a same-named symbol is not called.
GEMM_FP8_ABI_VERSION = 10
# ABI 11 = ABI 10 plus the MOONEP_GEMM_KEEP_TAIL flag (no new export): the ops send it only to a
# library that reports 11 (``gemm_keep_tail``); an older one zeroes the tail, which the
# "undefined tail" contract allows.
GEMM_KEEP_TAIL_ABI_VERSION = 11
# ABI 12 = ABI 11 plus GEMM_FP8_WGRAD_PROTOTYPES (the FP8 weight-gradient grouped GEMM,
# moonep_ops/ops/grouped_mm_fp8_wgrad.py): used only from a library that reports 12 and exports
# every one of them (``gemm_fp8_wgrad``); an older library leaves the op on its reference.
GEMM_FP8_WGRAD_ABI_VERSION = 12
GEMM_ABI_VERSIONS = (GEMM_ABI_VERSION, GEMM_FP8_ABI_VERSION, GEMM_KEEP_TAIL_ABI_VERSION,
                     GEMM_FP8_WGRAD_ABI_VERSION)

_vpp = POINTER(c_void_p)
_i64p = POINTER(c_int64)

# name -> (restype, argtypes).  Argument order and meaning: the library headers.
GEMM_PROTOTYPES: dict[str, tuple] = {
    "moonep_gemm_abi_version": (c_int, []),
    "moonep_gemm_last_error": (c_char_p, []),
    "moonep_gemm_num_configs": (c_int, [c_int]),
    # kind, cfg, int[8] out: BM, BN, BK, cluster_m, cluster_n, pingpong, epilogue width, swap-AB
    "moonep_gemm_config_info": (c_int, [c_int, c_int, POINTER(c_int)]),
    "moonep_gemm_workspace_bytes": (c_size_t, [c_int, c_int, c_int]),
    "moonep_grouped_gemm": (c_int, [
        c_int, c_int, c_int,             # kind, config (-1: select on device), raster (0 M, 1 N)
        c_void_p, c_void_p, c_void_p,    # A, B_local, B_slot
        c_void_p, c_void_p,              # D (or D_local), D_slot (wgrad only)
        c_void_p,                        # cu_seqlens (int32, device)
        c_int, c_int, c_int, c_int, c_int,   # G, epn, m, n, k (the CUTLASS problem shape)
        POINTER(c_float), c_int, c_int,  # tuning table (host), candidate mask, flags
        c_void_p, c_size_t, c_int,       # workspace (device), its bytes, sm_count
        c_void_p,                        # cudaStream_t
    ]),
}


def _fp8_gemm_prototypes(kind: str, operands: list) -> dict[str, tuple]:
    """The four exports of one FP8 grouped GEMM (``kind`` "fp8" or "fp8_wgrad"): its config
    count and geometry, its workspace bytes and the launch, whose arguments after its own
    ``operands`` (pointers, then the problem's ints) are the same for both."""
    return {
        f"moonep_gemm_{kind}_num_configs": (c_int, []),
        # config, int[8] out: BM, BN, BK, cluster_m, cluster_n, pingpong, epilogue width, swap-AB
        f"moonep_gemm_{kind}_config_info": (c_int, [c_int, POINTER(c_int)]),
        f"moonep_gemm_{kind}_workspace_bytes": (c_size_t, [c_int, c_int]),     # G, sm_count
        f"moonep_grouped_gemm_{kind}": (c_int, operands + [
            c_int, POINTER(c_float), c_int,  # config (-1: device choice), tuning table (host), flags
            c_void_p, c_size_t, c_int,       # workspace (device), its bytes, sm_count
            c_void_p,                        # cudaStream_t
        ]),
    }


# ABI >= 10 only.  Argument order: the call in grouped_mm_fp8._launch (the kernel's contract).
GEMM_FP8_PROTOTYPES = _fp8_gemm_prototypes("fp8", [
    c_void_p, c_void_p,              # A [m, k] e4m3, A scales [m, ceil(k/128)] fp32
    c_void_p, c_void_p,              # B_local [epn, n, k] e4m3, its [epn, ceil(n/128), ceil(k/128)] scales
    c_void_p, c_void_p,              # B_slot, its scales (same shapes)
    c_void_p,                        # D [m, n] bf16
    c_void_p,                        # cu_seqlens [G] int32 (device)
    c_int, c_int, c_int, c_int, c_int,   # G, epn, m, n, k
])

# ABI >= 12 only.  Argument order: the call in grouped_mm_fp8_wgrad._launch.
GEMM_FP8_WGRAD_PROTOTYPES = _fp8_gemm_prototypes("fp8_wgrad", [
    c_void_p, c_void_p,              # dy^T [O, 128*Nb] e4m3, its [Nb, O] token-tile scales
    c_void_p, c_void_p,              # x^T [I, 128*Nb] e4m3, its [Nb, I] scales
    c_void_p, c_void_p,              # dW local, dW slot: bf16 [epn, O, I] each
    c_void_p,                        # cu_seqlens [G] int32 (device)
    c_int, c_int, c_int, c_int, c_int,   # G, epn, Nb (token tiles), O, I
])

# {ABI: exports it added}: what _GEMM declares only from a library of at least that ABI.
GEMM_SINCE = {GEMM_FP8_ABI_VERSION: GEMM_FP8_PROTOTYPES, GEMM_KEEP_TAIL_ABI_VERSION: {},
              GEMM_FP8_WGRAD_ABI_VERSION: GEMM_FP8_WGRAD_PROTOTYPES}

EP_PROTOTYPES: dict[str, tuple] = {
    "moonep_ep_abi_version": (c_int, []),
    "moonep_ep_last_error": (c_char_p, []),
    # data plane (csrc/ep_kernels.cu)
    "moonep_ep_barrier": (c_int, [c_void_p, c_void_p, c_int, c_int, c_void_p, c_longlong, c_int,
                                  c_void_p]),
    "moonep_ep_hist_publish": (c_int, [c_void_p, c_int, c_int, c_int, c_int, c_int, c_int, c_void_p,
                                       c_void_p, c_void_p]),
    "moonep_ep_dispatch_send": (c_int, [c_void_p, c_int64, c_void_p, c_void_p, c_int, c_int, c_int,
                                        c_int, c_int, c_int, c_int, c_void_p, c_void_p, c_void_p,
                                        c_void_p, c_void_p, c_void_p]),
    "moonep_ep_dispatch_recv": (c_int, [c_void_p, c_void_p, c_int, c_int64, c_void_p, c_void_p,
                                        c_void_p, c_int, c_int, c_void_p, c_void_p, c_int, c_void_p]),
    "moonep_ep_combine_stage": (c_int, [c_void_p, c_int64, c_int64, c_void_p, c_void_p, c_void_p,
                                        c_void_p]),
    "moonep_ep_combine_recv": (c_int, [c_void_p, c_void_p, c_int, c_int, c_int, c_int, c_int,
                                       c_void_p, c_int, c_int, c_void_p, c_void_p, c_void_p, c_int,
                                       c_void_p, c_void_p]),
    "moonep_ep_publish_ptrs": (c_int, [c_void_p, c_int, c_int, c_void_p, c_void_p, c_int64,
                                       c_void_p]),
    "moonep_ep_push_weights": (c_int, [c_int, _vpp, _vpp, _i64p, c_void_p, c_int, c_int, c_int,
                                       c_void_p, c_int, c_void_p]),
    "moonep_ep_reduce_grads": (c_int, [c_int, _vpp, _vpp, _i64p, c_void_p, c_int, c_int, c_int,
                                       c_void_p, c_int, c_int, c_void_p]),
    "moonep_ep_zero_slots": (c_int, [c_int, _vpp, _i64p, c_void_p, c_int, c_int, c_int, c_void_p]),
    # SwiGLU (csrc/swiglu.cu)
    "moonep_ep_swiglu_fwd": (c_int, [c_void_p, c_void_p, c_void_p, c_int64, c_int, c_void_p]),
    "moonep_ep_swiglu_bwd": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
                                     c_int64, c_int, c_void_p]),
    "moonep_ep_glu_fwd": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_int64,
                                  c_void_p, c_int64, c_float, c_float, c_float, c_int, c_void_p]),
    "moonep_ep_glu_bwd": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int,
                                  c_int64, c_void_p, c_void_p, c_void_p, c_int64, c_float, c_float,
                                  c_float, c_int, c_void_p]),
    "moonep_ep_bias_scale_rows": (c_int, [c_void_p, c_void_p, c_void_p, c_int, c_int64, c_void_p,
                                          c_void_p, c_int64, c_int, c_void_p]),
    "moonep_ep_bias_scale_rows_bwd": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_int,
                                              c_int64, c_void_p, c_void_p, c_void_p, c_void_p,
                                              c_void_p, c_int64, c_int, c_void_p]),
    "moonep_ep_row_tile_work": (c_int64, [c_int64, c_int, c_int64, c_int, c_int]),
    "moonep_ep_glu_bwd_bias_grads": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,
                                             c_void_p, c_int, c_int64, c_void_p, c_void_p,
                                             c_void_p, c_void_p, c_void_p, c_void_p, c_int64,
                                             c_float, c_float, c_float, c_int, c_void_p]),
    # device planner (csrc/plan_kernels.cu)
    "moonep_plan_prepare": (c_int, []),
    "moonep_plan_workspace_bytes": (c_size_t, [c_int, c_int, c_int, c_int]),
    "moonep_plan": (c_int, [
        c_void_p, c_void_p,                                  # hist_RX, topk_sK
        c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int,  # s K rank R E S tp NvS
        c_int, c_int64,                                      # slack_ppm, replica_cost
        c_void_p, c_void_p, c_void_p, c_void_p, c_void_p,    # dst, cu, etc, zf, stats
        c_void_p, c_size_t, c_void_p, c_void_p]),            # workspace, bytes, err, stream
    "moonep_plan_group": (c_int, [
        c_void_p,                                            # hist_RX
        c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int,  # s K rank R E S tp NvS
        c_int, c_int64,                                      # slack_ppm, replica_cost
        c_void_p, c_void_p, c_void_p, c_void_p,              # cu, etc, zf, stats
        c_void_p, c_size_t, c_void_p, c_void_p]),            # workspace, bytes, err, stream
}

# Exported only by a ``python -m moonep_ops.build --diagnostics`` library (MOONEP_DIAGNOSTICS):
# planner stage stops and clock stamps for the probes in diagnostics/.
EP_DIAGNOSTICS: dict[str, tuple] = {
    "moonep_plan_debug_stop": (None, [c_int]),
    "moonep_plan_debug_pdl": (None, [c_int]),
    "moonep_plan_debug_stamps": (None, [c_void_p]),
    "moonep_plan_debug_warp_stamps": (None, [c_void_p]),
}


class NativeLibraryMissing(RuntimeError):
    """A CUDA-only code path needs a compiled library that is not loaded."""


def lib_dir() -> Path:
    return Path(settings.get("MOONEP_LIB_DIR") or Path(__file__).resolve().parent / "lib")


class _Lib:
    """One library: loaded on first use, every prototype declared, ABI version checked."""

    def __init__(self, file: str, version_fn: str, version: int, protos: dict, optional: dict,
                 versions: tuple = (), since: Optional[dict] = None):
        """``versions``: every ABI version accepted (default: ``version`` only); ``since``:
        {abi: prototypes} declared only when the library reports at least that ABI (a later
        ABI's additions; see ``feature``)."""
        self.file, self.version_fn, self.version = file, version_fn, version
        self.versions = tuple(versions) or (version,)
        self.protos, self.optional, self.since = protos, optional, dict(since or {})
        self._fns: Optional[SimpleNamespace] = None
        self.error: Optional[str] = None
        self.loaded_version: Optional[int] = None
        self.feature_errors: dict[int, str] = {}
        self._tried = False

    def load(self) -> Optional[SimpleNamespace]:
        if self._tried:
            return self._fns
        self._tried = True
        if settings.flag("MOONEP_DISABLE_NATIVE"):
            self.error = "disabled by MOONEP_DISABLE_NATIVE"
            return None
        path = lib_dir() / self.file
        if not path.exists():
            self.error = f"{path} not found (build it with `python -m moonep_ops.build`)"
            return None
        try:
            lib = ctypes.CDLL(str(path))
            fns = {}
            for name, (res, args) in self.protos.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = res, args
                fns[name] = fn
            for name, (res, args) in self.optional.items():
                if hasattr(lib, name):
                    fn = getattr(lib, name)
                    fn.restype, fn.argtypes = res, args
                    fns[name] = fn
            got = fns[self.version_fn]()
        except (OSError, AttributeError) as e:   # wrong arch, missing symbol, missing libcuda
            self.error = f"could not load {path}: {e}"
            return None
        if got not in self.versions:
            want = " or ".join(map(str, self.versions))
            self.error = f"{path} has ABI version {got}, this package expects {want}"
            return None
        self.loaded_version = got
        for abi, protos in sorted(self.since.items()):
            if got < abi:
                self.feature_errors[abi] = f"{path} has ABI version {got} (< {abi})"
                continue
            missing = [n for n in protos if not hasattr(lib, n)]
            if missing:       # a broken build of that ABI: keep the older exports usable
                self.feature_errors[abi] = (f"{path} reports ABI {got} but lacks "
                                            f"{', '.join(missing)}")
                continue
            for name, (res, args) in protos.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = res, args
                fns[name] = fn
        self._fns = SimpleNamespace(**{n.removeprefix("moonep_"): f for n, f in fns.items()})
        return self._fns

    def feature(self, abi: int) -> Optional[SimpleNamespace]:
        """The functions when the loaded library has ABI >= ``abi`` with all of that ABI's
        added exports (``since[abi]``) declared; else None (the reason: ``feature_errors``)."""
        fns = self.load()
        if fns is None or abi in self.feature_errors or self.loaded_version is None \
                or self.loaded_version < abi:
            return None
        return fns

    def unavailable(self, abi: int) -> Optional[str]:
        """Why :meth:`feature` returns None for ``abi`` (None if it does not)."""
        if self.feature(abi) is not None:
            return None
        return self.error or self.feature_errors.get(abi, "not loaded")

    def require(self, abi: int, what: str) -> SimpleNamespace:
        """:meth:`feature`, or NativeLibraryMissing naming ``what`` and why."""
        fns = self.feature(abi)
        if fns is None:
            raise NativeLibraryMissing(f"moonep {what}: not available: {self.unavailable(abi)}")
        return fns


_GEMM = _Lib("libmoonep_gemm.so", "moonep_gemm_abi_version", GEMM_ABI_VERSION, GEMM_PROTOTYPES, {},
             versions=GEMM_ABI_VERSIONS, since=GEMM_SINCE)
_EP = _Lib("libmoonep_ep.so", "moonep_ep_abi_version", EP_ABI_VERSION, EP_PROTOTYPES, EP_DIAGNOSTICS)


def gemm() -> Optional[SimpleNamespace]:
    """libmoonep_gemm.so's functions (names without the ``moonep_`` prefix), or None."""
    return _GEMM.load()


def gemm_fp8() -> Optional[SimpleNamespace]:
    """libmoonep_gemm.so's functions when it has the FP8 grouped GEMM (ABI >=
    GEMM_FP8_ABI_VERSION, both GEMM_FP8_PROTOTYPES exported), else None."""
    return _GEMM.feature(GEMM_FP8_ABI_VERSION)


def gemm_fp8_wgrad() -> Optional[SimpleNamespace]:
    """libmoonep_gemm.so's functions when it has the FP8 wgrad GEMM (ABI >=
    GEMM_FP8_WGRAD_ABI_VERSION, every GEMM_FP8_WGRAD_PROTOTYPES export), else None."""
    return _GEMM.feature(GEMM_FP8_WGRAD_ABI_VERSION)


def gemm_fp8_wgrad_unavailable() -> Optional[str]:
    """Why :func:`gemm_fp8_wgrad` returned None (None if it did not)."""
    return _GEMM.unavailable(GEMM_FP8_WGRAD_ABI_VERSION)


def require_gemm_fp8_wgrad() -> SimpleNamespace:
    return _GEMM.require(GEMM_FP8_WGRAD_ABI_VERSION, "FP8 wgrad grouped GEMM")


def gemm_keep_tail() -> bool:
    """Whether the loaded libmoonep_gemm.so takes MOONEP_GEMM_KEEP_TAIL (ABI >=
    GEMM_KEEP_TAIL_ABI_VERSION): the fwd / dgrad / FP8 GEMMs may then leave the rows past
    cu_seqlens[-1] unwritten."""
    return _GEMM.feature(GEMM_KEEP_TAIL_ABI_VERSION) is not None


def gemm_fp8_unavailable() -> Optional[str]:
    """Why :func:`gemm_fp8` returned None (None if it did not)."""
    return _GEMM.unavailable(GEMM_FP8_ABI_VERSION)


def require_gemm_fp8() -> SimpleNamespace:
    return _GEMM.require(GEMM_FP8_ABI_VERSION, "FP8 grouped GEMM")


def ep() -> Optional[SimpleNamespace]:
    """libmoonep_ep.so's functions (names without the ``moonep_`` prefix), or None."""
    return _EP.load()


def gemm_load_error() -> Optional[str]:
    """Why :func:`gemm` returned None (None if it loaded)."""
    gemm()
    return _GEMM.error


def ep_load_error() -> Optional[str]:
    ep()
    return _EP.error


def require_gemm() -> SimpleNamespace:
    lib = gemm()
    if lib is None:
        raise NativeLibraryMissing("moonep grouped GEMM: the CUTLASS library is not available: "
                                   f"{_GEMM.error}")
    return lib


def require_ep() -> SimpleNamespace:
    lib = ep()
    if lib is None:
        raise NativeLibraryMissing(f"moonep GPU data plane: libmoonep_ep.so is not available: "
                                   f"{_EP.error}")
    return lib


def require_diagnostics(name: str):
    """A diagnostics hook (EP_DIAGNOSTICS); only a ``--diagnostics`` build exports them."""
    fn = getattr(require_ep(), name.removeprefix("moonep_"), None)
    if fn is None:
        raise NativeLibraryMissing(f"{name} is only in a diagnostics build of libmoonep_ep.so "
                                   "(python -m moonep_ops.build --diagnostics; MOONEP_LIB_DIR)")
    return fn


def _message(raw) -> str:
    return raw.decode() if raw else ""


def ep_check(rc: int, what: str) -> None:
    """Raise a RuntimeError for a non-zero data-plane launcher return code."""
    if rc != 0:
        raise RuntimeError(f"{what} failed (CUDA error {rc}): {_message(require_ep().ep_last_error())}")


def gemm_check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: {_message(require_gemm().gemm_last_error())}")


# The int32 error word of the data plane (csrc/moonep_ep.h MOONEP_ERR_*): kernels OR these bits
# into it instead of raising; Buffer.check_errors() reads it.
ERR_BAD_IDS, ERR_HIST, ERR_PLAN, ERR_TIMEOUT = 1, 2, 4, 8
_ERR_TEXT = {ERR_BAD_IDS: "a rank passed expert ids outside [0, E)",
             ERR_HIST: "a rank's histogram does not sum to s*K, or s/total_num_tokens disagree",
             ERR_PLAN: "the plan overflowed (more than epn redundant slots or a row out of range)",
             ERR_TIMEOUT: "a cross-rank barrier timed out: a peer did not call the same op"}


def describe_errors(word: int) -> str:
    return "; ".join(text for bit, text in _ERR_TEXT.items() if word & bit) or "none"


# Codes the data plane passes to moonep_ep_barrier (recorded on a timeout: err[1]).
BARRIER_OPS = {1: "dispatch (histogram exchange)", 2: "dispatch (rows sent)",
               3: "dispatch (rows received)", 4: "combine (rows staged)",
               5: "combine (rows gathered)", 6: "prefetch_weight (slots free)",
               7: "prefetch_weight (slots filled)", 8: "reduce_grad (grads complete)",
               9: "reduce_grad (grads read)"}
BARRIER_CODE = {"hist": 1, "sent": 2, "received": 3, "staged": 4, "gathered": 5,
                "slots_free": 6, "slots_filled": 7, "grads_complete": 8, "grads_read": 9}


class DataPlaneError(RuntimeError):
    """A device kernel of the data plane set the error word (``Buffer.check_errors``)."""

    def __init__(self, message: str, word: int):
        super().__init__(message)
        self.word = word


class DataPlaneTimeout(DataPlaneError, TimeoutError):
    """A cross-rank barrier timed out: ``op`` (BARRIER_OPS) waited for ``missing_rank``."""

    def __init__(self, message: str, word: int, op: str, missing_rank: int):
        super().__init__(message, word)
        self.op, self.missing_rank = op, missing_rank
