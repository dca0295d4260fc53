"""MoE grouped GEMM ops: forward, dgrad and wgrad over 2*epn groups of token rows.

Legend (shape suffixes):
  M   rows of the token buffer (received rows, padding included)   B = epn  experts per rank
  G   2*epn groups: 0..epn-1 use w_local_BOI[g], epn..2epn-1 use w_slot_BOI[g - epn]
  O   output features of the weight (nn.Linear "out")    I  input features (nn.Linear "in")

  cu_seqlens_G  int32 inclusive END offsets (torch._grouped_mm's ``offs``): group g owns rows
                [cu_seqlens_G[g-1], cu_seqlens_G[g]) (start 0 for g = 0).  Rows at or past
                cu_seqlens_G[-1] are padding: the outputs there are ZERO, or, with
                ``zero_tail=False``, left undefined as torch._grouped_mm leaves them (the
                zeroing runs before the GEMM: +12.5 us median on the H200 for tails of
                60-176 MB, ~0 below 20 MB, whose stores stay in L2; the MoE layer's
                intermediates, which nothing reads past the last group, skip it).
                Autograd's dx always has a zero tail (its true gradient).

  forward  y_MO[rows g]  = x_MI[rows g] @ W_g^T        bf16 in, fp32 accumulate, bf16 out
  dgrad    dx_MI[rows g] = dy_MO[rows g] @ W_g
  wgrad    dW_g (fp32 [O, I]) = dy_MO[rows g]^T @ x_MI[rows g]

Ops (namespace ``moonep``; schemas, fakes and autograd are pure Python, so they exist without the
compiled library):
  grouped_mm(x, w_local, w_slot, cu_seqlens, config=-1, zero_tail=True) -> y  (differentiable)
  grouped_mm_dgrad(dy, w_local, w_slot, cu_seqlens, config=-1, zero_tail=True) -> dx
  grouped_mm_wgrad(dy, x, cu_seqlens, epn, config=-1, out_dtype=None) -> (dW_local, dW_slot)
      fp32 by default; out_dtype=bf16 writes bf16 directly (4x fewer output bytes than fp32
      read-modify-write; what autograd uses for bf16 weights, like torch._grouped_mm does);
  grouped_mm_wgrad_accumulate(dy, x, cu_seqlens, grad_local!, grad_slot!, config=-1) -> ()
      adds dW into given fp32 [epn, O, I] tensors (e.g. main grads), the kernel's epilogue does
      the += (beta = 1), so no temporary of the weights' size is made.
  grouped_mm_wgrad_into(dy, x, cu_seqlens, grad_local!, grad_slot!, config=-1) -> ()
      writes dW once in the input dtype into given [epn, O, I] tensors (the MoE backward's
      path): empty local groups are zeroed, empty slot groups are left untouched.

Backends, picked per call from the device and dtype (never from data, so no host sync):
  CUDA, bf16, libmoonep_gemm.so loaded  -> CUTLASS sm90 grouped kernels (cutlass_kernels/): the
      never-lose rule picks the family from the static shape (cost_model.family_for, cached per
      shape: torch._grouped_mm's own kernels where the model does not predict ours clearly
      faster, else ours), then the configuration is chosen on the device from cu_seqlens by the
      cost model (moonep_ops.gemm.cost_model), unless ``config`` forces one;
  CUDA, bf16, no library                -> torch._grouped_mm (the weights are concatenated first,
      and wgrad comes back in bf16 before it is added to the fp32 grads);
  CPU, or another dtype                 -> reference loop over groups (reads cu_seqlens on the
      host; on CUDA that is a sync, so it is only the path for non-bf16 dtypes).
``config``: -1 = automatic, otherwise an index into gemm_cost_model.CONFIGS[kind] (CUTLASS only).
Env MOONEP_GEMM_BACKEND = auto (default) | torch | reference forces a backend (tests, bisecting).
Env MOONEP_GEMM_FAMILY = auto (default) | moonep | torch forces the config family of automatic
calls; MOONEP_GEMM_CANDIDATES = name,name (one family) narrows the device's candidates;
MOONEP_GEMM_PDL = 1 (default) | 0: the GEMM kernel launched as a programmatic dependent of the
prep kernel, or after it (docs/grouped_gemm.md, "PDL").
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from .. import native
from ..gemm import cost_model as gemm_cost_model
from ..runtime import current_raw_stream, env, on_device_of, should_validate, sm_count
from . import fastpath
from .checks import check_no_overlap

__all__ = [
    "grouped_mm", "grouped_mm_dgrad", "grouped_mm_wgrad", "grouped_mm_wgrad_accumulate",
    "grouped_mm_wgrad_into",
    "reference_grouped_mm", "backend_for",
]

_KIND_ID = {"fwd": 0, "dgrad": 1, "wgrad": 2, "wgrad_lp": 3}


# --------------------------------------------------------------------------------------------
# Input checks: shape / dtype / device only (they read no data, so they never sync).
# --------------------------------------------------------------------------------------------

def _check_weights(w_local: torch.Tensor, w_slot: torch.Tensor) -> tuple[int, int, int]:
    for name, w in (("w_local_BOI", w_local), ("w_slot_BOI", w_slot)):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(w).__name__}")
        if w.dim() != 3:
            raise ValueError(f"{name} must be 3-D [epn, O, I], got shape {tuple(w.shape)}")
        if not w.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {w.dtype}")
    if w_local.shape != w_slot.shape:
        raise ValueError(f"w_local_BOI {tuple(w_local.shape)} and w_slot_BOI "
                         f"{tuple(w_slot.shape)} must have the same shape [epn, O, I]")
    if w_local.dtype != w_slot.dtype:
        raise TypeError(f"w_local_BOI ({w_local.dtype}) and w_slot_BOI ({w_slot.dtype}) differ")
    if w_local.device != w_slot.device:
        raise ValueError("w_local_BOI and w_slot_BOI are on different devices")
    epn, O, I = w_local.shape
    if epn < 1:
        raise ValueError("epn (w_local_BOI.shape[0]) must be >= 1")
    return epn, O, I


def _check_rows(name: str, t: torch.Tensor, cols: int, cols_name: str, like: torch.Tensor):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.shape[1] != cols:
        raise ValueError(f"{name} has {t.shape[1]} columns, expected {cols_name}={cols}")
    if t.dtype != like.dtype:
        raise TypeError(f"{name} dtype {t.dtype} differs from the weights' {like.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device}, the weights on {like.device}")


def _check_cu(cu: torch.Tensor, G: int, M: int, device: torch.device, values: bool) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"cu_seqlens_G must be a Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"cu_seqlens_G must be int32 (like torch._grouped_mm's offs), got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] != G:
        raise ValueError(f"cu_seqlens_G must be 1-D of length G = 2*epn = {G}, "
                         f"got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"cu_seqlens_G is on {cu.device}, the data on {device}")
    # Value checks read the data: real kernels only (never in fakes), CPU by default.
    if values and should_validate(cu) and G > 0:
        c = cu.tolist()
        if c[0] < 0 or any(b < a for a, b in zip(c, c[1:])) or c[-1] > M:
            raise ValueError(f"cu_seqlens_G must be non-decreasing inclusive end offsets in "
                             f"[0, M={M}], got {c}")


def _check_config(config: int, kind: str) -> None:
    n = len(gemm_cost_model.CONFIGS[kind])
    if isinstance(config, torch.SymInt):
        return
    if not isinstance(config, int) or isinstance(config, bool):
        raise TypeError(f"config must be an int, got {type(config).__name__}")
    if not -1 <= config < n:
        raise ValueError(f"config must be -1 (automatic) or in [0, {n}) for {kind}, got {config}")


def _check_fwd(x, w_local, w_slot, cu, config, values=True):
    epn, O, I = _check_weights(w_local, w_slot)
    _check_rows("x_MI", x, I, "I", w_local)
    _check_cu(cu, 2 * epn, x.shape[0], x.device, values)
    _check_config(config, "fwd")
    return epn, O, I


def _check_dgrad(dy, w_local, w_slot, cu, config, values=True):
    epn, O, I = _check_weights(w_local, w_slot)
    _check_rows("dy_MO", dy, O, "O", w_local)
    _check_cu(cu, 2 * epn, dy.shape[0], dy.device, values)
    _check_config(config, "dgrad")
    return epn, O, I


def _check_wgrad(dy, x, cu, epn, config, values=True, kind="wgrad"):
    # (a SymInt under dynamic-shape tracing: its value is checked by the real kernel's call)
    if not isinstance(epn, torch.SymInt) and (
            not isinstance(epn, int) or isinstance(epn, bool) or epn < 1):
        raise ValueError(f"epn must be an int >= 1, got {epn!r}")
    for name, t in (("dy_MO", dy), ("x_MI", x)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating, got {t.dtype}")
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"dy_MO has {dy.shape[0]} rows, x_MI {x.shape[0]}")
    if dy.dtype != x.dtype:
        raise TypeError(f"dy_MO ({dy.dtype}) and x_MI ({x.dtype}) dtypes differ")
    if dy.device != x.device:
        raise ValueError("dy_MO and x_MI are on different devices")
    if not isinstance(epn, torch.SymInt):
        _check_cu(cu, 2 * epn, x.shape[0], x.device, values)
    _check_config(config, kind)        # wgrad (fp32 +=) or wgrad_lp (written in dy's dtype)
    return dy.shape[1], x.shape[1]


def _check_grads(grad_local, grad_slot, epn, O, I, device, dtype=torch.float32,
                 what="float32 (the accumulation dtype)"):
    for name, g in (("grad_local", grad_local), ("grad_slot", grad_slot)):
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(g).__name__}")
        if tuple(g.shape) != (epn, O, I):
            raise ValueError(f"{name} must have shape {(epn, O, I)}, got {tuple(g.shape)}")
        if g.dtype != dtype:
            raise TypeError(f"{name} must be {what}, got {g.dtype}")
        if g.device != device:
            raise ValueError(f"{name} is on {g.device}, the data on {device}")
        if not g.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


# --------------------------------------------------------------------------------------------
# Backend choice (from device and dtype only)
# --------------------------------------------------------------------------------------------

def _aligned(*dims: int) -> bool:
    # 16-byte rows for TMA / torch._grouped_mm: bf16 dims must be multiples of 8.
    return all(d % 8 == 0 and d > 0 for d in dims)


def backend_for(t: torch.Tensor, *dims: int) -> str:
    """'cutlass', 'torch' or 'reference' for data like ``t`` with these feature dims."""
    if t.device.type != "cuda" or t.dtype != torch.bfloat16 or not _aligned(*dims):
        return "reference"
    forced = env("MOONEP_GEMM_BACKEND", "auto").lower()
    if forced in ("torch", "reference"):
        return forced
    if forced == "cutlass" or native.gemm() is not None:
        return "cutlass"
    return "torch"


# --------------------------------------------------------------------------------------------
# Reference (any device, any float dtype; reads cu_seqlens on the host)
# --------------------------------------------------------------------------------------------

def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _bounds(cu: torch.Tensor):
    start = 0
    for g, end in enumerate(cu.tolist()):
        yield g, start, end
        start = max(start, end)


def _weight(w_local, w_slot, g):
    epn = w_local.shape[0]
    return w_local[g] if g < epn else w_slot[g - epn]


def _ref_fwd(x, w_local, w_slot, cu):
    acc = _acc_dtype(x.dtype)
    y = x.new_zeros(x.shape[0], w_local.shape[1])
    for g, s, e in _bounds(cu):
        if e > s:
            y[s:e] = (x[s:e].to(acc) @ _weight(w_local, w_slot, g).to(acc).t()).to(y.dtype)
    return y


def _ref_dgrad(dy, w_local, w_slot, cu):
    acc = _acc_dtype(dy.dtype)
    dx = dy.new_zeros(dy.shape[0], w_local.shape[2])
    for g, s, e in _bounds(cu):
        if e > s:
            dx[s:e] = (dy[s:e].to(acc) @ _weight(w_local, w_slot, g).to(acc)).to(dx.dtype)
    return dx


def _ref_group_dw(dy, x, cu):
    """(g, dW_g) for every non-empty group, dW_g in the accumulation dtype."""
    acc = _acc_dtype(dy.dtype)
    for g, s, e in _bounds(cu):
        if e > s:
            yield g, dy[s:e].to(acc).t() @ x[s:e].to(acc)


def _ref_wgrad_acc(dy, x, cu, grad_local, grad_slot):
    epn = grad_local.shape[0]
    for g, dw in _ref_group_dw(dy, x, cu):
        tgt = grad_local[g] if g < epn else grad_slot[g - epn]
        tgt += dw.to(tgt.dtype)


def reference_grouped_mm(x_MI, w_local_BOI, w_slot_BOI, cu_seqlens_G):
    """Plain per-group loop (fp32 accumulation, fp64 for fp64 inputs); the tests' oracle."""
    _check_fwd(x_MI, w_local_BOI, w_slot_BOI, cu_seqlens_G, -1)
    return _ref_fwd(x_MI, w_local_BOI, w_slot_BOI, cu_seqlens_G)


