"""FP8 grouped GEMM ops (the DeepSeek-V3 recipe): forward and dgrad over 2*epn groups of rows
with e4m3 operands and fp32 scales, fp32 accumulation, bf16 output; and a differentiable
bf16-in form that quantises on the fly.

Shape letters: docs/architecture.md, "Shape legend" (M rows of the token buffer, B = epn, G = 2*epn
groups: 0..B-1 use the home weights, B..2B-1 the slots; W_g [O, I]; a row's scale columns C =
ceil(last dim / 128); a weight's scale blocks o = ceil(O/128), i = ceil(I/128):
moonep_ops/ops/quantize_fp8.py).

  grouped_mm_fp8(x [M, I] e4m3, x_scale [M, C], w_local [B, O, I] e4m3, w_local_scale [B, o, i],
                 w_slot, w_slot_scale, cu_seqlens [G] i32) -> y [M, O] bf16
      y[rows g] = bf16( (x * x_scale)[rows g] @ (W_g * W_g_scale)^T ), fp32 accumulation
  grouped_mm_fp8_dgrad(dy [M, O] e4m3, dy_scale [M, C], w_local, w_local_scale, w_slot,
                       w_slot_scale, cu_seqlens) -> dx [M, I] bf16
      dx[rows g] = bf16( (dy * dy_scale)[rows g] @ (W_g * W_g_scale) ): the same weights and
      block scales as the forward; a 128 x 128 block's scale is also the scale of the
      transposed block, so the kernel reads W_g^T with the transposed scale grid
  grouped_linear_fp8(x [M, I], w_local [B, O, I], w_slot, cu_seqlens, pow2_scales=False)
                                                                   -> y [M, O] bf16
      differentiable in x, w_local and w_slot (one floating dtype).  Forward: x per 1 x 128
      tile, the weights per 128 x 128 block, grouped_mm_fp8.  Backward: dgrad in FP8 (dy per
      1 x 128 tile along O, grouped_mm_fp8_dgrad), wgrad in the weights' dtype from the bf16
      x kept by the forward (grouped_mm_wgrad: fp32 accumulation, one rounding).

cu_seqlens is read as by the bf16 ops (moonep_ops/ops/grouped_mm.py): inclusive END offsets,
rows at or past cu_seqlens[-1] are padding and their outputs are zero (``zero_tail=False``:
undefined, not written, as in the bf16 ops).  O and I must be
multiples of 16 on every device (the kernel's 16-byte TMA rows of e4m3; checked on the CPU too,
so a shape that runs here runs on the GPU).  Nothing here is differentiable but
grouped_linear_fp8 (e4m3 inputs carry no gradient).

Backends (from device only, never from data):
  CUDA, and native.gemm_fp8() is not None (libmoonep_gemm.so reports ABI >=
      native.GEMM_FP8_ABI_VERSION and exports native.GEMM_FP8_PROTOTYPES) -> the CUTLASS sm90
      FP8 grouped GEMM with blockwise scaling (cutlass_kernels/kernel_fp8_fwd.cu), called as in
      ``_launch``: its prep kernel picks the config on the device from the group sizes
      (moonep_ops/gemm/fp8_cost.py, the host mirror); dgrad runs the same kernel on transposed
      copies of the weights and scales (B*O*I + 4*B*o*i bytes per call: the sm90 FP8 MMA takes
      K-major operands only; the FP8 layer avoids it by running grouped_mm_fp8 on weights
      quantised transposed, moe_experts_fp8.py);
  anything else -> the reference below: dequantise to fp32, fp32 matmul per group (reads
      cu_seqlens on the host: a sync on CUDA).
Env MOONEP_GEMM_BACKEND=reference forces the reference on CUDA; MOONEP_GEMM_FP8_CONFIG=name
(moonep_ops.gemm.fp8_cost.NAMES) forces one kernel config, MOONEP_GEMM_PDL=0 launches the GEMM
after the prep kernel instead of as its programmatic dependent (the same results).
"""
from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from .. import native
from .. import settings
from ..gemm import fp8_cost
from ..runtime import call_on, current_raw_stream, sm_count
# _pdl_flag: the bf16 ops' MOONEP_GEMM_PDL switch, on by default here too (1.020 gm, fp8.md)
from .grouped_mm import _bounds, _check_cu, _pdl_flag, tail_flags
from .grouped_mm_kernels import _on_cuda
from . import grouped_mm as _gm  # registers moonep::grouped_mm_wgrad; the bf16 ops' checks
from . import quantize_fp8 as qf

