"""MoE grouped GEMM ops: forward, dgrad and wgrad over 2*epn groups of token rows.

Shape letters: docs/architecture.md, "Shape legend" (M rows of the token buffer, padding
included; G = 2*epn groups: 0..epn-1 use w_local_BOI[g], epn..2epn-1 w_slot_BOI[g - epn]).

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

from typing import Optional

import torch
from torch import Tensor

from ..gemm import cost_model as gemm_cost_model
from ..runtime import may_validate, should_validate
from . import fastpath
from .fastpath import AUTOGRAD, BODY, intercepted, route_plain
from .checks import check_no_overlap, shares_storage
from . import grouped_mm_kernels as _kernels
from .grouped_mm_kernels import (ENTRIES, _PLAIN, _cutlass_wgrad_lp, _nonempty_G11, _ref_fwd,
                                 _wgrad_acc_impl, _wgrad_into_impl, backend_for, grads_work,
                                 plain_on, remember, rows_work, run_dgrad, run_fwd, run_grads,
                                 run_rows, run_wgrad_into, switches)

# The backends live in grouped_mm_kernels.py; the names others use stay reachable here.
candidate_mask, clear_plan_cache, tail_flags = (_kernels.candidate_mask,
                                                _kernels.clear_plan_cache, _kernels.tail_flags)
_launch, _call_constants, _pdl_flag, _bounds = (_kernels._launch, _kernels._call_constants,
                                                _kernels._pdl_flag, _kernels._bounds)
_ref_dgrad, _ref_wgrad_acc = _kernels._ref_dgrad, _kernels._ref_wgrad_acc
_CALLS, _tables = _kernels._CALLS, _kernels._tables
_KEEP_EMPTY_SLOTS, _PDL, _KEEP_TAIL = _kernels._KEEP_EMPTY_SLOTS, _kernels._PDL, _kernels._KEEP_TAIL

__all__ = [
    "grouped_mm", "grouped_mm_dgrad", "grouped_mm_wgrad", "grouped_mm_wgrad_accumulate",
    "grouped_mm_wgrad_into",
    "reference_grouped_mm", "backend_for",
]


# --------------------------------------------------------------------------------------------
# Input checks: shape / dtype / device only (they read no data, so they never sync).
# --------------------------------------------------------------------------------------------

def _check_floating(name: str, t, ndim: int, dims: str = "") -> None:
    """t a floating ``ndim``-D Tensor (``dims``: their names, for the message)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D{dims}, got shape {tuple(t.shape)}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")


def _check_weights(w_local: torch.Tensor, w_slot: torch.Tensor) -> tuple[int, int, int]:
    for name, w in (("w_local_BOI", w_local), ("w_slot_BOI", w_slot)):
        _check_floating(name, w, 3, " [epn, O, I]")
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
    if values:
        _check_cu_values(cu, M)


def _check_cu_values(cu: torch.Tensor, M: int) -> None:
    # Value checks read the data: real kernels only (never in fakes), CPU by default.
    if should_validate(cu) and cu.shape[0] > 0:
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


def _check_mm(kind, a, w_local, w_slot, cu, config, values=True):
    """The checks of grouped_mm (``kind`` "fwd": a is x_MI) or grouped_mm_dgrad ("dgrad": a is
    dy_MO).  Returns (epn, O, I)."""
    epn, O, I = _check_weights(w_local, w_slot)
    if kind == "fwd":
        _check_rows("x_MI", a, I, "I", w_local)
    else:
        _check_rows("dy_MO", a, O, "O", w_local)
    _check_cu(cu, 2 * epn, a.shape[0], a.device, values)
    _check_config(config, kind)
    return epn, O, I


def _check_wgrad(dy, x, cu, epn, config, values=True, kind="wgrad"):
    # (a SymInt under dynamic-shape tracing: its value is checked by the real kernel's call)
    if not isinstance(epn, torch.SymInt) and (
            not isinstance(epn, int) or isinstance(epn, bool) or epn < 1):
        raise ValueError(f"epn must be an int >= 1, got {epn!r}")
    for name, t in (("dy_MO", dy), ("x_MI", x)):
        _check_floating(name, t, 2)
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