# --------------------------------------------------------------------------------------------
# torch._grouped_mm fallback (CUDA bf16 without the library); sync-free
# --------------------------------------------------------------------------------------------

def _zero_tail_rows(out: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm leaves rows past offs[-1] undefined; our contract says zero.
    rows = torch.arange(out.shape[0], device=out.device, dtype=torch.int32)
    return out.masked_fill_((rows >= cu[-1])[:, None], 0)


def _torch_fwd(x, w_local, w_slot, cu, zero_tail=True):
    w = torch.cat([w_local, w_slot])                       # [G, O, I]
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=cu)
    return _zero_tail_rows(y, cu) if zero_tail else y


def _torch_dgrad(dy, w_local, w_slot, cu, zero_tail=True):
    w = torch.cat([w_local, w_slot])
    dx = torch._grouped_mm(dy, w, offs=cu)
    return _zero_tail_rows(dx, cu) if zero_tail else dx


def _ref_wgrad_into(dy, x, cu, grad_local, grad_slot):
    epn = grad_local.shape[0]
    grad_local.zero_()                       # empty local groups read 0; empty slots untouched
    for g, dw in _ref_group_dw(dy, x, cu):
        (grad_local[g] if g < epn else grad_slot[g - epn]).copy_(dw)


def _nonempty_G11(cu: torch.Tensor) -> torch.Tensor:
    """[G, 1, 1] bool: group g has rows (sync-free, for masking [G, O, I] outputs)."""
    return (cu.diff(prepend=cu.new_zeros(1)) > 0)[:, None, None]


