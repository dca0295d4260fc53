"""Triton kernels of moonep::quantize_fp8_tokens / quantize_fp8_rows_tokens /
scale_rows_backward_fp8_tokens on CUDA (imported only there; schemas, fakes and the reference
are in quantize_fp8_tokens.py).

One program = one token tile t (128 rows of one group, found from cu_seqlens on the device) x
one 128-feature column tile: it loads the 128 x 128 block once, reduces |x| over the tile's
tokens for the token scales (and over its features for the row scales of the fused ops), and
stores the e4m3 block transposed (tl.trans: a register / shared-memory shuffle) into the
token-major qT, coalesced along the tokens.  Bit-identical with the reference on every tile it
writes: the same scale / quotient / cast helpers as quantize_fp8_triton.py (IEEE divisions,
non-finite tiles NaN by their bits: Triton's max reduction drops NaN, so |x| is reduced with NaN
and Inf mapped to +Inf).  Tiles of no group are not written (nothing reads them).

Finding the group of tile t: t0_g = floor(s_g / 128) + g is strictly increasing in g for
non-decreasing offsets, so g is the largest index with t0_g <= t: a binary search over cu_seqlens
of ceil(log2 G) + 1 scalar loads per program (G <= 1024: 11).  The offsets are clamped to
[0, M] as the GEMM's prep kernel clamps them, so bad offsets never make a program read or write
out of bounds (they give wrong tiles, not faults).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .quantize_fp8_triton import _abs_or_inf, _quant, _scale, _store_rows

TILE = 128


@triton.jit
def _start(cu_ptr, g, M):
    # s_g = clamp(cu[g-1], 0, M), s_0 = 0
    prev = tl.load(cu_ptr + tl.maximum(g - 1, 0))
    return tl.where(g > 0, tl.minimum(tl.maximum(prev, 0), M), 0)


@triton.jit
def _tile(cu_ptr, t, G, M, STEPS: tl.constexpr):
    """(first row, valid rows) of token tile t; rows <= 0: a tile of no group."""
    lo = t * 0
    hi = lo + G - 1
    for _ in tl.static_range(STEPS):
        mid = (lo + hi + 1) // 2
        ok = _start(cu_ptr, mid, M) // 128 + mid <= t
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    s = _start(cu_ptr, lo, M)
    e = tl.minimum(tl.maximum(tl.load(cu_ptr + lo), s), M)
    r0 = s + (t - (s // 128 + lo)) * 128
    return r0, tl.minimum(e - r0, 128)


@triton.jit
def _block(cu_ptr, M, I, G, STEPS: tl.constexpr):
    """This program's 128 x 128 block: token tile t (program 0) x feature tile pc (program 1).
    (t, pc, valid rows (<= 0: a tile of no group), rows, rows_ok, cols, offs, mask)."""
    t = tl.program_id(0)
    pc = tl.program_id(1)
    r0, nrows = _tile(cu_ptr, t, G, M, STEPS)
    r = tl.arange(0, 128)
    cols = pc * 128 + tl.arange(0, 128)
    rows_ok = r < nrows
    rows = r0 + r
    mask = rows_ok[:, None] & (cols[None, :] < I)
    offs = rows[:, None].to(tl.int64) * I + cols[None, :]
    return t, pc, nrows, rows, rows_ok, cols, offs, mask


@triton.jit
def _store_tokens(qT_ptr, sT_ptr, xf, t, rows_ok, cols, I, Mp, POW2: tl.constexpr):
    # token scales: one per feature over the tile's valid tokens (the masked rows are 0 and move
    # no amax); q stored transposed, the columns past the group's last row 0
    s, bad = _scale(tl.max(_abs_or_inf(xf), axis=0), POW2)                     # [128]
    q = _quant(xf, s[None, :], bad[None, :])
    q = tl.where(rows_ok[:, None], q, 0).to(tl.uint8)
    r = tl.arange(0, 128)
    offs_t = cols[:, None].to(tl.int64) * Mp + t.to(tl.int64) * 128 + r[None, :]
    tl.store(qT_ptr + offs_t, tl.trans(q), mask=(cols[:, None] < I))
    tl.store(sT_ptr + t.to(tl.int64) * I + cols, s, mask=cols < I)


@triton.jit
def _tokens_kernel(x_ptr, xs_ptr, cu_ptr, qT_ptr, sT_ptr, M, I, C, G, Mp,
                   HAS_SCALE: tl.constexpr, POW2: tl.constexpr, STEPS: tl.constexpr):
    t, pc, nrows, rows, rows_ok, cols, offs, mask = _block(cu_ptr, M, I, G, STEPS)
    if nrows > 0:
        if HAS_SCALE:
            # e4m3 rows with their 1 x 128 scales: q * s in fp32, one rounded product
            q = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            sc = tl.load(xs_ptr + rows.to(tl.int64) * C + pc, mask=rows_ok, other=0.0)
            xf = q * sc[:, None]
            xf = tl.where(mask, xf, 0.0)
        else:
            xf = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        _store_tokens(qT_ptr, sT_ptr, xf, t, rows_ok, cols, I, Mp, POW2)


@triton.jit
def _rows_tokens_kernel(x_ptr, cu_ptr, q_ptr, s_ptr, qT_ptr, sT_ptr, M, I, C, G, Mp,
                        POW2: tl.constexpr, STEPS: tl.constexpr):
    t, pc, nrows, rows, rows_ok, cols, offs, mask = _block(cu_ptr, M, I, G, STEPS)
    if nrows > 0:
        xf = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # the row tiles (quantize_fp8_rows)
        _store_rows(q_ptr, s_ptr, xf, offs, mask, rows, rows_ok, pc, C, POW2)
        _store_tokens(qT_ptr, sT_ptr, xf, t, rows_ok, cols, I, Mp, POW2)


@triton.jit
def _srb_tokens_kernel(dz_ptr, w_ptr, y_ptr, cu_ptr, q_ptr, s_ptr, qT_ptr, sT_ptr, p_ptr,
                       M, I, C, G, Mp, POW2: tl.constexpr, STEPS: tl.constexpr):
    t, pc, nrows, rows, rows_ok, cols, offs, mask = _block(cu_ptr, M, I, G, STEPS)
    if nrows > 0:
        dz = tl.load(dz_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows, mask=rows_ok, other=0.0)
        # dy = bf16(fp32(dz) * w): one IEEE product, then RNE to bf16 (quantize_fp8_triton's
        # scale_rows_backward, which is bitwise the torch formulation)
        dyf = (dz * w[:, None]).to(tl.bfloat16).to(tl.float32)
        _store_rows(q_ptr, s_ptr, dyf, offs, mask, rows, rows_ok, pc, C, POW2)
        tl.store(p_ptr + rows.to(tl.int64) * C + pc, tl.sum(dz * y, axis=1), mask=rows_ok)
        _store_tokens(qT_ptr, sT_ptr, dyf, t, rows_ok, cols, I, Mp, POW2)


def _steps(G: int) -> int:
    return max(1, (G - 1).bit_length()) + 1


def _outputs(x: Tensor, G: int, rows: bool = False) -> tuple:
    """(C, Nb, qT, sT) of x [M, I] quantised into the token tiles of G groups; ``rows``: then
    its row tiles' q [M, I] and s [M, C] too."""
    M, I = x.shape
    C, Nb = triton.cdiv(I, TILE), M // TILE + G
    out = (C, Nb, torch.empty(I, Nb * TILE, dtype=torch.float8_e4m3fn, device=x.device),
           torch.empty(Nb, I, dtype=torch.float32, device=x.device))
    if rows:
        out += (torch.empty(M, I, dtype=torch.float8_e4m3fn, device=x.device),
                torch.empty(M, C, dtype=torch.float32, device=x.device))
    return out


