"""Token-major FP8 quantisation: the operands of the FP8 weight gradient (DeepSeek-V3's 1 x 128
tiles along the TOKENS of each expert group), with their CPU reference.

The wgrad ``dW_g = dy[rows g]^T x[rows g]`` reduces over each group's tokens, and the sm90 FP8
MMA takes K-major operands only, so its operands are token-contiguous e4m3 copies ("transposed")
with one fp32 scale per 128 consecutive tokens of one group and one feature:

  x_MI [M, I], cu_seqlens_G  ->  qT [I, 128 * Nb] e4m3,  sT [Nb, I] fp32,   Nb = M // 128 + G

Group g owns the rows [s_g, e_g) of the receive buffer (s_g = cu[g-1], s_0 = 0, e_g = cu[g];
inclusive END offsets, as every grouped op) and the token tiles
    t0_g = s_g // 128 + g  ..  t0_g + ceil((e_g - s_g) / 128) - 1:
tile t0_g + b covers the rows s_g + 128 b .. min(s_g + 128 b + 128, e_g), stored as the columns
128 (t0_g + b) .. + 127 of qT (row i of qT = feature i), its scales as row t0_g + b of sT.  So a
tile never crosses a group boundary whatever the buffer's token_padding (with token_padding 128
the groups start 128-aligned; with 1 they start anywhere), and the closed form lets the quantiser
and the GEMM (cutlass_kernels/kernel_fp8_wgrad.cu) find a group's tiles from cu_seqlens alone.
Distinct groups' tiles never overlap: floor(s/128) + g + ceil(m/128) <= floor((s+m)/128) + g + 1,
and the last one ends by floor(M/128) + G = Nb.  Each group can waste one partial tile, so Nb has
G more tiles than M needs; the columns of unused tiles are never read.

A tile's scale and elements follow quantize_fp8.py exactly (scale = max(amax / 448, 2^-126),
optionally rounded up to a power of two; q = e4m3(clamp(x / scale, +-448)), IEEE divisions), now
per (token tile, feature): amax runs over the <= 128 tokens of the tile.  A tile holding a NaN or
an Inf gets the scale NaN (bits 0x7FC00000) and its elements the e4m3 NaN 0x7F, by their bits,
so a non-finite token poisons its own tile's features only (the dW rows and columns it
touches), as in quantize_fp8.py.  The columns of a partial tile past the group's last row are
0 (the GEMM never reads them: TMA fills past the group's K with zeros).  Unused tiles (between
groups, or past the last one): the reference writes q = 0 and scale 0; the CUDA kernels leave
them unwritten (nothing reads them).

Ops (schema, fake, CPU reference, opcheck'ed in tests/test_fp8_wgrad.py; on CUDA one Triton
kernel each, quantize_fp8_tokens_triton.py, bit-identical with the reference on the tiles that
are written):
  quantize_fp8_tokens(x [M, I], cu_seqlens [G], x_scale=None, pow2_scales=False)
      -> (qT [I, 128 Nb] e4m3, sT [Nb, I] fp32)
      x floating (bf16, fp16, fp32, fp64), or e4m3 with its 1 x 128 row scales x_scale
      [M, ceil(I/128)] (the dispatched rows h): the values are dequantised to fp32 first
      (q * s, one rounded fp32 product) and quantised from there, never via bf16.
  quantize_fp8_rows_tokens(x [M, I], cu_seqlens, pow2_scales=False)
      -> (q [M, I] e4m3, s [M, ceil(I/128)], qT, sT): quantize_fp8_rows(x) and
      quantize_fp8_tokens(x) from ONE read of x (dg, du of the FP8 backward: the dgrad takes
      the row tiles, the wgrad the token tiles).
  scale_rows_backward_fp8_tokens(dz [M, I] bf16, row_weights [M] fp32, y [M, I] bf16,
                                 cu_seqlens, pow2_scales=False)
      -> (q, s, qT, sT, d_rows): scale_rows_backward_fp8 without the bf16 dy: dy =
      bf16(fp32(dz) * w) quantised both ways (the dgrad's rows and the wgrad's tokens, from the
      same bf16 dy) and d_rows = sum_I fp32(dz) * fp32(y), from one read of dz and y.
  For the two fused ops the rows at or past cu_seqlens[-1] (no group's) are not part of the
  result on CUDA (q, s and d_rows there: unspecified; d_rows 0): the kernels walk the groups'
  tiles, and every consumer (the grouped GEMMs, combine) reads the groups' rows only.  The
  reference computes them.
Helpers: ``token_tiles(M, G)`` (Nb), ``group_tiles(cu, M)`` (host: [(g, s, e, t0)]),
``dequantize_group(qT, sT, t0, m)`` (fp32 [m, I]: one group's rows) and
``dequantize_tokens(qT, sT, cu, M)`` (fp32 [M, I] in the row layout; rows of no group 0).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import quantize_fp8 as qf
from .quantize_fp8 import FP8_DTYPE, TILE, FP8ArgumentError

BF16 = torch.bfloat16

__all__ = ["token_tiles", "group_tiles", "quantize_tokens", "quantize_rows_tokens",
           "scale_rows_backward_tokens", "dequantize_group", "dequantize_tokens", "quantize_fp8_tokens",
           "quantize_fp8_rows_tokens", "scale_rows_backward_fp8_tokens"]


def token_tiles(M, G) -> int:
    """Nb = M // 128 + G: the token tiles of a buffer of M rows in G groups (works on SymInts)."""
    return M // TILE + G