def _torch_wgrad_acc(dy, x, cu, grad_local, grad_slot):
    # dy^T as a column-major view: the layout for which empty groups are allowed.
    dw = torch._grouped_mm(dy.t(), x, offs=cu)              # [G, O, I] bf16
    epn = grad_local.shape[0]
    grad_local += dw[:epn]
    grad_slot += dw[epn:]


# --------------------------------------------------------------------------------------------
# CUTLASS (libmoonep_gemm.so)
# --------------------------------------------------------------------------------------------

_tables: dict[tuple[str, float], ctypes.Array] = {}


@functools.lru_cache(maxsize=None)
def _workspace_bytes(kind_id: int, G: int, sm_count: int) -> int:
    # Depends on (kind, G, SM count) only; the C side derives it from every config's CUTLASS
    # arguments, so it is asked once per shape, not on every call.
    return native.require_gemm().gemm_workspace_bytes(kind_id, G, sm_count)


def _tuning_table(kind: str, tie_tol: float):
    # Built once per process and tie window from gemm_tuning (the file the calibration rewrites).
    key = (kind, tie_tol)
    if key not in _tables:
        vals = gemm_cost_model.tuning_table(kind, tie_tol)
        _tables[key] = (ctypes.c_float * len(vals))(*vals)
    return _tables[key]