def reference_grouped_mm(x_MI, w_local_BOI, w_slot_BOI, cu_seqlens_G):
    """Plain per-group loop (fp32 accumulation, fp64 for fp64 inputs); the tests' oracle."""
    _check_mm("fwd", x_MI, w_local_BOI, w_slot_BOI, cu_seqlens_G, -1)
    return _ref_fwd(x_MI, w_local_BOI, w_slot_BOI, cu_seqlens_G)


# --------------------------------------------------------------------------------------------
# One entry per call signature
# --------------------------------------------------------------------------------------------
# A call's static checks, backend and launch plan depend only on its signature: the op, config,
# zero_tail, each tensor's type, shape, dtype and device, the written grads' contiguity, and the
# environment switches the call reads (_kernels.switches).  A signature's first call runs the
# full static checks and makes its entry (_kernels.ENTRIES, cleared by clear_plan_cache): (plain:
# plain_on, validate: may_validate, work: _kernels.rows_work / grads_work).  Later calls look it
# up, run the value checks (cu_seqlens's values where validation can run, memory overlap),
# allocate, read the pointers and the raw stream, and launch.

def _rows_entry(kind, a, wl, ws, cu, config: int, zero_tail) -> tuple:
    """The entry of a grouped_mm ("fwd") / _dgrad call with an int config."""
    try:
        key = (kind, config, zero_tail, switches(), type(a), a.shape, a.dtype, a.device, type(wl),
               wl.shape, wl.dtype, wl.device, type(ws), ws.shape, ws.dtype, ws.device, type(cu),
               cu.shape, cu.dtype, cu.device)
    except AttributeError:
        key = None                                     # not a tensor: the checks say which
    e = ENTRIES.get(key)
    if e is None:
        _check_mm(kind, a, wl, ws, cu, config, values=False)
        dev = a.device
        e = remember(key, (plain_on(dev, a, wl, ws, cu), may_validate(dev),
                           rows_work(kind, a, wl, zero_tail)))
    return e


def _grads_entry(name, kind, flags, input_dtype, dy, x, cu, gl, gs, config: int) -> tuple:
    """The entry of a wgrad_into / _accumulate call (op ``name``) with an int config."""
    try:
        key = (name, config, switches(), type(dy), dy.shape, dy.dtype, dy.device, type(x),
               x.shape, x.dtype, x.device, type(cu), cu.shape, cu.dtype, cu.device, type(gl),
               gl.shape, gl.dtype, gl.device, type(gs), gs.shape, gs.dtype, gs.device,
               gl.is_contiguous(), gs.is_contiguous())
    except AttributeError:
        key = None
    e = ENTRIES.get(key)
    if e is None:
        _check_wgrad_grads(dy, x, cu, gl, gs, config, values=False, input_dtype=input_dtype)
        dev = x.device
        e = remember(key, (plain_on(dev, dy, x, cu, gl, gs), may_validate(dev),
                           grads_work(kind, flags, dy, x, gl)))
    return e


def _run_grads(e: tuple, name, run, dy, x, cu, gl, gs, config: int) -> None:
    """A wgrad_into / _accumulate call of entry ``e``: the value checks (the grads' memory
    overlap compared byte by byte only where a grad shares its storage with another argument:
    checks.shares_storage), then the work."""
    if e[1]:
        _check_cu_values(cu, e[2][1])
    if not e[0] or shares_storage((gl, gs), (dy, x, cu)):
        check_no_overlap(name, [("grad_local", gl), ("grad_slot", gs)],
                         [("dy", dy), ("x", x), ("cu_seqlens", cu)])
    run_grads(e[2], run, dy, x, cu, gl, gs, config)


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------

def _rows_op(name: str, a: str, kind: str, width: int):
    """moonep::<name>, grouped_mm (``a`` is x, ``kind`` "fwd") or grouped_mm_dgrad (dy,
    "dgrad"): its body (checks, work; the op's kernel) and the op with its fake, whose output
    has the ``width``-th of (epn, O, I) columns.  An explicit schema: `int` (not the inferred
    SymInt) so config is static in traces."""
    def body(a: torch.Tensor, w_local: torch.Tensor, w_slot: torch.Tensor,
             cu_seqlens: torch.Tensor, config: int = -1, zero_tail: bool = True) -> torch.Tensor:
        if type(config) is not int:        # (a bool: True == 1 as a key) the checks say why
            _check_mm(kind, a, w_local, w_slot, cu_seqlens, config, values=False)
            _check_cu_values(cu_seqlens, a.shape[0])
            return run_mm(kind, a, w_local, w_slot, cu_seqlens, config, zero_tail)
        e = _rows_entry(kind, a, w_local, w_slot, cu_seqlens, config, zero_tail)
        if e[1]:
            _check_cu_values(cu_seqlens, a.shape[0])
        return run_rows(e[2], kind, a, w_local, w_slot, cu_seqlens, config, zero_tail)

    op = torch.library.custom_op(
        f"moonep::{name}", body, mutates_args=(),
        schema=f"(Tensor {a}, Tensor w_local, Tensor w_slot, Tensor cu_seqlens, int config=-1, "
               "bool zero_tail=True) -> Tensor")

    @op.register_fake
    def _(a, w_local, w_slot, cu_seqlens, config=-1, zero_tail=True):
        cols = _check_mm(kind, a, w_local, w_slot, cu_seqlens, config, values=False)[width]
        return a.new_empty(a.shape[0], cols)

    return body, op


