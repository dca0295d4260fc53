"""The device planner's bindings: moonep_plan / moonep_plan_group of libmoonep_ep.so
(csrc/plan_kernels.cu), and the plan both data-plane backends make from the gathered rows.

Bit-exact with moonep::plan(hist[:, :E], topk, rank, R, S, tp, total, "moonep") -- or with
policy "cost" and its slack_ppm / replica_cost (R <= 64, E/R <= 256: cost_device_limit) -- for
every histogram that passes validation, with no host synchronisation and no allocation inside
the library, so it can be captured in a CUDA graph.  Its input hist_RX is [R, E+3] int32 on the
device; row r = [bincount of rank r's top-k ids (E), bad_ids_flag, s_r, total_num_tokens
(-1: uniform s)].  Validation runs on the device and ORs native.ERR_* bits into the int32
``err`` word instead of raising: a row not summing to s_r*K, s_r outside [1, S], an s / total
disagreement, a negative count (ERR_HIST); a set bad flag or an id outside [0, E) in topk
(ERR_BAD_IDS); hist[rank] not the histogram of topk (ERR_HIST); a slot outside the plan
(ERR_PLAN, impossible for a valid histogram).  The outputs stay in range whatever the input
(an invalid histogram plans as an empty one).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .. import native, runtime
from ..geometry import Geometry, check_cost_args
from ..runtime import current_raw_stream, on_device_of
from .checks import check_int_tensor
from .op import plan_op  # noqa: F401  (registers moonep::plan, plan_from_rows's fallback)

DEVICE_POLICIES = ("moonep", "cost")     # the policies the device planner (csrc/plan_*) implements

# Policy "cost" with a slack on the device: one warp per candidate keeps every per-rank value in
# two registers a lane (R <= 64), and each warp one row of B token counts in shared memory
# (csrc/plan_internal.cuh kCostMaxR, kCostMaxB).  Beyond them plan_on_device raises, and
# plan_from_rows plans with the torch reference (cost_device_limit says why).
COST_DEVICE_MAX_R = 64
COST_DEVICE_MAX_B = 256


def cost_device_limit(R: int, E: int, slack_ppm: int) -> Optional[str]:
    """None when the device planner can plan policy "cost" with this slack for R ranks and E
    experts, else why not (slack_ppm = 0 plans as MoonEP: always served)."""
    if slack_ppm == 0:
        return None
    if R > COST_DEVICE_MAX_R:
        return f"R={R} > {COST_DEVICE_MAX_R}"
    if E // R > COST_DEVICE_MAX_B:
        return f"E/R={E // R} > {COST_DEVICE_MAX_B}"
    return None


def device_planner_available() -> bool:
    """True when libmoonep_ep.so is loaded (it always exports the planner)."""
    return native.ep() is not None


@functools.lru_cache(maxsize=1024, typed=True)   # a function of the sizes: once per shape
def workspace_bytes(R: int, E: int, s: int, K: int) -> int:
    n = int(native.require_ep().plan_workspace_bytes(R, E, s, K))
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


def _check_device_args(hist_RX: Tensor, topk_sK: Tensor, rank, R, S, token_padding, NvS,
                       err: Tensor) -> tuple[int, int, int]:
    """Argument checks (no data reads).  Returns (E, s, K)."""
    for name, t in (("hist_RX", hist_RX), ("topk_sK", topk_sK), ("err", err)):
        check_int_tensor(name, t)
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


# Ints in, a frozen Geometry out (an error is raised again on every call: lru_cache keeps
# results only), so a dispatch validates its sizes once per shape, not on every call.
@functools.lru_cache(maxsize=1024, typed=True)
def _geometry(R, E, S, K, token_padding, NvS, rank, s, slack_ppm=0, replica_cost=0) -> Geometry:
    check_cost_args("cost", slack_ppm, replica_cost)
    # E % R, R*NvS, K <= 127; NvS with the slack's larger receive bound
    geo = Geometry(R=R, E=E, S=S, K=K, token_padding=token_padding, slack_ppm=slack_ppm)
    why = cost_device_limit(R, E, slack_ppm)
    if why is not None:
        raise ValueError(f"the device planner cannot plan policy 'cost' with a slack for {why} "
                         f"(limits R <= {COST_DEVICE_MAX_R}, E/R <= {COST_DEVICE_MAX_B}); plan "
                         f"with the torch reference planner.plan(..., policy='cost')")
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
              NvS: int, err: Tensor, bufs: DevicePlanBuffers, group_only: bool = False, *,
              slack_ppm: int = 0, replica_cost: int = 0) -> None:
    """Launch moonep_plan (or moonep_plan_group) into preallocated buffers on the current stream.
    ``slack_ppm`` > 0: policy "cost" with that slack and ``replica_cost`` (as ``plan``);
    0: policy "moonep" (and "cost" without slack, the same plan)."""
    E, s, K = _check_device_args(hist_RX, topk_sK, rank, R, S, token_padding, NvS, err)
    _geometry(R, E, S, K, token_padding, NvS, rank, s, slack_ppm, replica_cost)
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
    _plan_into(hist_RX, topk_sK, rank, R, E, S, s, K, token_padding, NvS, err, bufs,
               group_only, slack_ppm, replica_cost)


def _plan_into(hist_RX, topk_sK, rank, R, E, S, s, K, token_padding, NvS, err, bufs, group_only,
               slack_ppm, replica_cost) -> None:
    """plan_into's launch, its arguments checked (plan_into, or plan_on_device, which made the
    buffers)."""
    stream = current_raw_stream(hist_RX.device)
    ws = bufs.workspace
    nbytes = ws.numel() * ws.element_size()
    lib = native.require_ep()
    with on_device_of(hist_RX.device):          # the library launches on the current device
        if group_only:
            rc = lib.plan_group(hist_RX.data_ptr(), s, K, rank, R, E, S, token_padding, NvS,
                                slack_ppm, replica_cost, bufs.cu.data_ptr(), bufs.etc.data_ptr(),
                                bufs.zf.data_ptr(), bufs.stats.data_ptr(), ws.data_ptr(), nbytes,
                                err.data_ptr(), stream)
        else:
            rc = lib.plan(hist_RX.data_ptr(), topk_sK.data_ptr(), s, K, rank, R, E, S,
                          token_padding, NvS, slack_ppm, replica_cost, bufs.dst.data_ptr(),
                          bufs.cu.data_ptr(), bufs.etc.data_ptr(), bufs.zf.data_ptr(),
                          bufs.stats.data_ptr(), ws.data_ptr(), nbytes, err.data_ptr(), stream)
    if rc:
        native.ep_check(rc, "moonep_plan_group" if group_only else "moonep_plan")


def plan_on_device(hist_RX: Tensor, topk_sK: Tensor, rank: int, R: int, S: int,
                   token_padding: int, NvS: int, err: Tensor, *, slack_ppm: int = 0,
                   replica_cost: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Plan this rank's dispatch on the device: (dst [s*K], cu [2*epn], etc [R, epn],
    zf [2*epn, 2], stats [2]), all int32 on hist_RX's device, launched on the current stream.

    Same values as ``torch.ops.moonep.plan(hist_RX[:, :E], topk_sK, rank, R, S, token_padding,
    total, "moonep")`` with ``total = hist_RX[rank, E+2]``, when the histogram is valid;
    otherwise ``err`` gets MOONEP_ERR_* bits and the outputs are in range but meaningless.
    With ``slack_ppm`` > 0: the same as policy "cost" with that slack and ``replica_cost``
    (NvS must then be the slack's, ``Geometry(..., slack_ppm=slack_ppm).NvS``); a ValueError
    when the kernel cannot take R or E/R with a slack (``cost_device_limit``).
    """
    E, s, K = _check_device_args(hist_RX, topk_sK, rank, R, S, token_padding, NvS, err)
    _geometry(R, E, S, K, token_padding, NvS, rank, s, slack_ppm, replica_cost)
    bufs = allocate(hist_RX, s, K, R)          # the buffers plan_into would check, made here
    _plan_into(hist_RX, topk_sK, rank, R, E, S, s, K, token_padding, NvS, err, bufs, False,
               slack_ppm, replica_cost)
    return bufs.dst, bufs.cu, bufs.etc, bufs.zf, bufs.stats