@functools.lru_cache(maxsize=8192)
def _plan(kind: str, rows: int, groups: int, O: int | None, I: int | None, sm: int | None,
          family: str, names: str) -> int:
    cfgs = gemm_cost_model.CONFIGS[kind]
    if names:
        wanted = {n.strip() for n in names.split(",") if n.strip()}
        fams = {c.family for c in cfgs if c.name in wanted}
        if len(fams) > 1:
            raise ValueError(f"MOONEP_GEMM_CANDIDATES={names!r} names configs of both families "
                             f"({sorted(fams)}); one call runs one family's fused kernel")
    elif O is None or I is None:
        wanted = set(gemm_cost_model.candidates(kind, rows, groups))
    else:
        fam = None if family == "auto" else family
        if fam == "torch" and gemm_cost_model.torch_config(kind, rows, groups, O, I) is None:
            fam = "moonep"                                 # wgrad (fp32 +=): no torch family
        wanted = set(gemm_cost_model.call_candidates(kind, rows, groups, O, I, sm_count=sm,
                                                     family=fam)[1])
    mask = sum(1 << i for i, c in enumerate(cfgs) if c.name in wanted)
    return mask or sum(1 << i for i, c in enumerate(cfgs) if c.family == "moonep")


def candidate_mask(kind: str, rows: int, groups: int, O: int | None = None,
                   I: int | None = None, sm_count: int | None = None) -> int:
    """Configs the device selector chooses among (bit i = CONFIGS[kind][i]) for a call whose
    buffer holds ``rows`` rows in ``groups`` groups, of weights [O, I].

    With O and I: the never-lose rule's family (gemm_cost_model.call_candidates, on shapes only;
    cached per shape): torch._grouped_mm's config for the torch family (one config: the prep
    kernel skips the model), else the "moonep" candidates of the shape.  Without them: the
    "moonep" candidates.  The configs of a family are branches of one fused kernel, launched
    once; a candidate costs only its evaluation in the prep kernel (0.2-0.7 µs).  Env
    MOONEP_GEMM_FAMILY = moonep | torch forces the family, MOONEP_GEMM_CANDIDATES
    (comma-separated names, one family) the set."""
    family = env("MOONEP_GEMM_FAMILY", "auto").strip().lower() or "auto"
    if family not in ("auto",) + gemm_cost_model.FAMILIES:
        raise ValueError(f"MOONEP_GEMM_FAMILY must be auto, moonep or torch, got {family!r}")
    return _plan(kind, int(rows), int(groups), None if O is None else int(O),
                 None if I is None else int(I), sm_count, family,
                 env("MOONEP_GEMM_CANDIDATES", ""))


def clear_plan_cache() -> None:
    """Forget the per-shape plans and tuning tables (after changing gemm.tuning's constants in
    place)."""
    _plan.cache_clear()
    _tables.clear()
    _CALLS.clear()


# Per call shape, what _launch passes besides the pointers: (kind id, tuning table, candidate
# mask, workspace bytes).  Keyed by the shape, the SM count and the two environment switches
# the mask reads, so a changed switch is a new key; read on every call, built once.
_CALLS: dict[tuple, tuple] = {}
_CALLS_MAX = 4096


def _call_constants(kind: str, M: int, G: int, O: int, I: int, sm: int) -> tuple:
    key = (kind, M, G, O, I, sm, env("MOONEP_GEMM_FAMILY", "auto"),
           env("MOONEP_GEMM_CANDIDATES", ""))
    c = _CALLS.get(key)
    if c is None:
        kid = _KIND_ID[kind]
        c = (kid, _tuning_table(kind, gemm_cost_model.tie_tolerance(kind, M, G)),
             candidate_mask(kind, M, G, O, I, sm), _workspace_bytes(kid, G, sm))
        if len(_CALLS) >= _CALLS_MAX:
            _CALLS.clear()
        _CALLS[key] = c
    return c


_KEEP_EMPTY_SLOTS = 1      # moonep_gemm.h MOONEP_GEMM_KEEP_EMPTY_SLOTS
_PDL = 2                   # moonep_gemm.h MOONEP_GEMM_PDL
_KEEP_TAIL = 4             # moonep_gemm.h MOONEP_GEMM_KEEP_TAIL (library ABI >= 11)


def tail_flags(zero_tail: bool) -> int:
    """MOONEP_GEMM_KEEP_TAIL when the caller leaves the rows past cu_seqlens[-1] undefined and
    the library takes the flag (an older library zeroes them: also within the contract)."""
    return 0 if zero_tail or not native.gemm_keep_tail() else _KEEP_TAIL


def _pdl_flag() -> int:
    # on by default: 1.0-1.5 % gm over the zoo, far fewer calls below 0.98x torch (benchmarks.md)
    return _PDL if env("MOONEP_GEMM_PDL", "1") not in ("", "0") else 0


def _launch(kind: str, config: int, a, b, b_slot, d, d_slot, cu, epn, M, O, I,
            raster: int = 0, workspace: Optional[torch.Tensor] = None,
            flags: int = 0) -> torch.Tensor:
    """Run one CUTLASS grouped GEMM on the current stream; returns the workspace it used.
    Host work per call: one dict look-up for the shape's constants (_call_constants), the
    workspace (a fresh allocation: a call in flight or captured in a CUDA graph keeps its
    own), the raw stream, and the C call."""
    lib = native.require_gemm()
    dev = a.device
    G = 2 * epn
    sm = sm_count(dev)
    kid, table, mask, nbytes = _call_constants(kind, M, G, O, I, sm)
    if workspace is None or workspace.numel() < nbytes:
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    with on_device_of(dev):
        rc = lib.grouped_gemm(
            kid, config, raster,
            a.data_ptr(), b.data_ptr(), 0 if b_slot is None else b_slot.data_ptr(),
            d.data_ptr(), 0 if d_slot is None else d_slot.data_ptr(),
            cu.data_ptr(), G, epn, M, O, I, table, mask, flags | _pdl_flag(),
            workspace.data_ptr(), nbytes, sm, current_raw_stream(dev))
    if rc:
        native.gemm_check(rc, f"moonep grouped GEMM ({kind})")
    return workspace


