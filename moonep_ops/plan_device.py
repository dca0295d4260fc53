"""The planner as device kernels: ``moonep_plan`` of libmoonep_ep.so (csrc/plan_kernels.cu).

Bit-exact with ``torch.ops.moonep.plan(hist[:, :E], topk, rank, R, S, tp, total, "moonep")``
(moonep_ops/planner.py) for every histogram that passes validation, with no host
synchronisation and no allocation inside the library, so it can be captured in a CUDA graph.

Input histogram ``hist_RX`` is ``[R, E+3]`` int32 on the device; row r is
``[bincount of rank r's top-k ids (E), bad_ids_flag, s_r, total_num_tokens (-1: uniform s)]``.
Validation runs on the device and ORs ``MOONEP_ERR_*`` bits (csrc/moonep_ep.h) into the int32
``err`` word instead of raising: a row not summing to ``s_r*K``, ``s_r`` outside ``[1, S]``, an
``s`` / total disagreement, a negative count (``ERR_HIST``); a set bad flag or an id outside
``[0, E)`` in ``topk`` (``ERR_BAD_IDS``); ``hist[rank]`` not the histogram of ``topk``
(``ERR_HIST``); a slot outside the plan (``ERR_PLAN``, impossible for a valid histogram).  The
outputs stay in range whatever the input (an invalid histogram plans as an empty one).
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import _native
from .geometry import Geometry
from .symm_backend import ERR_BAD_IDS, ERR_HIST, ERR_PLAN  # noqa: F401  (re-exported)

_fns = None


def _lib():
    global _fns
    if _fns is None:
        c_int, p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        ws = _native.declare_ep("moonep_plan_workspace_bytes", c_size_t, [c_int] * 4)
        plan = _native.declare_ep("moonep_plan", c_int, [
            p, p,                                   # hist_RX, topk_sK
            c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int,  # s K rank R E S tp NvS
            p, p, p, p, p,                          # dst, cu, etc, zf, stats
            p, c_size_t, p, p])                     # workspace, bytes, err, stream
        group = _native.declare_ep("moonep_plan_group", c_int, [
            p,                                      # hist_RX
            c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int,  # s K rank R E S tp NvS
            p, p, p, p,                             # cu, etc, zf, stats
            p, c_size_t, p, p])                     # workspace, bytes, err, stream
        dbg = _native.declare_ep("moonep_plan_debug_stop", None, [c_int])
        pdl = _native.declare_ep("moonep_plan_debug_pdl", None, [c_int])
        stamps = _native.declare_ep("moonep_plan_debug_stamps", None, [p])
        _fns = (ws, plan, group, dbg, pdl, stamps)
    return _fns


def debug_stop(stop: int) -> None:
    """Benchmarks/tests only: csrc/plan_kernels.h moonep_plan_debug_stop (99 = normal)."""
    _lib()[3](stop)


def debug_pdl(on: bool) -> None:
    """Benchmarks only: launch the group kernel with (default) or without programmatic
    dependent launch (csrc/plan_kernels.cu grid_dep_wait)."""
    _lib()[4](1 if on else 0)


def debug_stamps(buf) -> None:
    """Benchmarks only: an int64 CUDA tensor of 8 that the group kernel fills with clock64 stage
    stamps (csrc/plan_kernels.h); None turns it off."""
    _lib()[5](None if buf is None else buf.data_ptr())


def debug_warp_stamps(buf) -> None:
    """Benchmarks only: an int64 CUDA tensor of 5 * 32 that the group kernel fills with every
    warp's clock64 at the end of each stage (csrc/plan_kernels.h; R <= 64 only, the larger
    kernels leave it untouched); None turns it off."""
    # declared on first use: the only symbol a benchmark needs that older libraries lack
    fn = _native.declare_ep("moonep_plan_debug_warp_stamps", None, [ctypes.c_void_p])
    fn(None if buf is None else buf.data_ptr())


def available() -> bool:
    """True when libmoonep_ep.so is loadable and exports the planner."""
    if _native.ep_lib() is None:
        return False
    try:
        _lib()
    except AttributeError:
        return False
    return True


def workspace_bytes(R: int, E: int, s: int, K: int) -> int:
    n = int(_lib()[0](R, E, s, K))
    if n == 0:
        raise ValueError(f"invalid planner sizes R={R}, E={E}, s={s}, K={K}")
    return n


class DevicePlanBuffers(NamedTuple):
    dst: Tensor          # [s*K]
    cu: Tensor           # [2*epn]
    etc: Tensor          # [R, epn]
    zf: Tensor           # [2*epn, 2]
    stats: Tensor        # [2]
    workspace: Tensor    # [workspace_bytes] uint8


def _check(hist_RX: Tensor, topk_sK: Tensor, rank, R, S, token_padding, NvS,
           err: Tensor) -> tuple[int, int, int]:
    """Argument checks (no data reads).  Returns (E, s, K)."""
    for name, t in (("hist_RX", hist_RX), ("topk_sK", topk_sK), ("err", err)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
        if t.device != hist_RX.device:
            raise ValueError(f"{name} is on {t.device} but hist_RX on {hist_RX.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    for name, v in (("rank", rank), ("R", R), ("S", S), ("token_padding", token_padding),
                    ("NvS", NvS)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if hist_RX.dim() != 2 or hist_RX.shape[0] != R or hist_RX.shape[1] < 4:
        raise ValueError(f"hist_RX must be [R={R}, E+3], got {tuple(hist_RX.shape)}")
    if topk_sK.dim() != 2 or topk_sK.shape[0] < 1 or topk_sK.shape[1] < 1:
        raise ValueError(f"topk_sK must be a non-empty [s, K], got {tuple(topk_sK.shape)}")
    if err.numel() < 1:
        raise ValueError("err must hold at least one int32")
    s, K = topk_sK.shape
    return hist_RX.shape[1] - 3, int(s), int(K)


def _geometry(R, E, S, K, token_padding, NvS, rank, s) -> Geometry:
    geo = Geometry(R=R, E=E, S=S, K=K, token_padding=token_padding)   # E % R, R*NvS, K <= 127
    if not 0 <= rank < R:
        raise ValueError(f"rank={rank} outside [0, R={R})")
    geo.check_s(s)
    if NvS < geo.NvS or R * NvS >= 2**31:
        raise ValueError(f"NvS={NvS} must be >= the geometry's NvS={geo.NvS} with R*NvS < 2^31")
    if R * S * K >= 2**31:
        raise ValueError(f"R*S*K = {R * S * K} does not fit in int32")
    return geo


def allocate(hist_RX: Tensor, s: int, K: int, R: int) -> DevicePlanBuffers:
    """Output and workspace tensors for one plan (torch.empty: no sync, capture-safe)."""
    E = hist_RX.shape[1] - 3
    B = E // R
    new = lambda *shape: torch.empty(shape, dtype=torch.int32, device=hist_RX.device)  # noqa: E731
    ws = torch.empty(workspace_bytes(R, E, s, K), dtype=torch.uint8, device=hist_RX.device)
    return DevicePlanBuffers(new(s * K), new(2 * B), new(R, B), new(2 * B, 2), new(2), ws)


def plan_into(hist_RX: Tensor, topk_sK: Tensor, rank: int, R: int, S: int, token_padding: int,
              NvS: int, err: Tensor, bufs: DevicePlanBuffers, group_only: bool = False) -> None:
    """Launch moonep_plan (or moonep_plan_group) into preallocated buffers on the current stream."""
    E, s, K = _check(hist_RX, topk_sK, rank, R, S, token_padding, NvS, err)
    _geometry(R, E, S, K, token_padding, NvS, rank, s)
    B = E // R
    want = {"dst": (s * K,), "cu": (2 * B,), "etc": (R, B), "zf": (2 * B, 2), "stats": (2,)}
    for name, shape in want.items():
        t = getattr(bufs, name)
        if t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous() \
                or t.device != hist_RX.device:
            raise ValueError(f"buffer {name} must be contiguous int32 {shape} on {hist_RX.device}")
    ws = bufs.workspace
    if ws.device != hist_RX.device or not ws.is_contiguous() or \
            ws.numel() * ws.element_size() < workspace_bytes(R, E, s, K):
        raise ValueError("workspace too small or not on the device")
    stream = torch.cuda.current_stream(hist_RX.device).cuda_stream
    nbytes = ws.numel() * ws.element_size()
    ws_fn, plan_fn, group_fn = _lib()[:3]
    with torch.cuda.device(hist_RX.device):     # the library launches on the current device
        _launch(plan_fn, group_fn, group_only, hist_RX, topk_sK, s, K, rank, R, E, S,
                token_padding, NvS, bufs, ws, nbytes, err, stream)


def _launch(plan_fn, group_fn, group_only, hist_RX, topk_sK, s, K, rank, R, E, S, token_padding,
            NvS, bufs, ws, nbytes, err, stream):
    if group_only:
        rc = group_fn(hist_RX.data_ptr(), s, K, rank, R, E, S, token_padding, NvS,
                      bufs.cu.data_ptr(), bufs.etc.data_ptr(), bufs.zf.data_ptr(),
                      bufs.stats.data_ptr(), ws.data_ptr(), nbytes, err.data_ptr(), stream)
        _native.ep_check(rc, "moonep_plan_group")
    else:
        rc = plan_fn(hist_RX.data_ptr(), topk_sK.data_ptr(), s, K, rank, R, E, S, token_padding,
                     NvS, bufs.dst.data_ptr(), bufs.cu.data_ptr(), bufs.etc.data_ptr(),
                     bufs.zf.data_ptr(), bufs.stats.data_ptr(), ws.data_ptr(), nbytes,
                     err.data_ptr(), stream)
        _native.ep_check(rc, "moonep_plan")


def plan_on_device(hist_RX: Tensor, topk_sK: Tensor, rank: int, R: int, S: int,
                   token_padding: int, NvS: int, err: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Plan this rank's dispatch on the device: (dst [s*K], cu [2*epn], etc [R, epn],
    zf [2*epn, 2], stats [2]), all int32 on hist_RX's device, launched on the current stream.

    Same values as ``torch.ops.moonep.plan(hist_RX[:, :E], topk_sK, rank, R, S, token_padding,
    total, "moonep")`` with ``total = hist_RX[rank, E+2]``, when the histogram is valid;
    otherwise ``err`` gets MOONEP_ERR_* bits and the outputs are in range but meaningless.
    """
    E, s, K = _check(hist_RX, topk_sK, rank, R, S, token_padding, NvS, err)
    _geometry(R, E, S, K, token_padding, NvS, rank, s)
    bufs = allocate(hist_RX, s, K, R)
    plan_into(hist_RX, topk_sK, rank, R, S, token_padding, NvS, err, bufs)
    return bufs.dst, bufs.cu, bufs.etc, bufs.zf, bufs.stats