def plan_from_rows(rows_RX: Tensor, topk_sK: Tensor, rank: int, spec, total: int,
                   err: Optional[Tensor], *, device: bool = True, clamp_ids: bool = False):
    """The plan from the gathered [R, E+3] rows, as both data-plane backends make it.

    The device planner when it can serve (``device``, CUDA rows, ``spec.policy`` in
    DEVICE_POLICIES, the library loaded, and for policy "cost" with a slack R <= 64 and
    E/R <= 256: ``cost_device_limit``; ``err`` gets its error bits, so it must be given for
    CUDA rows), else the torch planner on the rows' device (``total`` as moonep::plan takes it;
    ``clamp_ids``: ids that a histogram kernel flagged as bad are clamped so its indexing stays
    in bounds).  Same plan either way (tests).
    Returns (the five plan tensors, whether the device planner made them)."""
    slack_ppm = getattr(spec, "slack_ppm", 0) if spec.policy == "cost" else 0
    replica_cost = getattr(spec, "replica_cost", 0) if spec.policy == "cost" else 0
    if device and rows_RX.is_cuda and spec.policy in DEVICE_POLICIES and \
            cost_device_limit(spec.R, spec.E, slack_ppm) is None and device_planner_available():
        hist_RX = rows_RX.to(torch.int32).contiguous()
        return plan_on_device(hist_RX, topk_sK, rank, spec.R, spec.S, spec.token_padding,
                              spec.NvS, err, slack_ppm=slack_ppm,
                              replica_cost=replica_cost), True
    ids = topk_sK.clamp(0, spec.E - 1) if clamp_ids else topk_sK
    tpe_RE = rows_RX[:, :spec.E].to(torch.int32).contiguous()
    return torch.ops.moonep.plan(tpe_RE, ids, rank, spec.R, spec.S, spec.token_padding, total,
                                 spec.policy, getattr(spec, "slack_ppm", 0),
                                 getattr(spec, "replica_cost", 0)), False


def plan_from_host_rows(rows_RX: Tensor, topk_sK: Tensor, rank: int, spec, total: int):
    """The host backends' plan from host-validated gathered rows.  On CUDA (NCCL groups) the
    device planner serves (two launches, ~40 us at R = 8, E = 384, against ~12 ms for the torch
    planner's hundreds of small kernels); the rows were validated on the host, so its error
    word can only flag an internal error, read when validation is on (MOONEP_VALIDATE=1)."""
    err = torch.zeros(1, dtype=torch.int32, device=rows_RX.device) if rows_RX.is_cuda else None
    out, on_device = plan_from_rows(rows_RX, topk_sK, rank, spec, total, err)
    if on_device and runtime.should_validate(err) and int(err.item()) != 0:
        raise RuntimeError(f"moonep dispatch: the device planner flagged error bits "
                           f"{int(err.item()):#x} on host-validated input (a bug)")
    return out