def _cutlass_fwd(x, w_local, w_slot, cu, config, zero_tail=True):
    M, I = x.shape
    epn, O, _ = w_local.shape
    y = torch.empty(M, O, dtype=x.dtype, device=x.device)
    if M:
        _launch("fwd", config, x.contiguous(), w_local.contiguous(), w_slot.contiguous(),
                y, None, cu.contiguous(), epn, M, O, I, flags=tail_flags(zero_tail))
    return y


def _cutlass_dgrad(dy, w_local, w_slot, cu, config, zero_tail=True):
    M, O = dy.shape
    epn, _, I = w_local.shape
    dx = torch.empty(M, I, dtype=dy.dtype, device=dy.device)
    if M:
        _launch("dgrad", config, dy.contiguous(), w_local.contiguous(), w_slot.contiguous(),
                dx, None, cu.contiguous(), epn, M, O, I, flags=tail_flags(zero_tail))
    return dx


def _cutlass_wgrad_acc(dy, x, cu, grad_local, grad_slot, config):
    M, O = dy.shape
    I = x.shape[1]
    epn = grad_local.shape[0]
    if M:
        _launch("wgrad", config, dy.contiguous(), x.contiguous(), None, grad_local, grad_slot,
                cu.contiguous(), epn, M, O, I)


def _cutlass_wgrad_into(dy, x, cu, grad_local, grad_slot, config):
    M, O = dy.shape
    I = x.shape[1]
    if M == 0:
        grad_local.zero_()             # every group is empty; slots stay untouched
        return
    _launch("wgrad_lp", config, dy.contiguous(), x.contiguous(), None, grad_local, grad_slot,
            cu.contiguous(), grad_local.shape[0], M, O, I, flags=_KEEP_EMPTY_SLOTS)


def _cutlass_wgrad_lp(dy, x, cu, epn, config):
    M, O = dy.shape
    I = x.shape[1]
    if M == 0:
        z = torch.zeros(epn, O, I, dtype=dy.dtype, device=dy.device)
        return z, torch.zeros_like(z)
    gl = torch.empty(epn, O, I, dtype=dy.dtype, device=dy.device)
    gs = torch.empty_like(gl)
    _launch("wgrad_lp", config, dy.contiguous(), x.contiguous(), None, gl, gs, cu.contiguous(),
            epn, M, O, I)
    return gl, gs


# --------------------------------------------------------------------------------------------
# The ops' bodies after their checks: the custom ops below call them, and so does
# moonep::moe_experts, itself one custom op that checks every argument once (the nested
# dispatcher calls and repeated checks cost ~20-30 us each on the host).
# --------------------------------------------------------------------------------------------

def run_fwd(x, w_local, w_slot, cu, config: int = -1, zero_tail: bool = True):
    """moonep::grouped_mm without its checks (the caller made them)."""
    O, I = w_local.shape[1], w_local.shape[2]
    backend = backend_for(x, O, I)
    if backend == "cutlass":
        return _cutlass_fwd(x, w_local, w_slot, cu, config, zero_tail)
    if backend == "torch":
        return _torch_fwd(x, w_local, w_slot, cu, zero_tail)
    return _ref_fwd(x, w_local, w_slot, cu)


def run_dgrad(dy, w_local, w_slot, cu, config: int = -1, zero_tail: bool = True):
    """moonep::grouped_mm_dgrad without its checks (the caller made them)."""
    O, I = w_local.shape[1], w_local.shape[2]
    backend = backend_for(dy, O, I)
    if backend == "cutlass":
        return _cutlass_dgrad(dy, w_local, w_slot, cu, config, zero_tail)
    if backend == "torch":
        return _torch_dgrad(dy, w_local, w_slot, cu, zero_tail)
    return _ref_dgrad(dy, w_local, w_slot, cu)


def run_wgrad_into(dy, x, cu, grad_local, grad_slot, config: int = -1) -> None:
    """moonep::grouped_mm_wgrad_into without its checks (the caller made them, memory overlap
    of the written grads with the inputs included)."""
    backend = backend_for(dy, dy.shape[1], x.shape[1])
    if backend == "cutlass":
        _cutlass_wgrad_into(dy, x, cu, grad_local, grad_slot, config)
    elif backend == "torch":
        epn = grad_local.shape[0]
        dw = torch._grouped_mm(dy.t(), x, offs=cu)                       # [G, O, I]
        full = _nonempty_G11(cu)
        grad_local.copy_(dw[:epn].masked_fill_(~full[:epn], 0))
        grad_slot.copy_(torch.where(full[epn:], dw[epn:], grad_slot))
    else:
        _ref_wgrad_into(dy, x, cu, grad_local, grad_slot)


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------

def grouped_mm_body(x: torch.Tensor, w_local: torch.Tensor, w_slot: torch.Tensor,
                    cu_seqlens: torch.Tensor, config: int = -1,
                    zero_tail: bool = True) -> torch.Tensor:
    """moonep::grouped_mm's kernel: its checks, then run_fwd."""
    _check_fwd(x, w_local, w_slot, cu_seqlens, config)
    return run_fwd(x, w_local, w_slot, cu_seqlens, config, zero_tail)