OUT_DTYPE = torch.bfloat16
ALIGN = 16          # O and I: 16 e4m3 elements = one 16-byte TMA unit

__all__ = ["grouped_mm_fp8", "grouped_mm_fp8_dgrad", "grouped_linear_fp8", "reference_fp8",
           "backend_for_fp8", "ALIGN"]


# --------------------------------------------------------------------------------------------
# Checks (shape / dtype / device; the cu_seqlens values on real CPU data)
# --------------------------------------------------------------------------------------------

def _check_weights(op: str, wl, wls, ws, wss) -> tuple[int, int, int]:
    shape_l = qf.check_blocks_fp8(op, "w_local", wl, wls)
    shape_s = qf.check_blocks_fp8(op, "w_slot", ws, wss)
    if len(shape_l) != 3:
        raise ValueError(f"{op}: w_local must be 3-D [epn, O, I], got shape {list(shape_l)}")
    if shape_l != shape_s:
        raise ValueError(f"{op}: w_local {list(shape_l)} and w_slot {list(shape_s)} must have "
                         "the same shape [epn, O, I]")
    if wl.device != ws.device:
        raise ValueError(f"{op}: w_local is on {wl.device}, w_slot on {ws.device}")
    epn, O, I = shape_l
    if epn < 1:
        raise ValueError(f"{op}: epn (w_local.shape[0]) must be >= 1")
    _check_align(op, O, I)
    return epn, O, I


def _check_align(op: str, O, I, names=("O", "I")) -> None:
    for name, d in zip(names, (O, I)):
        if d % ALIGN:
            raise ValueError(f"{op}: {name}={d} must be a multiple of {ALIGN} (the FP8 kernel "
                             "reads 16-byte rows of e4m3; the CPU path keeps the same rule)")


@qf.fp8_checks
def _check_fwd(op, xq, xs, wl, wls, ws, wss, cu, values=True, rows_name="x"):
    epn, O, I = _check_weights(op, wl, wls, ws, wss)
    cols = I if rows_name == "x" else O
    M, _ = qf.check_rows_fp8(op, rows_name, xq, xs, cols=cols)
    if xq.device != wl.device:
        raise ValueError(f"{op}: {rows_name} is on {xq.device}, the weights on {wl.device}")
    _check_cu(cu, 2 * epn, M, xq.device, values)
    return epn, O, I


# --------------------------------------------------------------------------------------------
# Backend choice
# --------------------------------------------------------------------------------------------

class Fp8Gemm:
    """One FP8 grouped GEMM of libmoonep_gemm.so, ``kind`` "fp8" (this module's) or "fp8_wgrad"
    (grouped_mm_fp8_wgrad.py): its exports are native._fp8_gemm_prototypes(kind), whose launch
    takes the GEMM's own operands, then the same tail for both (``launch``).  ``feature`` /
    ``require``: native's explicit ABI check for it (a library of an older ABI, or one that
    lacks the exports, serves the bf16 GEMMs only); ``cost``: its host mirror of the device's
    config choice (gemm/fp8_cost.py, fp8_wgrad_cost.py); ``config_env``: the switch that forces
    one config."""

    def __init__(self, kind: str, feature, require, cost, config_env: str, what: str):
        self.kind, self.feature, self.require, self.cost = kind, feature, require, cost
        self.config_env, self.what = config_env, what
        self.entry = f"grouped_gemm_{kind}"
        self._table = None
        self.workspace_bytes = functools.lru_cache(maxsize=None)(
            lambda G, sms: getattr(self.require(), f"gemm_{kind}_workspace_bytes")(G, sms))

    def backend(self, t: Tensor) -> str:
        """'cutlass' or 'reference' for data like ``t`` (device and environment only)."""
        if not _on_cuda(t) or settings.get("MOONEP_GEMM_BACKEND").lower() == "reference":
            return "reference"
        return "cutlass" if self.feature() is not None else "reference"

    def tuning_table(self):
        """The cost model's tuning table as the launch takes it: built once per process from
        its gemm/tuning_fp8*.py (the file the FP8 fit rewrites)."""
        if self._table is None:
            vals = self.cost.tuning_table()
            self._table = (ctypes.c_float * len(vals))(*vals)
        return self._table

    def launch(self, operands: tuple, G: int, flags: int, config, dev) -> Tensor:
        """``grouped_gemm_<kind>(*operands, config, tuning table, flags, workspace, its bytes,
        SM count, stream)`` on the current stream.  ``config``: None (``config_env``, else
        chosen on the device), a name or an index.  Returns the workspace (its first int32:
        the config that ran, written on the device)."""
        lib = self.require()
        env = settings.get(self.config_env) or None
        cfg = self.cost.config_index(env if config is None else config)
        sms = sm_count(dev)
        nbytes = self.workspace_bytes(G, sms)
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        # the raw stream and no device switch when dev is current (runtime: ~2 us and a
        # context manager less than torch.cuda.current_stream / torch.cuda.device)
        rc = call_on(dev, getattr(lib, self.entry), *operands, cfg, self.tuning_table(), flags,
                     workspace.data_ptr(), nbytes, sms, current_raw_stream(dev))
        if rc:
            native.gemm_check(rc, self.what)
        return workspace


