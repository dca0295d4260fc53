"""Triton kernels of moonep::quantize_fp8_rows / quantize_fp8_blocks on CUDA (imported only
there; the schemas, fakes and the reference are in quantize_fp8.py), and of the FP8 layer's
fused elementwise ops moonep::scale_rows / scale_rows_backward_fp8 / dequantize_fp8_rows (the
end of this file).

Why: the torch reference makes ~6 full passes over an fp32 copy of its input (cast, pad, abs,
amax, divide, clamp, cast).  At DeepSeek-V3 expert shapes a layer quantises 3 x [B, F, D] bf16
weights in its forward and again in its backward: ~6 ms a weight at HBM speed, ~35 ms of a
~20 ms bf16 step.  One kernel reads the input once and writes e4m3 + scales once.

Bit-identical with the reference (tests/test_fp8_quant_cuda.py): amax of |x| in fp32 (exact),
scale = max(amax / 448, 2^-126) and q = x / scale with IEEE round-to-nearest divisions
(``div_rn``; Triton's ``/`` on fp32 is the approximate one), clamp to +-448, then
round-to-nearest-even to e4m3 (what torch's cast does).  pow2: the scale rounded UP to a power
of two by its bits (a zero mantissa stays, else the exponent goes up by one), as frexp / ldexp
do for the normal fp32 scales the floor guarantees.  A tile holding a NaN or an Inf: the scale
NaN 0x7FC00000 and every element the e4m3 NaN 0x7F, written by their bits as the reference
writes them (Triton's max reduction drops NaN, so the kernels reduce |x| with NaN and Inf
mapped to +Inf); q is stored through a uint8 view for that.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch import Tensor

TILE = 128          # quantize_fp8.TILE; the kernels' literals 448.0 and 2^-126 are its FP8_MAX
                    # and SCALE_FLOOR (a jit function cannot read module globals)
_BM = 16            # rows a program of the row-tile kernels


@triton.jit
def _abs_or_inf(x):
    # |x|, with NaN and +-Inf as +Inf.  tl.max is a maxnum reduction: it drops NaN (a tile
    # holding one got a finite scale and finite elements).  With this, a tile's max is +Inf
    # exactly when the tile holds a non-finite element, as torch's NaN-propagating amax is
    # non-finite; the finite tiles' max is unchanged.
    a = tl.abs(x)
    return tl.where(a <= 3.4028234663852886e38, a, float("inf"))      # NaN <= FLT_MAX is false


@triton.jit
def _scale(amax, POW2: tl.constexpr):
    # amax from _abs_or_inf; returns (scale, bad): bad tiles (amax = +Inf) get the NaN scale
    # 0x7FC00000 by its bits (quantize_fp8.NONFINITE_SCALE_BITS)
    s = tl.maximum(tl.math.div_rn(amax, 448.0), 1.1754943508222875e-38)   # 2^-126
    bits = s.to(tl.int32, bitcast=True)
    if POW2:
        mant = bits & 0x7FFFFF
        expo = bits & 0x7F800000
        bits = tl.where(mant == 0, expo, expo + 0x800000)
    bad = amax > 3.4028234663852886e38
    s = tl.where(bad, 0x7FC00000, bits).to(tl.float32, bitcast=True)
    return s, bad


@triton.jit
def _quant(x, s, bad):
    # e4m3 bytes (uint8) of clamp(x / s, +-448); a bad tile's elements are the e4m3 NaN 0x7F
    # (quantize_fp8.NONFINITE_Q_BITS), by their bits as in the reference
    q = tl.math.div_rn(x, s)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return tl.where(bad, 0x7F, q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)).to(tl.uint8)


@triton.jit
def _row_block(M, I, BM: tl.constexpr):
    # this program's BM rows (program 0) x one 128-column tile pc (program 1) of an [M, I]
    # tensor: (pc, rows, rows_ok, offs, mask)
    pc = tl.program_id(1)
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = pc * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < M) & (cols[None, :] < I)
    offs = rows[:, None].to(tl.int64) * I + cols[None, :]
    return pc, rows, rows < M, offs, mask


@triton.jit
def _store_rows(q_ptr, s_ptr, x, offs, mask, rows, rows_ok, pc, C, POW2: tl.constexpr):
    # the 1 x 128 tiles of fp32 rows x (its masked lanes are 0 and move no amax): the e4m3
    # bytes at offs and one scale a row at [rows, pc] of the [M, C] scales
    s, bad = _scale(tl.max(_abs_or_inf(x), axis=1), POW2)
    tl.store(q_ptr + offs, _quant(x, s[:, None], bad[:, None]), mask=mask)
    tl.store(s_ptr + rows.to(tl.int64) * C + pc, s, mask=rows_ok)


@triton.jit
def _rows_kernel(x_ptr, q_ptr, s_ptr, M, I, C, BM: tl.constexpr, POW2: tl.constexpr):
    pc, rows, rows_ok, offs, mask = _row_block(M, I, BM)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _store_rows(q_ptr, s_ptr, x, offs, mask, rows, rows_ok, pc, C, POW2)


@triton.jit
def _blocks_kernel(w_ptr, q_ptr, s_ptr, O, I, o, i, POW2: tl.constexpr, TRANS: tl.constexpr):
    # one program: block (bo, bi) of one [O, I] matrix, scales [o, i]; TRANS: q is [I, O],
    # scale [i, o] and the tile is stored transposed (tl.trans: a register / shared-memory
    # shuffle, no second pass over memory)
    n = tl.program_id(0)
    bo = tl.program_id(1)
    bi = tl.program_id(2)
    r = bo * 128 + tl.arange(0, 128)
    c = bi * 128 + tl.arange(0, 128)
    mask = (r[:, None] < O) & (c[None, :] < I)
    base = n.to(tl.int64) * O * I
    offs = base + r[:, None].to(tl.int64) * I + c[None, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s, bad = _scale(tl.max(tl.max(_abs_or_inf(w), axis=1), axis=0), POW2)
    q = _quant(w, s, bad)
    if TRANS:
        offs_t = base + c[:, None].to(tl.int64) * O + r[None, :]
        mask_t = (c[:, None] < I) & (r[None, :] < O)
        tl.store(q_ptr + offs_t, tl.trans(q), mask=mask_t)
        tl.store(s_ptr + (n.to(tl.int64) * i + bi) * o + bo, s)
    else:
        tl.store(q_ptr + offs, q, mask=mask)
        tl.store(s_ptr + (n.to(tl.int64) * o + bo) * i + bi, s)


def quantize_rows(x_MI: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    x = x_MI.contiguous()
    M, I = x.shape
    C = triton.cdiv(I, TILE)
    q = torch.empty(M, I, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, C, dtype=torch.float32, device=x.device)
    if M and I:
        _rows_kernel[(triton.cdiv(M, _BM), C)](x, q.view(torch.uint8), s, M, I, C, BM=_BM,
                                               POW2=pow2, num_warps=4)
    return q, s


def quantize_blocks(w: Tensor, pow2: bool, transpose: bool = False, out=None
                    ) -> tuple[Tensor, Tensor]:
    """(q, scale [..., o, i]) of w [..., O, I]; transpose: of w^T, q [..., I, O] and scale
    [..., i, o].
    ``out``: (q, scale) to write into (contiguous, of those shapes and dtypes; the FP8 weight
    cache's buffers, refreshed in place so that a captured graph keeps reading them)."""
    w = w.contiguous()
    *lead, O, I = w.shape
    n = 1
    for d in lead:
        n *= d
    o, i = triton.cdiv(O, TILE), triton.cdiv(I, TILE)
    qshape, sshape = ((*lead, I, O), (*lead, i, o)) if transpose else ((*lead, O, I), (*lead, o, i))
    if out is None:
        q = torch.empty(qshape, dtype=torch.float8_e4m3fn, device=w.device)
        s = torch.empty(sshape, dtype=torch.float32, device=w.device)
    else:
        q, s = out
        assert (tuple(q.shape), q.dtype, tuple(s.shape), s.dtype) == (
            qshape, torch.float8_e4m3fn, sshape, torch.float32) and q.is_contiguous() \
            and s.is_contiguous(), "quantize_blocks: out must be (q, scale) of the result's layout"
    if n and O and I:
        # 16 warps: 1.12-1.24x the 8-warp kernel (2.9-3.0 TB/s vs 2.4-2.7) on DeepSeek-V3's
        # [32, 2048, 7168] / [32, 7168, 2048] and on held-out Qwen3-235B shapes, both layouts;
        # 4 warps and multi-block programs (2-8 blocks, pipelined) were slower
        # (diagnostics/quant_blocks_sweep.py, H200, 2026-12-02)
        _blocks_kernel[(n, o, i)](w, q.view(torch.uint8), s, O, I, o, i, POW2=pow2,
                                  TRANS=transpose, num_warps=16)
    return q, s


# --------------------------------------------------------------------------------------------
# The FP8 layer's fused elementwise passes (moe_experts_fp8.py; schemas, fakes and references
# in quantize_fp8.py).  Each is one read of its inputs and one write of its outputs, bitwise
# the torch formulation it replaces: an fp32 product is one IEEE multiply (no add follows it,
# so nothing can be contracted into an FMA), e4m3 -> fp32 is exact, and fp32 -> bf16 is the
# round-to-nearest-even conversion torch's cast does.
# --------------------------------------------------------------------------------------------

@triton.jit
def _scale_rows_kernel(x_ptr, w_ptr, z_ptr, M, I, BM: tl.constexpr):
    # z = bf16(fp32(x) * w[:, None])
    _, rows, rows_ok, offs, mask = _row_block(M, I, BM)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + rows, mask=rows_ok, other=0.0)
    tl.store(z_ptr + offs, (x * w[:, None]).to(tl.bfloat16), mask=mask)