# (every op held by a module-level name: torch keeps custom ops by weak reference)
grouped_mm_body, _grouped_mm_op = _rows_op("grouped_mm", "x", "fwd", 1)
grouped_mm_dgrad_body, _grouped_mm_dgrad_op = _rows_op("grouped_mm_dgrad", "dy", "dgrad", 2)


def _check_wgrad_grads(dy, x, cu, grad_local, grad_slot, config, values=True,
                       input_dtype=False):
    """Checks of the in-place wgrad ops (op and fake): the grads are fp32 (accumulate) or in
    dy's dtype (into, ``input_dtype=True``).  Returns (O, I).  The real kernels also check
    that the grads share no memory with each other or with the inputs (``_grads_op``)."""
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


def _grads_op(name: str, run, input_dtype: bool, kind: str, flags: int):
    """moonep::<name>, grouped_mm_wgrad_accumulate (fp32 grads, ``input_dtype=False``) or
    grouped_mm_wgrad_into (grads in dy's dtype): its body (its checks, the grads' memory
    overlap with each other and the inputs, then the CUTLASS ``kind`` launch with ``flags`` or
    ``run``) and the op with its fake (fake tensors have no storage: no overlap check)."""
    def body(dy: torch.Tensor, x: torch.Tensor, cu_seqlens: torch.Tensor,
             grad_local: torch.Tensor, grad_slot: torch.Tensor, config: int = -1) -> None:
        if type(config) is not int:        # (a bool: True == 1 as a key) the checks say why
            _check_wgrad_grads(dy, x, cu_seqlens, grad_local, grad_slot, config, values=False,
                               input_dtype=input_dtype)
        e = _grads_entry(name, kind, flags, input_dtype, dy, x, cu_seqlens, grad_local,
                         grad_slot, config)
        _run_grads(e, name, run, dy, x, cu_seqlens, grad_local, grad_slot, config)

    op = torch.library.custom_op(
        f"moonep::{name}", body, mutates_args=("grad_local", "grad_slot"),
        schema="(Tensor dy, Tensor x, Tensor cu_seqlens, Tensor(a!) grad_local, "
               "Tensor(b!) grad_slot, int config=-1) -> ()")

    @op.register_fake
    def _(dy, x, cu_seqlens, grad_local, grad_slot, config=-1):
        _check_wgrad_grads(dy, x, cu_seqlens, grad_local, grad_slot, config, values=False,
                           input_dtype=input_dtype)

    return body, op


_, _grouped_mm_wgrad_acc_op = _grads_op("grouped_mm_wgrad_accumulate", _wgrad_acc_impl, False,
                                        "wgrad", 0)
grouped_mm_wgrad_into_body, _grouped_mm_wgrad_into_op = _grads_op(
    "grouped_mm_wgrad_into", _wgrad_into_impl, True, "wgrad_lp", _KEEP_EMPTY_SLOTS)


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


_GroupedMMFn = fastpath.autograd(_grouped_mm_op, "GroupedMMFn", grouped_mm_body, _setup_context,
                                 _backward)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

def _require_tensors(**named) -> None:
    # torch.ops would reject a non-tensor with a RuntimeError; say TypeError and which argument
    # (the entries below call it once an isinstance test per argument has failed).
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