# 8 warps for a 128 x 128 block (64 values a thread, the transposed store through shared memory)
_WARPS = 8


def quantize_tokens(x: Tensor, cu: Tensor, x_scale, pow2: bool) -> tuple[Tensor, Tensor]:
    x, cu = x.contiguous(), cu.contiguous()
    (M, I), G = x.shape, cu.shape[0]
    C, Nb, qT, sT = _outputs(x, G)
    if M and I:
        xs = x_scale.contiguous() if x_scale is not None else sT     # unused without a scale
        _tokens_kernel[(Nb, C)](x, xs, cu, qT.view(torch.uint8), sT, M, I, C, G, Nb * TILE,
                                HAS_SCALE=x_scale is not None, POW2=pow2, STEPS=_steps(G),
                                num_warps=_WARPS)
    return qT, sT


def quantize_rows_tokens(x: Tensor, cu: Tensor, pow2: bool):
    x, cu = x.contiguous(), cu.contiguous()
    (M, I), G = x.shape, cu.shape[0]
    C, Nb, qT, sT, q, s = _outputs(x, G, rows=True)
    if M and I:
        _rows_tokens_kernel[(Nb, C)](x, cu, q.view(torch.uint8), s, qT.view(torch.uint8), sT,
                                     M, I, C, G, Nb * TILE, POW2=pow2, STEPS=_steps(G),
                                     num_warps=_WARPS)
    return q, s, qT, sT


def scale_rows_backward_tokens(dz: Tensor, w: Tensor, y: Tensor, cu: Tensor, pow2: bool):
    dz, w, y, cu = dz.contiguous(), w.contiguous(), y.contiguous(), cu.contiguous()
    (M, I), G = dz.shape, cu.shape[0]
    C, Nb, qT, sT, q, s = _outputs(dz, G, rows=True)
    # the tile partials of d_rows; zeros: the rows of no group read 0 (not written below)
    p = torch.zeros(M, C, dtype=torch.float32, device=dz.device)
    if M and I:
        _srb_tokens_kernel[(Nb, C)](dz, w, y, cu, q.view(torch.uint8), s, qT.view(torch.uint8),
                                    sT, p, M, I, C, G, Nb * TILE, POW2=pow2, STEPS=_steps(G),
                                    num_warps=_WARPS)
    return q, s, qT, sT, p.sum(-1)