@triton.jit
def _scale_rows_bwd_kernel(dz_ptr, w_ptr, y_ptr, dy_ptr, q_ptr, s_ptr, p_ptr, M, I, C,
                           BM: tl.constexpr, POW2: tl.constexpr, QUANT: tl.constexpr):
    # dy = bf16(fp32(dz) * w), (q, s) = the 1 x 128 tiles of dy (QUANT: the FP8 layer's; the
    # bf16 layer's backward writes none), p [M, C] = the sum over each tile of fp32(dz) *
    # fp32(y) (d_rows = p.sum(-1): an fp32 [M, C] partial instead of the [M, I] products,
    # 128x fewer bytes)
    pc, rows, rows_ok, offs, mask = _row_block(M, I, BM)
    dz = tl.load(dz_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + rows, mask=rows_ok, other=0.0)
    dy = (dz * w[:, None]).to(tl.bfloat16)
    tl.store(dy_ptr + offs, dy, mask=mask)
    if QUANT:
        dyf = dy.to(tl.float32)
        _store_rows(q_ptr, s_ptr, dyf, offs, mask, rows, rows_ok, pc, C, POW2)
    tl.store(p_ptr + rows.to(tl.int64) * C + pc, tl.sum(dz * y, axis=1), mask=rows_ok)