# Explicit schemas: `int` (not the inferred SymInt) so epn and config are static in traces.
_grouped_mm_op = torch.library.custom_op(
    "moonep::grouped_mm", grouped_mm_body, mutates_args=(),
    schema="(Tensor x, Tensor w_local, Tensor w_slot, Tensor cu_seqlens, int config=-1, "
           "bool zero_tail=True) -> Tensor")


@_grouped_mm_op.register_fake
def _(x, w_local, w_slot, cu_seqlens, config=-1, zero_tail=True):
    _, O, _ = _check_fwd(x, w_local, w_slot, cu_seqlens, config, values=False)
    return x.new_empty(x.shape[0], O)


def grouped_mm_dgrad_body(dy: torch.Tensor, w_local: torch.Tensor, w_slot: torch.Tensor,
                          cu_seqlens: torch.Tensor, config: int = -1,
                          zero_tail: bool = True) -> torch.Tensor:
    """moonep::grouped_mm_dgrad's kernel: its checks, then run_dgrad."""
    _check_dgrad(dy, w_local, w_slot, cu_seqlens, config)
    return run_dgrad(dy, w_local, w_slot, cu_seqlens, config, zero_tail)


_grouped_mm_dgrad_op = torch.library.custom_op(
    "moonep::grouped_mm_dgrad", grouped_mm_dgrad_body, mutates_args=(),
    schema="(Tensor dy, Tensor w_local, Tensor w_slot, Tensor cu_seqlens, int config=-1, "
           "bool zero_tail=True) -> Tensor")


@_grouped_mm_dgrad_op.register_fake
def _(dy, w_local, w_slot, cu_seqlens, config=-1, zero_tail=True):
    _, _, I = _check_dgrad(dy, w_local, w_slot, cu_seqlens, config, values=False)
    return dy.new_empty(dy.shape[0], I)


def _check_wgrad_grads(dy, x, cu, grad_local, grad_slot, config, values=True,
                       input_dtype=False):
    """Checks of the in-place wgrad ops (op and fake): the grads are fp32 (accumulate) or in
    dy's dtype (into, ``input_dtype=True``).  Returns (O, I).  The real kernels also check
    that the grads share no memory with each other or with the inputs (``_check_wgrad_alias``)."""
    for name, g in (("grad_local", grad_local), ("grad_slot", grad_slot)):
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(g).__name__}")
        if g.dim() != 3:
            raise ValueError(f"{name} must be 3-D [epn, O, I], got shape {tuple(g.shape)}")
    O, I = _check_wgrad(dy, x, cu, grad_local.shape[0], config, values,
                        "wgrad_lp" if input_dtype else "wgrad")
    dt = (dy.dtype, f"{dy.dtype} (the input dtype)") if input_dtype else ()
    _check_grads(grad_local, grad_slot, grad_local.shape[0], O, I, x.device, *dt)
    return O, I


def _check_wgrad_alias(op, dy, x, cu, grad_local, grad_slot):
    """Real kernels only (fake tensors have no storage): the grads are written, the rest read."""
    check_no_overlap(op, [("grad_local", grad_local), ("grad_slot", grad_slot)],
                     [("dy", dy), ("x", x), ("cu_seqlens", cu)])


def _wgrad_acc_impl(dy, x, cu, grad_local, grad_slot, config):
    O, I = dy.shape[1], x.shape[1]
    backend = backend_for(dy, O, I)
    if backend == "cutlass":
        _cutlass_wgrad_acc(dy, x, cu, grad_local, grad_slot, config)
    elif backend == "torch":
        _torch_wgrad_acc(dy, x, cu, grad_local, grad_slot)
    else:
        _ref_wgrad_acc(dy, x, cu, grad_local, grad_slot)


@torch.library.custom_op(
    "moonep::grouped_mm_wgrad_accumulate", mutates_args=("grad_local", "grad_slot"),
    schema="(Tensor dy, Tensor x, Tensor cu_seqlens, Tensor(a!) grad_local, "
           "Tensor(b!) grad_slot, int config=-1) -> ()")
def _grouped_mm_wgrad_acc_op(dy: torch.Tensor, x: torch.Tensor, cu_seqlens: torch.Tensor,
                             grad_local: torch.Tensor, grad_slot: torch.Tensor,
                             config: int = -1) -> None:
    _check_wgrad_grads(dy, x, cu_seqlens, grad_local, grad_slot, config)
    _check_wgrad_alias("grouped_mm_wgrad_accumulate", dy, x, cu_seqlens, grad_local, grad_slot)
    _wgrad_acc_impl(dy, x, cu_seqlens, grad_local, grad_slot, config)


@_grouped_mm_wgrad_acc_op.register_fake
def _(dy, x, cu_seqlens, grad_local, grad_slot, config=-1):
    _check_wgrad_grads(dy, x, cu_seqlens, grad_local, grad_slot, config, values=False)


def grouped_mm_wgrad_into_body(dy: torch.Tensor, x: torch.Tensor, cu_seqlens: torch.Tensor,
                               grad_local: torch.Tensor, grad_slot: torch.Tensor,
                               config: int = -1) -> None:
    """moonep::grouped_mm_wgrad_into's kernel: its checks, then run_wgrad_into."""
    _check_wgrad_grads(dy, x, cu_seqlens, grad_local, grad_slot, config, input_dtype=True)
    _check_wgrad_alias("grouped_mm_wgrad_into", dy, x, cu_seqlens, grad_local, grad_slot)
    run_wgrad_into(dy, x, cu_seqlens, grad_local, grad_slot, config)