FP8_GEMM = Fp8Gemm("fp8", native.gemm_fp8, native.require_gemm_fp8, fp8_cost,
                   "MOONEP_GEMM_FP8_CONFIG", "moonep FP8 grouped GEMM")
backend_for_fp8 = FP8_GEMM.backend
_tuning_table = FP8_GEMM.tuning_table        # (the tests' and benchmarks' name)


# --------------------------------------------------------------------------------------------
# Reference: dequantise, fp32 math (any device)
# --------------------------------------------------------------------------------------------

def _ref(aq, as_, wl, wls, ws, wss, cu, transpose_w: bool) -> Tensor:
    a = qf.dequantize_rows(aq, as_)                          # [M, K] fp32
    wdl = qf.dequantize_blocks(wl, wls)                      # [B, O, I] fp32
    wds = qf.dequantize_blocks(ws, wss)
    epn = wl.shape[0]
    n_out = wl.shape[2] if transpose_w else wl.shape[1]
    out = torch.zeros(aq.shape[0], n_out, dtype=OUT_DTYPE, device=aq.device)
    for g, s, e in _bounds(cu):
        if e > s:
            w = wdl[g] if g < epn else wds[g - epn]
            # a contiguous right operand whatever the layout asked for: a CPU BLAS picks its
            # kernel (and so its summation order) by operand layout, and the FP8 backward's
            # dgrad, the forward GEMM on W^T, must equal dequant(dy) @ W bitwise on any CPU
            out[s:e] = (a[s:e] @ (w if transpose_w else w.t()).contiguous()).to(OUT_DTYPE)
    return out


def reference_fp8(x_q, x_scale, w_local, w_local_scale, w_slot, w_slot_scale, cu_seqlens):
    """The forward's reference (dequantise, fp32 matmul per group, bf16 rounding once)."""
    _check_fwd("grouped_mm_fp8", x_q, x_scale, w_local, w_local_scale, w_slot, w_slot_scale,
               cu_seqlens)
    return _ref(x_q, x_scale, w_local, w_local_scale, w_slot, w_slot_scale, cu_seqlens, False)


# --------------------------------------------------------------------------------------------
# CUTLASS (libmoonep_gemm.so: moonep_grouped_gemm_fp8)
# --------------------------------------------------------------------------------------------

def _launch(aq, as_, bl, bls, bs, bss, cu, epn, M, n, k, config=None,
            zero_tail: bool = True) -> Tensor:
    """D [M, n] bf16 = A [M, k] x B_g [n, k]^T per group, on the current stream.  ``config``:
    as Fp8Gemm.launch; ``zero_tail=False``: the rows past cu[-1] are not written."""
    out = torch.empty(M, n, dtype=OUT_DTYPE, device=aq.device)
    if M:
        G = 2 * epn
        FP8_GEMM.launch((aq.data_ptr(), as_.data_ptr(), bl.data_ptr(), bls.data_ptr(),
                         bs.data_ptr(), bss.data_ptr(), out.data_ptr(), cu.data_ptr(),
                         G, epn, M, n, k), G, _pdl_flag() | tail_flags(zero_tail), config,
                        aq.device)
    return out


def _t(t: Tensor) -> Tensor:
    return t.transpose(-2, -1).contiguous()


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------

_FWD_SCHEMA = ("(Tensor x, Tensor x_scale, Tensor w_local, Tensor w_local_scale, Tensor w_slot, "
               "Tensor w_slot_scale, Tensor cu_seqlens, bool zero_tail=True) -> Tensor")
