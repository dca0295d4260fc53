"""Op family ``moonep::quantize_fp8_rows`` / ``quantize_fp8_blocks`` / ``swiglu_quantize_fp8``:
the FP8 (e4m3) quantisation of the DeepSeek-V3 recipe, with its CPU reference.

Format.  ``torch.float8_e4m3fn`` (max 448, 3 mantissa bits) values with fp32 scales; the real
number an element stands for is ``q * scale`` of its tile or block:

  activations  x_MI  -> q_MI e4m3, scale_MC fp32   one scale per 1 x 128 tile of a row:
                                                    C = ceil(I / 128), scale[m, c] covers
                                                    x[m, 128c : 128c + 128]
  weights      w_..OI -> q_..OI e4m3, scale_..oi   one scale per 128 x 128 block:
                                                    o = ceil(O / 128), i = ceil(I / 128)

(letters: docs/architecture.md, "Shape legend"; a last tile or block that is cut short by the
dims is scaled like a full one.)  A tile's scale is ``max(amax / 448, 2^-126)``, amax = its largest |x| in fp32,
so its largest element maps to +-448 and an all-zero tile gets the smallest normal fp32 scale
(its elements stay exactly 0).  With ``pow2_scales`` the scale is rounded UP to a power of two
(2^ceil(log2(amax / 448))): multiplying by it is exact, the largest element maps into
(224, 448], and the scales of a transposed or regrouped block are bit-identical by construction.
Elements: ``q = e4m3(clamp(x / scale, -448, 448))``, round to nearest even.

Non-finite input.  A tile (block) that holds a NaN or an Inf gets the scale NaN (fp32 bits
0x7FC00000) and every one of its elements the e4m3 NaN 0x7F, so all its dequantised values are
NaN, with pow2 scales or without, plain or transposed; the other tiles are bitwise what they
would be without it.  A non-finite token thus stays non-finite through the FP8 path, as it
does through the bf16 one, and reaches only the outputs it feeds (the loss, the loss scaler
and ``skip_nonfinite`` see it).  The bits are written explicitly, so every device gives the
same bytes (the Triton kernels too: tests/test_fp8_quant_cuda.py).

Error (an e4m3 element has 3 mantissa bits): |x - q*scale| <= 2^-4 |x| for |x / scale| >= 2^-6
(normal e4m3), <= 2^-10 * scale below (subnormal e4m3, spacing 2^-9); tests/test_fp8_ops.py
checks both, and the looser 2^-3 relative bound per element.

Ops (schemas, fakes and references are pure Python; on CUDA the rows and blocks quantisers run
one Triton kernel each, bit-identical with the reference: quantize_fp8_triton.py):
  quantize_fp8_rows(x [M, I] floating, pow2_scales=False) -> (q [M, I] e4m3, scale [M, C] fp32)
  quantize_fp8_blocks(w [..., O, I] floating, pow2_scales=False, transpose=False)
                                                     -> (q [..., O, I] e4m3, scale [..., o, i])
      transpose=True -> (q [..., I, O], scale [..., i, o]): the blocks of w^T.  A block's amax
      and its elements' quotients do not depend on orientation, so this is bitwise
      quantize(w)^T with the scale grid transposed; the Triton kernel writes each tile
      transposed from the same single read (the FP8 layer's backward uses it: the dgrad is the
      forward GEMM on W^T, moe_experts_fp8.py).
  swiglu_quantize_fp8(g [M, F], u [M, F], pow2_scales=False) -> (q [M, F] e4m3, scale [M, C])
      a = silu(g) * u in fp32 (moonep::swiglu's formula), quantised per 1 x 128 tile straight
      from fp32: the SwiGLU output that feeds the down projection is never rounded to bf16.
The FP8 layer's fused elementwise passes (moe_experts_fp8.py; on CUDA one Triton kernel each,
bitwise the reference, which is the torch formulation they replaced, but for d_rows' summation
order; docs/fp8.md):
  scale_rows(x [M, I] bf16, row_weights [M] fp32) -> z = bf16(fp32(x) * w[:, None])
  scale_rows_backward_fp8(dz [M, I] bf16, row_weights [M] fp32, y [M, I] bf16, pow2_scales)
      -> (dy = bf16(fp32(dz) * w[:, None]), dy_q e4m3, dy_scale [M, C] fp32 (quantize_fp8_rows
          of dy), d_rows = sum_I fp32(dz) * fp32(y) fp32 [M], the grad of w); dy and its tiles
          bitwise the reference, d_rows within fp32 reassociation (the kernel sums per tile)
  dequantize_fp8_rows(q [M, I] e4m3, scale [M, C] fp32) -> bf16(dequantize_rows(q, scale))
Python helpers: ``dequantize_rows``, ``dequantize_blocks`` (fp32 results), ``scale_cols``.
None of the ops is differentiable: quantisation sits inside the FP8 ops' own backward
(moonep_ops/ops/grouped_mm_fp8.py, moe_experts_fp8.py), which treat it as the identity
(straight-through).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..geometry import ceil_div
from .. import settings
from . import fastpath

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                     # torch.finfo(torch.float8_e4m3fn).max
TILE = 128                          # 1 x 128 activation tiles, 128 x 128 weight blocks
SCALE_FLOOR = 2.0 ** -126           # the smallest normal fp32: an all-zero tile's scale
NONFINITE_SCALE_BITS = 0x7FC00000   # the scale of a tile holding a NaN or an Inf: fp32 quiet NaN
NONFINITE_Q_BITS = 0x7F             # and each of its elements: e4m3fn NaN (positive)


class FP8ArgumentError(ValueError, TypeError):
    """A bad argument to an FP8 op (wrong dtype, shape, alignment or scale grid), raised before
    any work.  A ValueError; also a TypeError, so code written against the bf16 ops' convention
    (TypeError for a wrong type or dtype) still catches it."""


def fp8_checks(fn):
    """Decorate an argument check of an FP8 op: a TypeError raised inside it (by a check shared
    with the bf16 ops) comes out as an FP8ArgumentError with the same message."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FP8ArgumentError:
            raise
        except TypeError as e:
            raise FP8ArgumentError(str(e)) from None
    return wrapped