_grouped_mm_wgrad_into_op = torch.library.custom_op(
    "moonep::grouped_mm_wgrad_into", grouped_mm_wgrad_into_body,
    mutates_args=("grad_local", "grad_slot"),
    schema="(Tensor dy, Tensor x, Tensor cu_seqlens, Tensor(a!) grad_local, "
           "Tensor(b!) grad_slot, int config=-1) -> ()")


@_grouped_mm_wgrad_into_op.register_fake
def _(dy, x, cu_seqlens, grad_local, grad_slot, config=-1):
    _check_wgrad_grads(dy, x, cu_seqlens, grad_local, grad_slot, config, values=False,
                       input_dtype=True)


def _check_out_dtype(out_dtype, dy):
    if out_dtype is not None and out_dtype not in (torch.float32, dy.dtype):
        raise TypeError(f"out_dtype must be None/float32 or the input dtype {dy.dtype}, "
                        f"got {out_dtype}")
    return torch.float32 if out_dtype is None else out_dtype


def _wgrad_kind(out_dtype) -> str:
    # the config list a grouped_mm_wgrad config indexes: fp32 out (the += kernels) or written
    # in the input dtype (wgrad_lp), as in the public grouped_mm_wgrad
    return "wgrad" if out_dtype in (None, torch.float32) else "wgrad_lp"


@torch.library.custom_op(
    "moonep::grouped_mm_wgrad", mutates_args=(),
    schema="(Tensor dy, Tensor x, Tensor cu_seqlens, int epn, int config=-1, "
           "ScalarType? out_dtype=None) -> (Tensor, Tensor)")
def _grouped_mm_wgrad_op(dy: torch.Tensor, x: torch.Tensor, cu_seqlens: torch.Tensor, epn: int,
                         config: int = -1, out_dtype: Optional[torch.dtype] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    O, I = _check_wgrad(dy, x, cu_seqlens, epn, config, kind=_wgrad_kind(out_dtype))
    dtype = _check_out_dtype(out_dtype, dy)
    if dtype != torch.float32:
        backend = backend_for(dy, O, I)
        if backend == "cutlass":
            return _cutlass_wgrad_lp(dy, x, cu_seqlens, epn, config)
        if backend == "torch":
            dw = torch._grouped_mm(dy.t(), x, offs=cu_seqlens)          # [G, O, I] bf16
            dw = dw.masked_fill_(~_nonempty_G11(cu_seqlens), 0)
            return dw[:epn].clone(), dw[epn:].clone()
    gl = torch.zeros(epn, O, I, dtype=torch.float32, device=x.device)
    gs = torch.zeros(epn, O, I, dtype=torch.float32, device=x.device)
    _wgrad_acc_impl(dy, x, cu_seqlens, gl, gs, config)
    return gl.to(dtype), gs.to(dtype)


@_grouped_mm_wgrad_op.register_fake
def _(dy, x, cu_seqlens, epn, config=-1, out_dtype=None):
    O, I = _check_wgrad(dy, x, cu_seqlens, epn, config, values=False,
                        kind=_wgrad_kind(out_dtype))
    dtype = _check_out_dtype(out_dtype, dy)
    return (x.new_empty(epn, O, I, dtype=dtype), x.new_empty(epn, O, I, dtype=dtype))


def _setup_context(ctx, inputs, output):
    x, w_local, w_slot, cu_seqlens, config, zero_tail = inputs
    ctx.save_for_backward(x, w_local, w_slot, cu_seqlens)


def _backward(ctx, dy):
    x, w_local, w_slot, cu = ctx.saved_tensors
    dy = dy.contiguous()
    dx = dwl = dws = None
    if ctx.needs_input_grad[0]:
        # zero tail whatever the forward's zero_tail: it is x's true gradient there
        dx = torch.ops.moonep.grouped_mm_dgrad(dy, w_local, w_slot, cu)
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        # Written straight in the weights' dtype (bf16: one bf16 store per element instead of an
        # fp32 zero-fill, read-modify-write and cast).
        if ctx.needs_input_grad[2] or w_local.dtype != dy.dtype:
            gl, gs = torch.ops.moonep.grouped_mm_wgrad(dy, x, cu, w_local.shape[0], -1,
                                                       w_local.dtype)
        else:
            # No slot grad wanted (e.g. an EP layer without replicas): the slot groups' output
            # is scratch, and its empty groups are not zero-filled (O*I*2 bytes each).
            # (contiguous whatever the weights' strides: the op writes dense [epn, O, I])
            gl = torch.empty_like(w_local, memory_format=torch.contiguous_format)
            gs = torch.empty_like(w_slot, memory_format=torch.contiguous_format)
            torch.ops.moonep.grouped_mm_wgrad_into(dy, x, cu, gl, gs)
        dwl = gl if ctx.needs_input_grad[1] else None
        dws = gs if ctx.needs_input_grad[2] else None
    return dx, dwl, dws, None, None, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)
_GroupedMMFn = fastpath.function("GroupedMMFn", grouped_mm_body, _setup_context, _backward)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

def _require_tensors(**named) -> None:
    # torch.ops would reject a non-tensor with a RuntimeError; say TypeError and which argument.
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")


def _config_arg(config, kind: str) -> int:
    if config is None:
        return -1
    if isinstance(config, str):
        return gemm_cost_model.config_index(kind, config)
    return config