_DGRAD_SCHEMA = ("(Tensor dy, Tensor dy_scale, Tensor w_local, Tensor w_local_scale, "
                 "Tensor w_slot, Tensor w_slot_scale, Tensor cu_seqlens, "
                 "bool zero_tail=True) -> Tensor")


@torch.library.custom_op("moonep::grouped_mm_fp8", mutates_args=(), schema=_FWD_SCHEMA)
def _grouped_mm_fp8_op(x, x_scale, w_local, w_local_scale, w_slot, w_slot_scale, cu_seqlens,
                       zero_tail=True):
    epn, O, I = _check_fwd("grouped_mm_fp8", x, x_scale, w_local, w_local_scale, w_slot,
                           w_slot_scale, cu_seqlens)
    if backend_for_fp8(x) == "cutlass":
        return _launch(x, x_scale, w_local, w_local_scale, w_slot, w_slot_scale,
                       cu_seqlens.contiguous(), epn, x.shape[0], O, I, zero_tail=zero_tail)
    return _ref(x, x_scale, w_local, w_local_scale, w_slot, w_slot_scale, cu_seqlens, False)


@_grouped_mm_fp8_op.register_fake
def _(x, x_scale, w_local, w_local_scale, w_slot, w_slot_scale, cu_seqlens, zero_tail=True):
    _, O, _ = _check_fwd("grouped_mm_fp8", x, x_scale, w_local, w_local_scale, w_slot,
                         w_slot_scale, cu_seqlens, values=False)
    return x.new_empty((x.shape[0], O), dtype=OUT_DTYPE)


@torch.library.custom_op("moonep::grouped_mm_fp8_dgrad", mutates_args=(), schema=_DGRAD_SCHEMA)
def _grouped_mm_fp8_dgrad_op(dy, dy_scale, w_local, w_local_scale, w_slot, w_slot_scale,
                             cu_seqlens, zero_tail=True):
    epn, O, I = _check_fwd("grouped_mm_fp8_dgrad", dy, dy_scale, w_local, w_local_scale, w_slot,
                           w_slot_scale, cu_seqlens, rows_name="dy")
    if backend_for_fp8(dy) == "cutlass":
        # K-major operands only (sm90 FP8 wgmma): W_g^T [I, O] and its [i, o] scale grid
        return _launch(dy, dy_scale, _t(w_local), _t(w_local_scale), _t(w_slot),
                       _t(w_slot_scale), cu_seqlens.contiguous(), epn, dy.shape[0], I, O,
                       zero_tail=zero_tail)
    return _ref(dy, dy_scale, w_local, w_local_scale, w_slot, w_slot_scale, cu_seqlens, True)


@_grouped_mm_fp8_dgrad_op.register_fake
def _(dy, dy_scale, w_local, w_local_scale, w_slot, w_slot_scale, cu_seqlens, zero_tail=True):
    _, _, I = _check_fwd("grouped_mm_fp8_dgrad", dy, dy_scale, w_local, w_local_scale, w_slot,
                         w_slot_scale, cu_seqlens, values=False, rows_name="dy")
    return dy.new_empty((dy.shape[0], I), dtype=OUT_DTYPE)


# -- the differentiable recipe ---------------------------------------------------------------

@qf.fp8_checks
def _check_linear(x, w_local, w_slot, cu, pow2, values=True):
    op = "grouped_linear_fp8"
    for name, t in (("x", x), ("w_local", w_local), ("w_slot", w_slot)):
        qf._check_float(op, name, t, 2)
    if not isinstance(pow2, bool):
        raise qf.FP8ArgumentError(f"{op}: pow2_scales must be a bool, got {type(pow2).__name__}")
    epn, O, I = _gm._check_weights(w_local, w_slot)      # the bf16 op's shape / dtype rules
    _gm._check_rows("x_MI", x, I, "I", w_local)
    _check_align(op, O, I)
    _check_cu(cu, 2 * epn, x.shape[0], x.device, values)
    return epn, O, I


_LINEAR_SCHEMA = ("(Tensor x, Tensor w_local, Tensor w_slot, Tensor cu_seqlens, "
                  "bool pow2_scales=False) -> Tensor")


def _quantised_weights(w_local, w_slot, pow2):
    wl, wls = qf.blocks_fp8(w_local.detach(), pow2)
    ws, wss = qf.blocks_fp8(w_slot.detach(), pow2)
    return wl, wls, ws, wss