def plan_from_rows(rows_RX: Tensor, topk_sK: Tensor, rank: int, buf, total: int,
                   err: Optional[Tensor], *, device: bool = True, clamp_ids: bool = False):
    """The plan from the gathered [R, E+3] rows, as both data-plane backends make it.

    The device planner when it can serve (``device``, CUDA rows, ``buf.policy == "moonep"``, the
    library loaded; ``err`` gets its error bits, so it must be given for CUDA rows), else the
    torch planner on the rows' device (``total`` as moonep::plan takes it; ``clamp_ids``: ids
    that a histogram kernel flagged as bad are clamped so its indexing stays in bounds).  Same
    plan either way (tests).
    Returns (the five plan tensors, whether the device planner made them)."""
    if device and rows_RX.is_cuda and buf.policy == "moonep" and available():
        hist_RX = rows_RX.to(torch.int32).contiguous()
        return plan_on_device(hist_RX, topk_sK, rank, buf.R, buf.S, buf.token_padding, buf.NvS,
                              err), True
    ids = topk_sK.clamp(0, buf.E - 1) if clamp_ids else topk_sK
    tpe_RE = rows_RX[:, :buf.E].to(torch.int32).contiguous()
    return torch.ops.moonep.plan(tpe_RE, ids, rank, buf.R, buf.S, buf.token_padding, total,
                                 buf.policy), False


def make_hist_rx(tpe_RE: Tensor, s_per_rank, total_num_tokens: Optional[int] = None,
                 bad_flags=None) -> Tensor:
    """Build the [R, E+3] histogram rows (helper for tests and benchmarks; on tpe's device)."""
    R = tpe_RE.shape[0]
    sizes = [s_per_rank] * R if isinstance(s_per_rank, int) else list(s_per_rank)
    tot = -1 if total_num_tokens is None else total_num_tokens
    bad = [0] * R if bad_flags is None else list(bad_flags)
    meta = torch.tensor([[bad[r], sizes[r], tot] for r in range(R)], dtype=torch.int32)
    return torch.cat([tpe_RE.to(torch.int32).cpu(), meta], dim=1).contiguous().to(tpe_RE.device)