def _rows_call(kind: str, name: str, fn, a, wl, ws, cu, config, zero_tail, a_name: str):
    """The public grouped_mm (``kind`` "fwd") / grouped_mm_dgrad: in eager mode the call's entry
    (_rows_entry) and its work, inside ``fn`` (the autograd.Function, or None: the op) when
    autograd records the call; otherwise, or for tensors of other types, the op ``name``."""
    plain = type(a) in _PLAIN and type(wl) in _PLAIN and type(ws) in _PLAIN and type(cu) in _PLAIN
    if not plain and not (isinstance(a, Tensor) and isinstance(wl, Tensor)
                          and isinstance(ws, Tensor) and isinstance(cu, Tensor)):
        _require_tensors(**{a_name: a, "w_local_BOI": wl, "w_slot_BOI": ws, "cu_seqlens_G": cu})
    config = -1 if config is None else _config_arg(config, kind)
    if zero_tail is not True and zero_tail is not False:
        _check_zero_tail(zero_tail)
    # (a config of another type: the op's schema reports it)
    if plain and type(config) is int and not intercepted():
        e = _rows_entry(kind, a, wl, ws, cu, config, zero_tail)
        if e[0]:
            how = route_plain((a, wl, ws, cu))
            if how == BODY:
                if e[1]:
                    _check_cu_values(cu, a.shape[0])
                return run_rows(e[2], kind, a, wl, ws, cu, config, zero_tail)
            if fn is not None and how == AUTOGRAD:
                return fn.apply(a, wl, ws, cu, config, zero_tail)
    return getattr(torch.ops.moonep, name)(a, wl, ws, cu, config, zero_tail)


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
    return _rows_call("fwd", "grouped_mm", _GroupedMMFn, x_MI, w_local_BOI, w_slot_BOI,
                      cu_seqlens_G, config, zero_tail, "x_MI")


def grouped_mm_dgrad(dy_MO, w_local_BOI, w_slot_BOI, cu_seqlens_G, *, config=None,
                     zero_tail: bool = True):
    """dx_MI[rows of g] = dy_MO[rows of g] @ W_g; rows at or past cu_seqlens_G[-1] zero
    (``zero_tail=False``: undefined, as in `grouped_mm`)."""
    return _rows_call("dgrad", "grouped_mm_dgrad", None, dy_MO, w_local_BOI, w_slot_BOI,
                      cu_seqlens_G, config, zero_tail, "dy_MO")


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
    args = (dy_MO, x_MI, cu_seqlens_G, grad_local_BOI, grad_slot_BOI)
    plain = (type(dy_MO) in _PLAIN and type(x_MI) in _PLAIN and type(cu_seqlens_G) in _PLAIN
             and type(grad_local_BOI) in _PLAIN and type(grad_slot_BOI) in _PLAIN)
    if not plain and not all(isinstance(t, Tensor) for t in args):
        _require_tensors(dy_MO=dy_MO, x_MI=x_MI, cu_seqlens_G=cu_seqlens_G,
                         grad_local_BOI=grad_local_BOI, grad_slot_BOI=grad_slot_BOI)
    config = -1 if config is None else _config_arg(config, "wgrad_lp")
    if plain and type(config) is int and _increment_version is not None \
            and not intercepted():
        e = _grads_entry("grouped_mm_wgrad_into", "wgrad_lp", _KEEP_EMPTY_SLOTS, True, *args,
                         config)
        if e[0] and route_plain(args) == BODY:
            _run_grads(e, "grouped_mm_wgrad_into", _wgrad_into_impl, *args, config)
            # what the op's in-place registration does: autograd sees the grads as modified
            _increment_version((grad_local_BOI, grad_slot_BOI))
            return
    torch.ops.moonep.grouped_mm_wgrad_into(*args, config)


_increment_version = getattr(torch.autograd.graph, "increment_version", None)


def grouped_mm_wgrad_accumulate(dy_MO, x_MI, cu_seqlens_G, grad_local_BOI, grad_slot_BOI, *,
                                config=None) -> None:
    """grad_local_BOI[g] += dW_g (g < epn), grad_slot_BOI[g - epn] += dW_g; fp32 grads."""
    _require_tensors(dy_MO=dy_MO, x_MI=x_MI, cu_seqlens_G=cu_seqlens_G,
                     grad_local_BOI=grad_local_BOI, grad_slot_BOI=grad_slot_BOI)
    torch.ops.moonep.grouped_mm_wgrad_accumulate(dy_MO, x_MI, cu_seqlens_G, grad_local_BOI,
                                                 grad_slot_BOI, _config_arg(config, "wgrad"))

