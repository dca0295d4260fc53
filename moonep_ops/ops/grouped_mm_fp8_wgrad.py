"""FP8 weight gradient of the grouped expert GEMMs (the DeepSeek-V3 recipe's Wgrad in FP8):

    dW_g [O, I] (bf16) = (dy * s_dy)[rows of g]^T @ (x * s_x)[rows of g],   fp32 accumulation

over the G = 2*epn groups of a receive buffer (groups 0..B-1 the home experts, B..G-1 the slots),
with BOTH operands quantised along the tokens: one fp32 scale per 1 x 128 tile of one feature over
128 consecutive tokens of one group (moonep_ops/ops/quantize_fp8_tokens.py: the token-major
layout, the tile map t0_g = floor(cu[g-1] / 128) + g and why it suits any token_padding).

Ops (namespace moonep; schema, fake, CPU reference and checks here, the kernel is C++ only):
  grouped_mm_fp8_wgrad(dyT [O, Mp] e4m3, dyT_scale [Nb, O] fp32, xT [I, Mp] e4m3,
                       xT_scale [Nb, I] fp32, cu_seqlens [G] int32, epn)
      -> (dW_local [epn, O, I] bf16, dW_slot [epn, O, I] bf16); an empty group's dW is zero.
  grouped_mm_fp8_wgrad_into(dyT, dyT_scale, xT, xT_scale, cu_seqlens, grad_local!, grad_slot!)
      -> (): writes dW once into given bf16 [epn, O, I] tensors, as grouped_mm_wgrad_into does:
      empty local groups zeroed, empty slot groups untouched (the MoE pool's slot grads are zero
      outside a backward).
  Mp = 128 * Nb, Nb = M // 128 + G (quantize_fp8_tokens' outputs for a buffer of M rows); O and I
  multiples of 16 (16-byte TMA rows of e4m3, 8-element bf16 rows of dW).  The group offsets are
  read as every grouped op reads them (inclusive END offsets); the rows are those of the buffer
  the operands were quantised from, whose M the op does not need (the tiles carry it).

CPU reference (any device; reads cu_seqlens on the host): dequantise each group's tiles to fp32
(q * s, one rounded product each), dW_g = a_g^T @ b_g in fp32 with a_g [M_g, O], b_g [M_g, I]
row-layout contiguous tensors, one bf16 rounding: exactly dequantise-then-matmul
(tests/test_fp8_wgrad.py holds it bitwise to moonep_ops.ops.quantize_fp8_tokens.dequantize_tokens
followed by the same matmul).

Backends (device only, never data): CUDA and native.gemm_fp8_wgrad() (libmoonep_gemm.so reports
ABI >= native.GEMM_FP8_WGRAD_ABI_VERSION with every export of native.GEMM_FP8_WGRAD_PROTOTYPES)
-> the CUTLASS sm90 grouped GEMM with blockwise scaling (cutlass_kernels/kernel_fp8_wgrad.cu):
its prep kernel reads cu_seqlens on the device, orders the groups largest first and picks the
config with the cost model (moonep_ops/gemm/fp8_wgrad_cost.py is the host mirror; no sync,
capturable); anything else -> the reference.  Env MOONEP_GEMM_BACKEND=reference forces the
reference, MOONEP_GEMM_FP8_WGRAD_CONFIG=name one config, MOONEP_GEMM_PDL=0 the launch without PDL.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import native
from ..gemm import fp8_wgrad_cost
from . import quantize_fp8 as qf
from .checks import check_no_overlap
from .grouped_mm_fp8 import Fp8Gemm
from .grouped_mm_kernels import _KEEP_EMPTY_SLOTS, _PDL, _pdl_flag
from .quantize_fp8 import TILE, FP8ArgumentError
from .quantize_fp8_tokens import dequantize_group, group_tiles

OUT_DTYPE = torch.bfloat16
ALIGN = 16

__all__ = ["grouped_mm_fp8_wgrad", "grouped_mm_fp8_wgrad_into", "reference_fp8_wgrad",
           "backend_for_fp8_wgrad"]


# --------------------------------------------------------------------------------------------
# Checks (shape / dtype / device before any kernel; the offsets' values on CPU data)
# --------------------------------------------------------------------------------------------

def _check_tokens_operand(op: str, name: str, q, s) -> tuple[int, int]:
    """q [F, Mp] e4m3, s [Nb, F] fp32, Mp = 128 * Nb, contiguous, one device.  (F, Nb)."""
    qf._check_fp8_pair(op, name, q, s)
    if q.dim() != 2 or s.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D [features, 128 * Nb] and {name}_scale "
                         f"[Nb, features], got {tuple(q.shape)} and {tuple(s.shape)}")
    F, Mp = q.shape
    if Mp % TILE:
        raise ValueError(f"{op}: {name} has {Mp} token columns, not a multiple of {TILE} (the "
                         "token-major layout of moonep::quantize_fp8_tokens)")
    if tuple(s.shape) != (Mp // TILE, F):
        raise ValueError(f"{op}: {name}_scale must be [Nb, features] = {[Mp // TILE, F]} (one "
                         f"scale per 128-token tile and feature of {name}), got {list(s.shape)}")
    if s.device != q.device:
        raise ValueError(f"{op}: {name}_scale is on {s.device}, {name} on {q.device}")
    for n, t in ((name, q), (f"{name}_scale", s)):
        if not t.is_contiguous():
            raise ValueError(f"{op}: {n} must be contiguous (got strides {t.stride()})")
    if F % ALIGN:
        raise ValueError(f"{op}: {name} has {F} features, not a multiple of {ALIGN} (the FP8 "
                         "kernel's 16-byte rows; the CPU path keeps the same rule)")
    return F, Mp // TILE


@qf.fp8_checks
def _check(op, dyT, dys, xT, xs, cu, epn, values=True) -> tuple[int, int, int]:
    """(O, I, Nb).  Every check of both ops' common arguments."""
    if not isinstance(epn, torch.SymInt) and (
            not isinstance(epn, int) or isinstance(epn, bool) or epn < 1):
        raise FP8ArgumentError(f"{op}: epn must be an int >= 1, got {epn!r}")
    O, Nb = _check_tokens_operand(op, "dyT", dyT, dys)
    I, Nb_x = _check_tokens_operand(op, "xT", xT, xs)
    if Nb_x != Nb:
        raise ValueError(f"{op}: dyT has {Nb} token tiles and xT {Nb_x}: both must be quantised "
                         "from the same buffer (quantize_fp8_tokens with the same cu_seqlens)")
    if xT.device != dyT.device:
        raise ValueError(f"{op}: xT is on {xT.device}, dyT on {dyT.device}")
    if not isinstance(cu, Tensor):
        raise FP8ArgumentError(f"{op}: cu_seqlens must be a Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise FP8ArgumentError(f"{op}: cu_seqlens must be int32, got {cu.dtype}")
    G = 2 * epn
    if cu.dim() != 1 or cu.shape[0] != G:
        raise ValueError(f"{op}: cu_seqlens must be 1-D of length G = 2*epn = {G}, got "
                         f"{tuple(cu.shape)}")
    if cu.device != dyT.device:
        raise ValueError(f"{op}: cu_seqlens is on {cu.device}, the operands on {dyT.device}")
    if not isinstance(Nb, torch.SymInt) and not isinstance(G, torch.SymInt) and Nb < G:
        raise ValueError(f"{op}: {Nb} token tiles is fewer than G = {G}: the operands hold "
                         "M // 128 + G tiles (quantize_fp8_tokens of the same buffer and groups)")
    if values and cu.device.type == "cpu":
        c = cu.tolist()
        mmax = (Nb - G) * TILE + TILE - 1
        if c[0] < 0 or any(b < a for a, b in zip(c, c[1:])) or c[-1] > mmax:
            raise ValueError(f"{op}: cu_seqlens must be non-decreasing inclusive end offsets in "
                             f"[0, M] (M <= {mmax} for {Nb} token tiles), got {c}")
    return O, I, Nb


@qf.fp8_checks
def _check_grads(op, grad_local, grad_slot, epn, O, I, device) -> None:
    for name, g in (("grad_local", grad_local), ("grad_slot", grad_slot)):
        if not isinstance(g, Tensor):
            raise FP8ArgumentError(f"{op}: {name} must be a Tensor, got {type(g).__name__}")
        if g.dtype != OUT_DTYPE:
            raise FP8ArgumentError(f"{op}: {name} must be {OUT_DTYPE}, got {g.dtype}")
        if tuple(g.shape) != (epn, O, I):
            raise ValueError(f"{op}: {name} must be [epn, O, I] = {[epn, O, I]}, got "
                             f"{list(g.shape)}")
        if g.device != device:
            raise ValueError(f"{op}: {name} is on {g.device}, the operands on {device}")
        if not g.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (got strides {g.stride()})")


def _epn_of(grad_local) -> int:
    return grad_local.shape[0] if isinstance(grad_local, Tensor) and grad_local.dim() >= 1 else 0


# --------------------------------------------------------------------------------------------
# Backend choice (device and environment only)
# --------------------------------------------------------------------------------------------

FP8_WGRAD_GEMM = Fp8Gemm("fp8_wgrad", native.gemm_fp8_wgrad, native.require_gemm_fp8_wgrad,
                         fp8_wgrad_cost, "MOONEP_GEMM_FP8_WGRAD_CONFIG",
                         "moonep FP8 wgrad grouped GEMM")
backend_for_fp8_wgrad = FP8_WGRAD_GEMM.backend
_tuning_table = FP8_WGRAD_GEMM.tuning_table          # (the tests' and benchmarks' name)


# --------------------------------------------------------------------------------------------
# Reference: dequantise, fp32 math
# --------------------------------------------------------------------------------------------

def _ref_groups(dyT, dys, xT, xs, cu):
    """(g, dW_g fp32) of every non-empty group."""
    G = cu.shape[0]
    mmax = (dys.shape[0] - G) * TILE + TILE - 1
    for g, s, e, t0 in group_tiles(cu, mmax):
        m = e - s
        if m > 0:
            a = dequantize_group(dyT, dys, t0, m)             # [m, O]
            b = dequantize_group(xT, xs, t0, m)               # [m, I]
            yield g, a.t() @ b


def _ref_into(dyT, dys, xT, xs, cu, grad_local, grad_slot):
    epn = grad_local.shape[0]
    grad_local.zero_()                     # empty local groups read 0; empty slots untouched
    for g, dw in _ref_groups(dyT, dys, xT, xs, cu):
        (grad_local[g] if g < epn else grad_slot[g - epn]).copy_(dw.to(OUT_DTYPE))


def reference_fp8_wgrad(dyT, dyT_scale, xT, xT_scale, cu_seqlens, epn):
    """(dW_local, dW_slot) bf16 by the reference (dequantise, fp32 matmul, one rounding)."""
    O, I, _ = _check("grouped_mm_fp8_wgrad", dyT, dyT_scale, xT, xT_scale, cu_seqlens, epn)
    gl = torch.zeros(epn, O, I, dtype=OUT_DTYPE, device=dyT.device)
    gs = torch.zeros(epn, O, I, dtype=OUT_DTYPE, device=dyT.device)
    for g, dw in _ref_groups(dyT, dyT_scale, xT, xT_scale, cu_seqlens):
        (gl[g] if g < epn else gs[g - epn]).copy_(dw.to(OUT_DTYPE))
    return gl, gs


# --------------------------------------------------------------------------------------------
# CUTLASS (libmoonep_gemm.so: moonep_grouped_gemm_fp8_wgrad)
# --------------------------------------------------------------------------------------------

def _launch(dyT, dys, xT, xs, cu, grad_local, grad_slot, keep_empty_slots: bool,
            config=None, pdl: bool | None = None) -> Tensor:
    """One call on the current stream; returns the workspace (Fp8Gemm.launch; ``config`` as
    there).  ``pdl``: None (MOONEP_GEMM_PDL) or forced."""
    epn, O, I = grad_local.shape
    G = 2 * epn
    flags = (_pdl_flag() if pdl is None else (_PDL if pdl else 0)) | \
        (_KEEP_EMPTY_SLOTS if keep_empty_slots else 0)
    return FP8_WGRAD_GEMM.launch(
        (dyT.data_ptr(), dys.data_ptr(), xT.data_ptr(), xs.data_ptr(), grad_local.data_ptr(),
         grad_slot.data_ptr(), cu.data_ptr(), G, epn, dys.shape[0], O, I), G, flags, config,
        dyT.device)


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------

_SCHEMA = ("(Tensor dyT, Tensor dyT_scale, Tensor xT, Tensor xT_scale, Tensor cu_seqlens, "
           "int epn) -> (Tensor, Tensor)")
_INTO_SCHEMA = ("(Tensor dyT, Tensor dyT_scale, Tensor xT, Tensor xT_scale, Tensor cu_seqlens, "
                "Tensor(a!) grad_local, Tensor(b!) grad_slot) -> ()")


@torch.library.custom_op("moonep::grouped_mm_fp8_wgrad", mutates_args=(), schema=_SCHEMA)
def _wgrad_op(dyT, dyT_scale, xT, xT_scale, cu_seqlens, epn):
    O, I, _ = _check("grouped_mm_fp8_wgrad", dyT, dyT_scale, xT, xT_scale, cu_seqlens, epn)
    gl = torch.empty(epn, O, I, dtype=OUT_DTYPE, device=dyT.device)
    gs = torch.empty(epn, O, I, dtype=OUT_DTYPE, device=dyT.device)
    if backend_for_fp8_wgrad(dyT) == "cutlass":
        _launch(dyT, dyT_scale, xT, xT_scale, cu_seqlens.contiguous(), gl, gs, False)
        return gl, gs
    return reference_fp8_wgrad(dyT, dyT_scale, xT, xT_scale, cu_seqlens, epn)


@_wgrad_op.register_fake
def _(dyT, dyT_scale, xT, xT_scale, cu_seqlens, epn):
    O, I, _ = _check("grouped_mm_fp8_wgrad", dyT, dyT_scale, xT, xT_scale, cu_seqlens, epn,
                     values=False)
    return (dyT.new_empty((epn, O, I), dtype=OUT_DTYPE),
            dyT.new_empty((epn, O, I), dtype=OUT_DTYPE))


def _check_into(dyT, dys, xT, xs, cu, grad_local, grad_slot, values=True):
    op = "grouped_mm_fp8_wgrad_into"
    epn = _epn_of(grad_local)
    if not isinstance(grad_local, Tensor) or grad_local.dim() != 3:
        raise FP8ArgumentError(f"{op}: grad_local must be a 3-D bf16 Tensor [epn, O, I]")
    O, I, _ = _check(op, dyT, dys, xT, xs, cu, epn, values)
    _check_grads(op, grad_local, grad_slot, epn, O, I, dyT.device)
    return O, I


@torch.library.custom_op("moonep::grouped_mm_fp8_wgrad_into",
                         mutates_args=("grad_local", "grad_slot"), schema=_INTO_SCHEMA)
def _wgrad_into_op(dyT, dyT_scale, xT, xT_scale, cu_seqlens, grad_local, grad_slot):
    _check_into(dyT, dyT_scale, xT, xT_scale, cu_seqlens, grad_local, grad_slot)
    check_no_overlap("grouped_mm_fp8_wgrad_into",
                     [("grad_local", grad_local), ("grad_slot", grad_slot)],
                     [("dyT", dyT), ("dyT_scale", dyT_scale), ("xT", xT),
                      ("xT_scale", xT_scale), ("cu_seqlens", cu_seqlens)])
    if backend_for_fp8_wgrad(dyT) == "cutlass":
        _launch(dyT, dyT_scale, xT, xT_scale, cu_seqlens.contiguous(), grad_local, grad_slot,
                True)
    else:
        _ref_into(dyT, dyT_scale, xT, xT_scale, cu_seqlens, grad_local, grad_slot)


@_wgrad_into_op.register_fake
def _(dyT, dyT_scale, xT, xT_scale, cu_seqlens, grad_local, grad_slot):
    _check_into(dyT, dyT_scale, xT, xT_scale, cu_seqlens, grad_local, grad_slot, values=False)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

def grouped_mm_fp8_wgrad(dyT: Tensor, dyT_scale: Tensor, xT: Tensor, xT_scale: Tensor,
                         cu_seqlens_G: Tensor, epn: int) -> tuple[Tensor, Tensor]:
    """(dW_local, dW_slot) bf16 [epn, O, I]: dW_g = dequant(dy)[rows g]^T @ dequant(x)[rows g]
    from the token-major operands of moonep::quantize_fp8_tokens; empty groups zero."""
    return torch.ops.moonep.grouped_mm_fp8_wgrad(dyT, dyT_scale, xT, xT_scale, cu_seqlens_G, epn)


def grouped_mm_fp8_wgrad_into(dyT: Tensor, dyT_scale: Tensor, xT: Tensor, xT_scale: Tensor,
                              cu_seqlens_G: Tensor, grad_local_BOI: Tensor,
                              grad_slot_BOI: Tensor) -> None:
    """Write-once bf16 weight grads: grad_local[g] = dW_g for every g < epn (zero when empty);
    grad_slot[b] = dW_{epn+b} when that group has rows, else left untouched."""
    torch.ops.moonep.grouped_mm_fp8_wgrad_into(dyT, dyT_scale, xT, xT_scale, cu_seqlens_G,
                                               grad_local_BOI, grad_slot_BOI)