def _check_zero_tail(zero_tail) -> bool:
    if not isinstance(zero_tail, bool):
        raise TypeError(f"zero_tail must be a bool, got {type(zero_tail).__name__}")
    return zero_tail


def grouped_mm(x_MI: torch.Tensor, w_local_BOI: torch.Tensor, w_slot_BOI: torch.Tensor,
               cu_seqlens_G: torch.Tensor, *, config: int | str | None = None,
               zero_tail: bool = True) -> torch.Tensor:
    """y_MO[rows of g] = x_MI[rows of g] @ W_g^T.  Differentiable in x and both weight tensors
    (weight grads come back in the weights' dtype; x's grad has a zero tail).

    ``config``: None (automatic) or a name / index from gemm_cost_model.CONFIGS["fwd"].
    ``zero_tail``: True: the rows of y at or past cu_seqlens_G[-1] are zero; False: they are
    undefined, as torch._grouped_mm leaves them (saves writing them: (M - cu_seqlens_G[-1]) * O
    * 2 bytes, in series with the GEMM).
    """
    _require_tensors(x_MI=x_MI, w_local_BOI=w_local_BOI, w_slot_BOI=w_slot_BOI,
                     cu_seqlens_G=cu_seqlens_G)
    args = (x_MI, w_local_BOI, w_slot_BOI, cu_seqlens_G, _config_arg(config, "fwd"),
            _check_zero_tail(zero_tail))
    if type(args[4]) is int:             # else the op's schema reports a bad config's type
        return fastpath.call(torch.ops.moonep.grouped_mm, grouped_mm_body, _GroupedMMFn, *args)
    return torch.ops.moonep.grouped_mm(*args)


def grouped_mm_dgrad(dy_MO, w_local_BOI, w_slot_BOI, cu_seqlens_G, *, config=None,
                     zero_tail: bool = True):
    """dx_MI[rows of g] = dy_MO[rows of g] @ W_g; rows at or past cu_seqlens_G[-1] zero
    (``zero_tail=False``: undefined, as in `grouped_mm`)."""
    _require_tensors(dy_MO=dy_MO, w_local_BOI=w_local_BOI, w_slot_BOI=w_slot_BOI,
                     cu_seqlens_G=cu_seqlens_G)
    args = (dy_MO, w_local_BOI, w_slot_BOI, cu_seqlens_G, _config_arg(config, "dgrad"),
            _check_zero_tail(zero_tail))
    if type(args[4]) is int:
        return fastpath.call(torch.ops.moonep.grouped_mm_dgrad, grouped_mm_dgrad_body, None,
                             *args)
    return torch.ops.moonep.grouped_mm_dgrad(*args)


def grouped_mm_wgrad(dy_MO, x_MI, cu_seqlens_G, epn: int, *, config=None, out_dtype=None):
    """(dW_local [epn, O, I], dW_slot [epn, O, I]): dW_g = dy[rows g]^T @ x[rows g], fp32
    accumulation; output fp32 (default) or ``out_dtype`` = the input dtype (bf16 written once)."""
    _require_tensors(dy_MO=dy_MO, x_MI=x_MI, cu_seqlens_G=cu_seqlens_G)
    kind = "wgrad" if out_dtype in (None, torch.float32) else "wgrad_lp"
    return torch.ops.moonep.grouped_mm_wgrad(dy_MO, x_MI, cu_seqlens_G, epn,
                                             _config_arg(config, kind), out_dtype)


def grouped_mm_wgrad_into(dy_MO, x_MI, cu_seqlens_G, grad_local_BOI, grad_slot_BOI, *,
                          config=None) -> None:
    """Write-once weight grads in the input dtype (fp32 accumulation, one rounding):
    grad_local_BOI[g] = dW_g for every g < epn (zero when group g is empty);
    grad_slot_BOI[b] = dW_{epn+b} when that group has rows, else left untouched (the MoE pool's
    slots are zero outside a backward, so the unused ones are not rewritten every step)."""
    _require_tensors(dy_MO=dy_MO, x_MI=x_MI, cu_seqlens_G=cu_seqlens_G,
                     grad_local_BOI=grad_local_BOI, grad_slot_BOI=grad_slot_BOI)
    args = (dy_MO, x_MI, cu_seqlens_G, grad_local_BOI, grad_slot_BOI,
            _config_arg(config, "wgrad_lp"))
    if type(args[5]) is int and _increment_version is not None and fastpath.eager(*args) \
            and not fastpath.needs_grad(*args):
        grouped_mm_wgrad_into_body(*args)
        # what the op's in-place registration does: autograd sees the grads as modified
        _increment_version((grad_local_BOI, grad_slot_BOI))
        return
    torch.ops.moonep.grouped_mm_wgrad_into(*args)


_increment_version = getattr(torch.autograd.graph, "increment_version", None)


def grouped_mm_wgrad_accumulate(dy_MO, x_MI, cu_seqlens_G, grad_local_BOI, grad_slot_BOI, *,
                                config=None) -> None:
    """grad_local_BOI[g] += dW_g (g < epn), grad_slot_BOI[g - epn] += dW_g; fp32 grads."""
    _require_tensors(dy_MO=dy_MO, x_MI=x_MI, cu_seqlens_G=cu_seqlens_G,
                     grad_local_BOI=grad_local_BOI, grad_slot_BOI=grad_slot_BOI)
    torch.ops.moonep.grouped_mm_wgrad_accumulate(dy_MO, x_MI, cu_seqlens_G, grad_local_BOI,
                                                 grad_slot_BOI, _config_arg(config, "wgrad"))