__all__ = ["FP8ArgumentError", "FP8_DTYPE", "fp8_row_bytes", "FP8_MAX", "TILE", "scale_cols", "quantize_rows", "quantize_blocks",
           "swiglu_quantize", "dequantize_rows", "dequantize_blocks", "check_rows_fp8",
           "check_blocks_fp8"]


def scale_cols(n) -> int:
    """ceil(n / 128): the tiles (or blocks) along a dim of n elements (works on SymInts)."""
    return ceil_div(n, TILE)


def fp8_row_bytes(D) -> int:
    """Bytes of one dispatched FP8 row: D e4m3 values, then its ceil(D/128) fp32 scales."""
    return D + 4 * scale_cols(D)


# --------------------------------------------------------------------------------------------
# Argument checks (shape / dtype / device: run in the fakes too)
# --------------------------------------------------------------------------------------------

def _check_float(op: str, name: str, t, min_dim: int, max_dim: int | None = None) -> None:
    if not isinstance(t, Tensor):
        raise FP8ArgumentError(f"{op}: {name} must be a Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2,
                                                    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        raise FP8ArgumentError(f"{op}: {name} must be a floating tensor (bf16, fp16, fp32, fp64), "
                        f"got {t.dtype}")
    if t.dim() < min_dim or (max_dim is not None and t.dim() > max_dim):
        want = f"{min_dim}-D" if max_dim == min_dim else f"at least {min_dim}-D"
        raise ValueError(f"{op}: {name} must be {want}, got shape {tuple(t.shape)}")


def _check_bool(op: str, flag, name: str = "pow2_scales") -> None:
    if not isinstance(flag, bool):
        raise FP8ArgumentError(f"{op}: {name} must be a bool, got {type(flag).__name__}")


def _check_fp8_pair(op: str, name: str, q, scale) -> None:
    """q an e4m3 Tensor and scale an fp32 Tensor (types only; shapes are the caller's)."""
    for n, t in ((name, q), (f"{name}_scale", scale)):
        if not isinstance(t, Tensor):
            raise FP8ArgumentError(f"{op}: {n} must be a Tensor, got {type(t).__name__}")
    if q.dtype != FP8_DTYPE:
        raise FP8ArgumentError(f"{op}: {name} must be {FP8_DTYPE} (e4m3), got {q.dtype}")
    if scale.dtype != torch.float32:
        raise FP8ArgumentError(f"{op}: {name}_scale must be float32, got {scale.dtype}")


def _check_fp8_placement(op: str, name: str, q, scale) -> None:
    """q and scale on one device, both contiguous (after the caller's shape checks)."""
    if scale.device != q.device:
        raise ValueError(f"{op}: {name}_scale is on {scale.device}, {name} on {q.device}")
    for n, t in ((name, q), (f"{name}_scale", scale)):
        if not t.is_contiguous():
            raise ValueError(f"{op}: {n} must be contiguous (got strides {t.stride()})")


def _check_blocks_args(w, pow2_scales, transpose) -> None:
    """moonep::quantize_fp8_blocks's arguments (reference, implementation and fake alike)."""
    _check_float("quantize_fp8_blocks", "w", w, 2)
    _check_bool("quantize_fp8_blocks", pow2_scales, "pow2_scales")
    _check_bool("quantize_fp8_blocks", transpose, "transpose")


def check_rows_fp8(op: str, name: str, q, scale, cols: int | None = None) -> tuple[int, int]:
    """A 1 x 128-tile quantised operand: q [M, I] e4m3 and scale [M, ceil(I/128)] fp32, one
    device, contiguous.  Returns (M, I)."""
    _check_fp8_pair(op, name, q, scale)
    if q.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D [M, I], got shape {tuple(q.shape)}")
    M, I = q.shape
    if cols is not None and I != cols:
        raise ValueError(f"{op}: {name} has {I} columns, expected {cols}")
    want = (M, scale_cols(I))
    if scale.dim() != 2 or tuple(scale.shape) != want:
        raise ValueError(f"{op}: {name}_scale must be [M, ceil(I/128)] = {list(want)} (one "
                         f"scale per 1x128 tile of {name}), got {list(scale.shape)}")
    _check_fp8_placement(op, name, q, scale)
    return M, I


def check_blocks_fp8(op: str, name: str, q, scale) -> tuple[int, ...]:
    """A 128 x 128-block quantised weight: q [..., O, I] e4m3, scale [..., ceil(O/128),
    ceil(I/128)] fp32, one device, contiguous.  Returns q's shape."""
    _check_fp8_pair(op, name, q, scale)
    if q.dim() < 2:
        raise ValueError(f"{op}: {name} must be at least 2-D [..., O, I], got {tuple(q.shape)}")
    O, I = q.shape[-2:]
    want = tuple(q.shape[:-2]) + (scale_cols(O), scale_cols(I))
    if tuple(scale.shape) != want:
        raise ValueError(f"{op}: {name}_scale must be [..., ceil(O/128), ceil(I/128)] = "
                         f"{list(want)} (one scale per 128x128 block of {name}), got "
                         f"{list(scale.shape)}")
    _check_fp8_placement(op, name, q, scale)
    return tuple(q.shape)


# --------------------------------------------------------------------------------------------
# Reference (any device; fp32 math)
# --------------------------------------------------------------------------------------------

def _scale_of(amax: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    """(scale, bad) of tiles whose largest |x| is ``amax`` (torch's amax propagates NaN, so amax
    is non-finite exactly when the tile holds a NaN or an Inf); a bad tile's scale is
    NONFINITE_SCALE."""
    # amax / 448 as an IEEE division on every device: torch on CUDA turns a division by a
    # Python scalar into a product with its rounded reciprocal (a different fp32 result for
    # some amax), so the divisor is a tensor of the same shape.
    s = torch.clamp_min(amax / torch.full_like(amax, FP8_MAX), SCALE_FLOOR)
    if pow2:
        m, e = torch.frexp(s)                         # s = m * 2^e, m in [0.5, 1)
        e = torch.where(m == 0.5, e - 1, e)           # already a power of two
        s = torch.ldexp(torch.ones_like(s), e)
    # frexp(inf) is (inf, 0) and frexp(nan) (nan, 0): without this the pow2 scale of a
    # non-finite tile would be 1 and its elements finite (+-448).  Set by its bits, so that
    # every device writes the same NaN.
    bad = ~torch.isfinite(amax)
    s = s.contiguous().view(torch.int32).masked_fill(bad, NONFINITE_SCALE_BITS).view(torch.float32)
    return s, bad


def _cast(v: Tensor, bad: Tensor) -> Tensor:
    """e4m3 of clamp(v, +-448); the elements of bad tiles (``bad`` broadcasts against v) are
    NONFINITE_Q, by their bits: x / NaN would keep the sign of a NaN x, which differs by
    device."""
    q = torch.clamp(v, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(torch.uint8).masked_fill(bad, NONFINITE_Q_BITS).view(FP8_DTYPE)


def _pad_last(x: Tensor, n: int) -> Tensor:
    pad = scale_cols(n) * TILE - n
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def quantize_rows_from_fp32(xf: Tensor, pow2: bool) -> tuple[Tensor, Tensor]:
    """1 x 128 tiles of an fp32 (or fp64) [M, I] tensor -> (q e4m3, scale fp32)."""
    M, I = xf.shape
    C = scale_cols(I)
    xf = xf.to(torch.float32)
    tiles = _pad_last(xf, I).view(M, C, TILE)
    s, bad = _scale_of(tiles.abs().amax(-1), pow2)                 # [M, C]
    q = _cast(tiles / s[..., None], bad[..., None]).view(M, C * TILE)[:, :I]
    return q.contiguous(), s.contiguous()


def quantize_rows(x_MI: Tensor, pow2_scales: bool = False) -> tuple[Tensor, Tensor]:
    """Reference of moonep::quantize_fp8_rows (see the module docstring)."""
    _check_float("quantize_fp8_rows", "x", x_MI, 2, 2)
    _check_bool("quantize_fp8_rows", pow2_scales)
    return quantize_rows_from_fp32(x_MI, pow2_scales)


def quantize_blocks(w: Tensor, pow2_scales: bool = False, transpose: bool = False
                    ) -> tuple[Tensor, Tensor]:
    """Reference of moonep::quantize_fp8_blocks (see the module docstring)."""
    _check_blocks_args(w, pow2_scales, transpose)
    return quantize_blocks_from_float(w, pow2_scales, transpose)


def quantize_blocks_from_float(w: Tensor, pow2_scales: bool, transpose: bool = False
                               ) -> tuple[Tensor, Tensor]:
    """128 x 128 blocks of a checked floating [..., O, I] tensor -> (q e4m3, scale fp32);
    transpose: those of w^T ([..., I, O], scale [..., i, o]), the same bytes transposed."""
    if transpose:
        w = w.mT
    *lead, O, I = w.shape
    o, i = scale_cols(O), scale_cols(I)
    wf = w.to(torch.float32).reshape(-1, O, I)
    padded = torch.nn.functional.pad(wf, (0, i * TILE - I, 0, o * TILE - O))
    blocks = padded.view(-1, o, TILE, i, TILE)
    s, bad = _scale_of(blocks.abs().amax(dim=(2, 4)), pow2_scales)  # [n, o, i]
    q = _cast(blocks / s[:, :, None, :, None], bad[:, :, None, :, None])
    q = q.view(-1, o * TILE, i * TILE)[:, :O, :I]
    return (q.reshape(*lead, O, I).contiguous(), s.reshape(*lead, o, i).contiguous())


def swiglu_quantize(g_MF: Tensor, u_MF: Tensor, pow2_scales: bool = False) -> tuple[Tensor, Tensor]:
    """Reference of moonep::swiglu_quantize_fp8: a = silu(g) * u in fp32, 1 x 128 tiles."""
    _check_swiglu(g_MF, u_MF, pow2_scales)
    gf, uf = g_MF.to(torch.float32), u_MF.to(torch.float32)
    a = (gf * torch.sigmoid(gf)).mul_(uf)
    return quantize_rows_from_fp32(a, pow2_scales)


def _check_swiglu(g, u, pow2) -> None:
    op = "swiglu_quantize_fp8"
    _check_float(op, "g", g, 2, 2)
    _check_float(op, "u", u, 2, 2)
    _check_bool(op, pow2)
    if g.dtype != u.dtype:
        raise FP8ArgumentError(f"{op}: g is {g.dtype} but u is {u.dtype}: both must share one dtype")
    if g.device != u.device:
        raise ValueError(f"{op}: g is on {g.device} but u on {u.device}")
    if tuple(g.shape) != tuple(u.shape):
        raise ValueError(f"{op}: g {tuple(g.shape)} and u {tuple(u.shape)} must match")


def _kernels(t: Tensor):
    """quantize_fp8_triton for a CUDA tensor when Triton imports, else None (the reference).
    Env MOONEP_FP8_QUANT=reference forces the reference on CUDA."""
    if t.device.type != "cuda" or settings.get("MOONEP_FP8_QUANT").lower() == "reference":
        return None
    try:
        from . import quantize_fp8_triton
    except ImportError:          # triton is the "gpu" extra of setup.py
        return None
    return quantize_fp8_triton


def rows_fp8(x_MI: Tensor, pow2_scales: bool = False) -> tuple[Tensor, Tensor]:
    """moonep::quantize_fp8_rows's implementation: one Triton kernel on CUDA (bit-identical with
    the reference, tests/test_fp8_quant_cuda.py), the reference elsewhere."""
    _check_float("quantize_fp8_rows", "x", x_MI, 2, 2)
    _check_bool("quantize_fp8_rows", pow2_scales)
    k = _kernels(x_MI)
    if k is None:
        return quantize_rows_from_fp32(x_MI, pow2_scales)
    return k.quantize_rows(x_MI, pow2_scales)


def blocks_fp8(w: Tensor, pow2_scales: bool = False, transpose: bool = False
               ) -> tuple[Tensor, Tensor]:
    """moonep::quantize_fp8_blocks's implementation (as ``rows_fp8``); transpose=True writes
    the blocks of w^T in the same single pass over w."""
    _check_blocks_args(w, pow2_scales, transpose)
    k = _kernels(w)
    if k is None:
        return quantize_blocks_from_float(w, pow2_scales, transpose)
    return k.quantize_blocks(w, pow2_scales, transpose)


def dequantize_rows(q_MI: Tensor, scale_MC: Tensor) -> Tensor:
    """fp32 [M, I]: every element times its 1 x 128 tile's scale."""
    M, I = check_rows_fp8("dequantize_rows", "q", q_MI, scale_MC)
    s = scale_MC.repeat_interleave(TILE, dim=1)[:, :I]
    return q_MI.to(torch.float32) * s


def dequantize_blocks(q: Tensor, scale: Tensor) -> Tensor:
    """fp32 [..., O, I]: every element times its 128 x 128 block's scale."""
    shape = check_blocks_fp8("dequantize_blocks", "q", q, scale)
    O, I = shape[-2:]
    s = scale.repeat_interleave(TILE, dim=-2).repeat_interleave(TILE, dim=-1)[..., :O, :I]
    return q.to(torch.float32) * s


# --------------------------------------------------------------------------------------------
# The FP8 layer's fused elementwise passes (moe_experts_fp8.py): references and implementations
# --------------------------------------------------------------------------------------------

BF16 = torch.bfloat16


def _check_rows_bf16(op: str, w_M, **named) -> tuple[int, int]:
    """bf16 [M, I] tensors of one shape and a float32 [M] row weight, on one device."""
    for n, t in named.items():
        if not isinstance(t, Tensor):
            raise FP8ArgumentError(f"{op}: {n} must be a Tensor, got {type(t).__name__}")
        if t.dtype != BF16:
            raise FP8ArgumentError(f"{op}: {n} must be {BF16}, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{op}: {n} must be 2-D [M, I], got shape {tuple(t.shape)}")
    (n0, t0), *rest = named.items()
    M, I = t0.shape
    for n, t in rest:
        if tuple(t.shape) != (M, I):
            raise ValueError(f"{op}: {n} {tuple(t.shape)} and {n0} {tuple(t0.shape)} must match")
    if not isinstance(w_M, Tensor):
        raise FP8ArgumentError(f"{op}: row_weights must be a Tensor, got {type(w_M).__name__}")
    if w_M.dtype != torch.float32 or tuple(w_M.shape) != (M,):
        raise FP8ArgumentError(f"{op}: row_weights must be [M={M}] float32, got "
                               f"{list(w_M.shape)} {w_M.dtype}")
    for n, t in [*rest, ("row_weights", w_M)]:
        if t.device != t0.device:
            raise ValueError(f"{op}: {n} is on {t.device}, {n0} on {t0.device}")
    return M, I


def scale_rows(x_MI: Tensor, w_M: Tensor) -> Tensor:
    """Reference of moonep::scale_rows: bf16(fp32(x) * w[:, None]), the FP8 layer's z."""
    _check_rows_bf16("scale_rows", w_M, x=x_MI)
    return (x_MI.float() * w_M[:, None]).to(BF16)


def scale_rows_backward(dz_MI: Tensor, w_M: Tensor, y_MI: Tensor, pow2_scales: bool = False
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Reference of moonep::scale_rows_backward_fp8: (dy, dy_q, dy_scale, d_rows) with
    dy = bf16(fp32(dz) * w[:, None]), (dy_q, dy_scale) = quantize_rows(dy) and
    d_rows = sum_I fp32(dz) * fp32(y), the grad of w [M] fp32.  The CUDA kernel sums each
    1 x 128 tile in registers and then the tiles: the same terms in another order (fp32
    reassociation, ~1e-6 of sum |dz * y|; tests/test_fp8_quant_cuda.py), never the [M, I]
    products in memory."""
    _check_rows_bf16("scale_rows_backward_fp8", w_M, dz=dz_MI, y=y_MI)
    _check_bool("scale_rows_backward_fp8", pow2_scales)
    dzf = dz_MI.float()
    dy = (dzf * w_M[:, None]).to(BF16)
    q, s = quantize_rows_from_fp32(dy, pow2_scales)
    return dy, q, s, (dzf * y_MI.float()).sum(-1)


def scale_rows_backward_bf16(dz_MI: Tensor, w_M: Tensor, y_MI: Tensor
                             ) -> tuple[Tensor, Tensor]:
    """Reference of moonep::scale_rows_backward, the autograd of moonep::scale_rows: (dy,
    d_rows) of scale_rows_backward without the quantisation (the bf16 layer's; the CUDA
    kernel's d_rows is the same sum in tile order, as there)."""
    _check_rows_bf16("scale_rows_backward", w_M, dz=dz_MI, y=y_MI)
    dzf = dz_MI.float()
    return (dzf * w_M[:, None]).to(BF16), (dzf * y_MI.float()).sum(-1)


def dequantize_rows_bf16(q_MI: Tensor, scale_MC: Tensor) -> Tensor:
    """Reference of moonep::dequantize_fp8_rows: bf16(dequantize_rows(q, scale))."""
    return dequantize_rows(q_MI, scale_MC).to(BF16)


def _scale_rows_impl(x_MI: Tensor, w_M: Tensor) -> Tensor:
    _check_rows_bf16("scale_rows", w_M, x=x_MI)
    k = _kernels(x_MI)
    return scale_rows(x_MI, w_M) if k is None else k.scale_rows(x_MI, w_M)


def _scale_rows_backward_impl(dz_MI, w_M, y_MI, pow2_scales=False):
    _check_rows_bf16("scale_rows_backward_fp8", w_M, dz=dz_MI, y=y_MI)
    _check_bool("scale_rows_backward_fp8", pow2_scales)
    k = _kernels(dz_MI)
    if k is None:
        return scale_rows_backward(dz_MI, w_M, y_MI, pow2_scales)
    return k.scale_rows_backward(dz_MI, w_M, y_MI, pow2_scales)


def _scale_rows_backward_bf16_impl(dz_MI, w_M, y_MI):
    _check_rows_bf16("scale_rows_backward", w_M, dz=dz_MI, y=y_MI)
    k = _kernels(dz_MI)
    if k is None:
        return scale_rows_backward_bf16(dz_MI, w_M, y_MI)
    return k.scale_rows_backward(dz_MI, w_M, y_MI, False, quantize=False)


def _dequantize_rows_bf16_impl(q_MI: Tensor, scale_MC: Tensor) -> Tensor:
    check_rows_fp8("dequantize_fp8_rows", "q", q_MI, scale_MC)
    k = _kernels(q_MI)
    return dequantize_rows_bf16(q_MI, scale_MC) if k is None else k.dequantize_rows_bf16(
        q_MI, scale_MC)


# --------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------

def fake_rows_fp8(like: Tensor, M, I) -> tuple[Tensor, Tensor]:
    """A fake kernel's 1 x 128-tile quantisation of [M, I] rows: empty (q e4m3, scale [M, C])."""
    return (like.new_empty((M, I), dtype=FP8_DTYPE),
            like.new_empty((M, scale_cols(I)), dtype=torch.float32))


_quantize_rows_op = torch.library.custom_op(
    "moonep::quantize_fp8_rows", rows_fp8, mutates_args=(),
    schema="(Tensor x, bool pow2_scales=False) -> (Tensor, Tensor)")


@_quantize_rows_op.register_fake
def _(x, pow2_scales=False):
    _check_float("quantize_fp8_rows", "x", x, 2, 2)
    _check_bool("quantize_fp8_rows", pow2_scales)
    return fake_rows_fp8(x, *x.shape)


_quantize_blocks_op = torch.library.custom_op(
    "moonep::quantize_fp8_blocks", blocks_fp8, mutates_args=(),
    schema="(Tensor w, bool pow2_scales=False, bool transpose=False) -> (Tensor, Tensor)")


@_quantize_blocks_op.register_fake
def _(w, pow2_scales=False, transpose=False):
    _check_blocks_args(w, pow2_scales, transpose)
    *lead, O, I = w.shape
    if transpose:
        O, I = I, O
    return (w.new_empty((*lead, O, I), dtype=FP8_DTYPE),
            w.new_empty((*lead, scale_cols(O), scale_cols(I)), dtype=torch.float32))


_swiglu_quantize_op = torch.library.custom_op(
    "moonep::swiglu_quantize_fp8", swiglu_quantize, mutates_args=(),
    schema="(Tensor g, Tensor u, bool pow2_scales=False) -> (Tensor, Tensor)")


@_swiglu_quantize_op.register_fake
def _(g, u, pow2_scales=False):
    _check_swiglu(g, u, pow2_scales)
    return fake_rows_fp8(g, *g.shape)


_scale_rows_op = torch.library.custom_op(
    "moonep::scale_rows", _scale_rows_impl, mutates_args=(),
    schema="(Tensor x, Tensor row_weights) -> Tensor")


@_scale_rows_op.register_fake
def _(x, row_weights):
    _check_rows_bf16("scale_rows", row_weights, x=x)
    return x.new_empty(x.shape, dtype=BF16)


_scale_rows_backward_op = torch.library.custom_op(
    "moonep::scale_rows_backward_fp8", _scale_rows_backward_impl, mutates_args=(),
    schema="(Tensor dz, Tensor row_weights, Tensor y, bool pow2_scales=False)"
           " -> (Tensor, Tensor, Tensor, Tensor)")


@_scale_rows_backward_op.register_fake
def _(dz, row_weights, y, pow2_scales=False):
    M, I = _check_rows_bf16("scale_rows_backward_fp8", row_weights, dz=dz, y=y)
    _check_bool("scale_rows_backward_fp8", pow2_scales)
    return (dz.new_empty((M, I), dtype=BF16), *fake_rows_fp8(dz, M, I),
            dz.new_empty((M,), dtype=torch.float32))


_scale_rows_backward_bf16_op = torch.library.custom_op(
    "moonep::scale_rows_backward", _scale_rows_backward_bf16_impl, mutates_args=(),
    schema="(Tensor dz, Tensor row_weights, Tensor y) -> (Tensor, Tensor)")


@_scale_rows_backward_bf16_op.register_fake
def _(dz, row_weights, y):
    M, I = _check_rows_bf16("scale_rows_backward", row_weights, dz=dz, y=y)
    return dz.new_empty((M, I), dtype=BF16), dz.new_empty((M,), dtype=torch.float32)


def _scale_rows_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])


def _scale_rows_grad(ctx, dz):
    # z = bf16(fp32(y) * w): dy = bf16(fp32(dz) * w), dw = sum_I fp32(dz) * fp32(y), the
    # grads torch's autograd gives the formulation (the same grads as the weighted combine's)
    y, w = ctx.saved_tensors
    return fastpath.call(torch.ops.moonep.scale_rows_backward, _scale_rows_backward_bf16_impl,
                         None, dz.contiguous(), w, y)


_scale_rows_op.register_autograd(_scale_rows_grad, setup_context=_scale_rows_setup)

_dequantize_rows_bf16_op = torch.library.custom_op(
    "moonep::dequantize_fp8_rows", _dequantize_rows_bf16_impl, mutates_args=(),
    schema="(Tensor q, Tensor scale) -> Tensor")


@_dequantize_rows_bf16_op.register_fake
def _(q, scale):
    M, I = check_rows_fp8("dequantize_fp8_rows", "q", q, scale)
    return q.new_empty((M, I), dtype=BF16)


# Public API: the ops (trace under torch.compile; the references above are plain functions).

def quantize_fp8_rows(x_MI: Tensor, *, pow2_scales: bool = False) -> tuple[Tensor, Tensor]:
    """(q [M, I] e4m3, scale [M, ceil(I/128)] fp32), one scale per 1 x 128 tile."""
    return torch.ops.moonep.quantize_fp8_rows(x_MI, pow2_scales)


def quantize_fp8_blocks(w: Tensor, *, pow2_scales: bool = False, transpose: bool = False
                        ) -> tuple[Tensor, Tensor]:
    """(q [..., O, I] e4m3, scale [..., ceil(O/128), ceil(I/128)] fp32), one per 128 x 128;
    transpose=True: (q [..., I, O], scale [..., ceil(I/128), ceil(O/128)]), the quantisation of
    w^T (bitwise the transpose of the plain result), from one pass over w."""
    return torch.ops.moonep.quantize_fp8_blocks(w, pow2_scales, transpose)


def swiglu_quantize_fp8(g_MF: Tensor, u_MF: Tensor, *, pow2_scales: bool = False
                        ) -> tuple[Tensor, Tensor]:
    """silu(g) * u in fp32, quantised per 1 x 128 tile: (q [M, F] e4m3, scale [M, ceil(F/128)])."""
    return torch.ops.moonep.swiglu_quantize_fp8(g_MF, u_MF, pow2_scales)


__all__ += ["quantize_fp8_rows", "quantize_fp8_blocks", "swiglu_quantize_fp8",
            "scale_rows", "scale_rows_backward",
            "dequantize_rows_bf16"]