@triton.jit
def _dequant_rows_kernel(q_ptr, s_ptr, h_ptr, M, I, C, BM: tl.constexpr):
    # h = bf16(fp32(q) * scale of its 1 x 128 tile)
    pc, rows, rows_ok, offs, mask = _row_block(M, I, BM)
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + rows.to(tl.int64) * C + pc, mask=rows_ok, other=0.0)
    tl.store(h_ptr + offs, (q * s[:, None]).to(tl.bfloat16), mask=mask)


def scale_rows(x_MI: Tensor, w_M: Tensor) -> Tensor:
    x, w = x_MI.contiguous(), w_M.contiguous()
    M, I = x.shape
    z = torch.empty(M, I, dtype=torch.bfloat16, device=x.device)
    if M and I:
        _scale_rows_kernel[(triton.cdiv(M, _BM), triton.cdiv(I, TILE))](x, w, z, M, I, BM=_BM,
                                                                        num_warps=4)
    return z


def scale_rows_backward(dz_MI: Tensor, w_M: Tensor, y_MI: Tensor, pow2: bool,
                        quantize: bool = True) -> tuple:
    """(dy, q, s, d_rows), or (dy, d_rows) without ``quantize`` (the bf16 layer's)."""
    dz, w, y = dz_MI.contiguous(), w_M.contiguous(), y_MI.contiguous()
    M, I = dz.shape
    C = triton.cdiv(I, TILE)
    dy = torch.empty(M, I, dtype=torch.bfloat16, device=dz.device)
    q = torch.empty(M if quantize else 0, I, dtype=torch.float8_e4m3fn, device=dz.device)
    s = torch.empty(M if quantize else 0, C, dtype=torch.float32, device=dz.device)
    p = torch.empty(M, C, dtype=torch.float32, device=dz.device)
    if M and I:
        _scale_rows_bwd_kernel[(triton.cdiv(M, _BM), C)](dz, w, y, dy, q.view(torch.uint8), s, p,
                                                         M, I, C, BM=_BM, POW2=pow2,
                                                         QUANT=quantize, num_warps=4)
    return (dy, q, s, p.sum(-1)) if quantize else (dy, p.sum(-1))


def dequantize_rows_bf16(q_MI: Tensor, scale_MC: Tensor) -> Tensor:
    q, sc = q_MI.contiguous(), scale_MC.contiguous()
    M, I = q.shape
    C = triton.cdiv(I, TILE)
    h = torch.empty(M, I, dtype=torch.bfloat16, device=q.device)
    if M and I:
        _dequant_rows_kernel[(triton.cdiv(M, _BM), C)](q, sc, h, M, I, C, BM=_BM, num_warps=4)
    return h