# --------------------------------------------------------------------------------------------
# Argument checks (shape / dtype / device only: the fakes run them too)
# --------------------------------------------------------------------------------------------

def _check_cu(op: str, cu, M: int, device, values: bool) -> int:
    if not isinstance(cu, Tensor):
        raise FP8ArgumentError(f"{op}: cu_seqlens must be a Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise FP8ArgumentError(f"{op}: cu_seqlens must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{op}: cu_seqlens must be 1-D [G >= 1], got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{op}: cu_seqlens is on {cu.device}, the data on {device}")
    if not cu.is_contiguous():
        raise ValueError(f"{op}: cu_seqlens must be contiguous")
    if values and cu.device.type == "cpu":
        c = cu.tolist()
        if c[0] < 0 or any(b < a for a, b in zip(c, c[1:])) or c[-1] > M:
            raise ValueError(f"{op}: cu_seqlens must be non-decreasing inclusive end offsets in "
                             f"[0, M={M}], got {c}")
    return cu.shape[0]


def _check_tokens_args(x, cu, x_scale, pow2, values=True) -> tuple[int, int, int]:
    op = "quantize_fp8_tokens"
    qf._check_bool(op, pow2)
    if x_scale is None:
        qf._check_float(op, "x", x, 2, 2)
        M, I = x.shape
    else:
        M, I = qf.check_rows_fp8(op, "x", x, x_scale)
    G = _check_cu(op, cu, M, x.device, values)
    return M, I, G


def _check_rows_tokens_args(x, cu, pow2, values=True) -> tuple[int, int, int]:
    op = "quantize_fp8_rows_tokens"
    qf._check_float(op, "x", x, 2, 2)
    qf._check_bool(op, pow2)
    M, I = x.shape
    return M, I, _check_cu(op, cu, M, x.device, values)


def _check_srb_args(dz, w, y, cu, pow2, values=True) -> tuple[int, int, int]:
    op = "scale_rows_backward_fp8_tokens"
    M, I = qf._check_rows_bf16(op, w, dz=dz, y=y)
    qf._check_bool(op, pow2)
    return M, I, _check_cu(op, cu, M, dz.device, values)


# --------------------------------------------------------------------------------------------
# Reference (any device; reads cu_seqlens on the host)
# --------------------------------------------------------------------------------------------

def group_tiles(cu: Tensor, M: int) -> list[tuple[int, int, int, int]]:
    """[(g, s_g, e_g, t0_g)] of every group (host read of cu_seqlens), offsets clamped to [0, M]
    as the kernels clamp them."""
    out, start = [], 0
    for g, end in enumerate(cu.tolist()):
        s = min(max(start, 0), M)
        e = min(max(end, s), M)
        out.append((g, s, e, s // TILE + g))
        start = end
    return out


def _tokens_from_fp32(xf: Tensor, cu: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    """qT, sT of an fp32 [M, I] tensor (see the module docstring)."""
    M, I = xf.shape
    G = cu.shape[0]
    Nb = token_tiles(M, G)
    qT = torch.zeros(I, Nb * TILE, dtype=FP8_DTYPE, device=xf.device)
    sT = torch.zeros(Nb, I, dtype=torch.float32, device=xf.device)
    for g, s, e, t0 in group_tiles(cu, M):
        m = e - s
        if m <= 0:
            continue
        nb = -(-m // TILE)
        blk = torch.zeros(nb * TILE, I, dtype=torch.float32, device=xf.device)
        blk[:m] = xf[s:e]
        blk = blk.view(nb, TILE, I)
        scale, bad = qf._scale_of(blk.abs().amax(1), pow2)               # [nb, I]
        q = qf._cast(blk / scale[:, None, :], bad[:, None, :])            # [nb, 128, I]
        # the columns past the group's last row are 0, also in a non-finite tile
        q = q.view(torch.uint8).view(nb * TILE, I)
        q[m:] = 0
        qT[:, t0 * TILE:(t0 + nb) * TILE] = q.view(FP8_DTYPE).t()
        sT[t0:t0 + nb] = scale
    return qT, sT


def quantize_tokens(x: Tensor, cu_seqlens: Tensor, x_scale: Tensor | None = None,
                    pow2_scales: bool = False) -> tuple[Tensor, Tensor]:
    """Reference of moonep::quantize_fp8_tokens (see the module docstring)."""
    _check_tokens_args(x, cu_seqlens, x_scale, pow2_scales)
    xf = qf.dequantize_rows(x, x_scale) if x_scale is not None else x.to(torch.float32)
    return _tokens_from_fp32(xf, cu_seqlens, pow2_scales)


def quantize_rows_tokens(x: Tensor, cu_seqlens: Tensor, pow2_scales: bool = False
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Reference of moonep::quantize_fp8_rows_tokens: quantize_rows(x) and quantize_tokens(x)."""
    _check_rows_tokens_args(x, cu_seqlens, pow2_scales)
    xf = x.to(torch.float32)
    q, s = qf.quantize_rows_from_fp32(xf, pow2_scales)
    return (q, s, *_tokens_from_fp32(xf, cu_seqlens, pow2_scales))


def scale_rows_backward_tokens(dz: Tensor, row_weights: Tensor, y: Tensor, cu_seqlens: Tensor,
                               pow2_scales: bool = False
                               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Reference of moonep::scale_rows_backward_fp8_tokens: scale_rows_backward's (q, s, d_rows)
    and the token tiles of the same bf16 dy."""
    _check_srb_args(dz, row_weights, y, cu_seqlens, pow2_scales)
    dy, q, s, d_rows = qf.scale_rows_backward(dz, row_weights, y, pow2_scales)
    qT, sT = _tokens_from_fp32(dy.to(torch.float32), cu_seqlens, pow2_scales)
    return q, s, qT, sT, d_rows


def dequantize_group(qT: Tensor, sT: Tensor, t0: int, m: int) -> Tensor:
    """fp32 [m, I] contiguous, in the row layout: the m token rows of the group whose tiles
    start at t0, every element times its tile's scale (one rounded product each)."""
    nb = -(-m // TILE)
    scale = sT[t0:t0 + nb].repeat_interleave(TILE, dim=0)[:m]            # [m, I]
    return (qT[:, t0 * TILE:t0 * TILE + m].to(torch.float32).t() * scale).contiguous()


def dequantize_tokens(qT: Tensor, sT: Tensor, cu_seqlens: Tensor, M: int) -> Tensor:
    """fp32 [M, I] in the row layout: every group's rows (dequantize_group); rows of no group
    0."""
    out = torch.zeros(M, qT.shape[0], dtype=torch.float32, device=qT.device)
    for g, s, e, t0 in group_tiles(cu_seqlens, M):
        if e > s:
            out[s:e] = dequantize_group(qT, sT, t0, e - s)
    return out


# --------------------------------------------------------------------------------------------
# Implementations (Triton on CUDA, the reference elsewhere; MOONEP_FP8_QUANT=reference forces it)
# --------------------------------------------------------------------------------------------

def _kernels(t: Tensor):
    if qf._kernels(t) is None:          # not CUDA, no Triton, or MOONEP_FP8_QUANT=reference
        return None
    from . import quantize_fp8_tokens_triton
    return quantize_fp8_tokens_triton


def _tokens_impl(x, cu, x_scale=None, pow2=False):
    _check_tokens_args(x, cu, x_scale, pow2)
    k = _kernels(x)
    if k is None:
        xf = qf.dequantize_rows(x, x_scale) if x_scale is not None else x.to(torch.float32)
        return _tokens_from_fp32(xf, cu, pow2)
    return k.quantize_tokens(x, cu, x_scale, pow2)


def _rows_tokens_impl(x, cu, pow2=False):
    _check_rows_tokens_args(x, cu, pow2)
    k = _kernels(x)
    if k is None:
        return quantize_rows_tokens(x, cu, pow2)
    return k.quantize_rows_tokens(x, cu, pow2)


def _srb_impl(dz, w, y, cu, pow2=False):
    _check_srb_args(dz, w, y, cu, pow2)
    k = _kernels(dz)
    if k is None:
        return scale_rows_backward_tokens(dz, w, y, cu, pow2)
    return k.scale_rows_backward_tokens(dz, w, y, cu, pow2)


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------

def _fake_tokens(x, I, G):
    M = x.shape[0]
    Nb = token_tiles(M, G)
    return (x.new_empty((I, Nb * TILE), dtype=FP8_DTYPE),
            x.new_empty((Nb, I), dtype=torch.float32))


_quantize_tokens_op = torch.library.custom_op(
    "moonep::quantize_fp8_tokens", _tokens_impl, mutates_args=(),
    schema="(Tensor x, Tensor cu_seqlens, Tensor? x_scale=None, bool pow2_scales=False)"
           " -> (Tensor, Tensor)")


@_quantize_tokens_op.register_fake
def _(x, cu_seqlens, x_scale=None, pow2_scales=False):
    _, I, G = _check_tokens_args(x, cu_seqlens, x_scale, pow2_scales, values=False)
    return _fake_tokens(x, I, G)


_quantize_rows_tokens_op = torch.library.custom_op(
    "moonep::quantize_fp8_rows_tokens", _rows_tokens_impl, mutates_args=(),
    schema="(Tensor x, Tensor cu_seqlens, bool pow2_scales=False)"
           " -> (Tensor, Tensor, Tensor, Tensor)")


@_quantize_rows_tokens_op.register_fake
def _(x, cu_seqlens, pow2_scales=False):
    M, I, G = _check_rows_tokens_args(x, cu_seqlens, pow2_scales, values=False)
    return (*qf.fake_rows_fp8(x, M, I), *_fake_tokens(x, I, G))


_srb_tokens_op = torch.library.custom_op(
    "moonep::scale_rows_backward_fp8_tokens", _srb_impl, mutates_args=(),
    schema="(Tensor dz, Tensor row_weights, Tensor y, Tensor cu_seqlens, "
           "bool pow2_scales=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")


@_srb_tokens_op.register_fake
def _(dz, row_weights, y, cu_seqlens, pow2_scales=False):
    M, I, G = _check_srb_args(dz, row_weights, y, cu_seqlens, pow2_scales, values=False)
    return (*qf.fake_rows_fp8(dz, M, I), *_fake_tokens(dz, I, G),
            dz.new_empty((M,), dtype=torch.float32))


# Public API (the ops; they trace under torch.compile).

def quantize_fp8_tokens(x_MI: Tensor, cu_seqlens_G: Tensor, *, x_scale: Tensor | None = None,
                        pow2_scales: bool = False) -> tuple[Tensor, Tensor]:
    """(qT [I, 128 Nb] e4m3, sT [Nb, I] fp32): x's 1 x 128 tiles along each group's tokens."""
    return torch.ops.moonep.quantize_fp8_tokens(x_MI, cu_seqlens_G, x_scale, pow2_scales)


def quantize_fp8_rows_tokens(x_MI: Tensor, cu_seqlens_G: Tensor, *, pow2_scales: bool = False
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, s, qT, sT): x's row tiles (quantize_fp8_rows) and token tiles, one read of x."""
    return torch.ops.moonep.quantize_fp8_rows_tokens(x_MI, cu_seqlens_G, pow2_scales)


def scale_rows_backward_fp8_tokens(dz_MI: Tensor, row_weights_M: Tensor, y_MI: Tensor,
                                   cu_seqlens_G: Tensor, *, pow2_scales: bool = False
                                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(q, s, qT, sT, d_rows) of dy = bf16(fp32(dz) * w), d_rows = sum_I fp32(dz) * fp32(y)."""
    return torch.ops.moonep.scale_rows_backward_fp8_tokens(dz_MI, row_weights_M, y_MI,
                                                           cu_seqlens_G, pow2_scales)