@torch.library.custom_op("moonep::grouped_linear_fp8", mutates_args=(), schema=_LINEAR_SCHEMA)
def _grouped_linear_fp8_op(x, w_local, w_slot, cu_seqlens, pow2_scales=False):
    _check_linear(x, w_local, w_slot, cu_seqlens, pow2_scales)
    xq, xs = qf.rows_fp8(x.contiguous(), pow2_scales)
    return _grouped_mm_fp8_op(xq, xs, *_quantised_weights(w_local, w_slot, pow2_scales),
                              cu_seqlens)


@_grouped_linear_fp8_op.register_fake
def _(x, w_local, w_slot, cu_seqlens, pow2_scales=False):
    _, O, _ = _check_linear(x, w_local, w_slot, cu_seqlens, pow2_scales, values=False)
    return x.new_empty((x.shape[0], O), dtype=OUT_DTYPE)


def _linear_setup(ctx, inputs, output):
    x, w_local, w_slot, cu, pow2 = inputs
    ctx.pow2 = pow2
    ctx.save_for_backward(x, w_local, w_slot, cu)


def _linear_backward(ctx, dy):
    x, w_local, w_slot, cu = ctx.saved_tensors
    dx = dwl = dws = None
    if ctx.needs_input_grad[0]:
        dq, ds = torch.ops.moonep.quantize_fp8_rows(dy.contiguous(), ctx.pow2)
        wq = [torch.ops.moonep.quantize_fp8_blocks(w.detach(), ctx.pow2) for w in (w_local, w_slot)]
        dx = torch.ops.moonep.grouped_mm_fp8_dgrad(dq, ds, *wq[0], *wq[1], cu).to(x.dtype)
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        # wgrad in the weights' dtype from the kept high-precision x (not the quantised one)
        gl, gs = torch.ops.moonep.grouped_mm_wgrad(dy.to(x.dtype).contiguous(), x.contiguous(),
                                                   cu, w_local.shape[0], -1, w_local.dtype)
        dwl = gl if ctx.needs_input_grad[1] else None
        dws = gs if ctx.needs_input_grad[2] else None
    return dx, dwl, dws, None, None


_grouped_linear_fp8_op.register_autograd(_linear_backward, setup_context=_linear_setup)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

def grouped_mm_fp8(x_MI: Tensor, x_scale_MC: Tensor, w_local_BOI: Tensor,
                   w_local_scale_Boi: Tensor, w_slot_BOI: Tensor, w_slot_scale_Boi: Tensor,
                   cu_seqlens_G: Tensor, *, zero_tail: bool = True) -> Tensor:
    """y_MO (bf16) = dequant(x) @ dequant(W_g)^T per group; rows at or past cu_seqlens_G[-1]
    zero (``zero_tail=False``: undefined, not written).  Not differentiable (see
    grouped_linear_fp8)."""
    return torch.ops.moonep.grouped_mm_fp8(x_MI, x_scale_MC, w_local_BOI, w_local_scale_Boi,
                                           w_slot_BOI, w_slot_scale_Boi, cu_seqlens_G,
                                           _gm._check_zero_tail(zero_tail))


def grouped_mm_fp8_dgrad(dy_MO: Tensor, dy_scale_MC: Tensor, w_local_BOI: Tensor,
                         w_local_scale_Boi: Tensor, w_slot_BOI: Tensor, w_slot_scale_Boi: Tensor,
                         cu_seqlens_G: Tensor, *, zero_tail: bool = True) -> Tensor:
    """dx_MI (bf16) = dequant(dy) @ dequant(W_g) per group; rows at or past cu_seqlens_G[-1]
    zero (``zero_tail=False``: undefined)."""
    return torch.ops.moonep.grouped_mm_fp8_dgrad(dy_MO, dy_scale_MC, w_local_BOI,
                                                 w_local_scale_Boi, w_slot_BOI, w_slot_scale_Boi,
                                                 cu_seqlens_G, _gm._check_zero_tail(zero_tail))


def grouped_linear_fp8(x_MI: Tensor, w_local_BOI: Tensor, w_slot_BOI: Tensor,
                       cu_seqlens_G: Tensor, *, pow2_scales: bool = False) -> Tensor:
    """The FP8 recipe, differentiable: y_MO (bf16) = x_MI @ W_g^T with x per 1 x 128 tile and
    W per 128 x 128 block in e4m3; backward dgrad in FP8, wgrad from the kept x."""
    return torch.ops.moonep.grouped_linear_fp8(x_MI, w_local_BOI, w_slot_BOI, cu_seqlens_G,
                                               pow2_scales)
