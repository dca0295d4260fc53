"""The FP8 ops on CPU (the verified path): quantisation (moonep_ops/ops/quantize_fp8.py) and the
FP8 grouped GEMMs (moonep_ops/ops/grouped_mm_fp8.py).

Oracles written here, independently of the library: per-tile / per-block loops for the scales
and the dequantisation, fp64 matmuls per row.  The only shared primitive is torch's own
``float8_e4m3fn`` cast (the format's rounding).

Error bounds of e4m3 (3 mantissa bits): an element whose scaled value |x / s| is a normal e4m3
number (>= 2^-6) is off by at most half an ulp, 2^-4 |x|; below that (subnormal, spacing 2^-9)
by at most 2^-10 * s.  Both are checked, and the looser 2^-3 relative bound per element of the
normal range.  GEMM outputs: dequantise-then-matmul in fp64, then one bf16 rounding (2^-9
relative) plus fp32 accumulation: checked to 2^-8 relative.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.library import opcheck

import moonep_ops  # noqa: F401  (registers the ops)
from moonep_ops.ops import grouped_mm as gm
from moonep_ops.ops import grouped_mm_fp8 as g8
from moonep_ops.ops import quantize_fp8 as qf

E4M3 = torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------
# independent helpers
# ------------------------------------------------------------------------------------------

def tiles(n):
    return [(a, min(a + 128, n)) for a in range(0, n, 128)]


def naive_row_scales(x, pow2):
    """[M, C] fp32 scales by a plain loop: max(amax / 448, 2^-126), optionally 2^ceil(log2)."""
    xf = x.float()
    out = np.zeros((x.shape[0], len(tiles(x.shape[1]))), dtype=np.float32)
    for m in range(x.shape[0]):
        for c, (a, b) in enumerate(tiles(x.shape[1])):
            out[m, c] = naive_scale(float(xf[m, a:b].abs().max()), pow2)
    return torch.from_numpy(out)


def naive_scale(amax, pow2):
    s = max(np.float32(amax) / np.float32(448.0), np.float32(2.0 ** -126))
    if pow2:
        s = np.float32(2.0 ** math.ceil(math.log2(float(s))))
    return np.float32(s)


def naive_dequant_rows(q, s):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for m in range(q.shape[0]):
        for c, (a, b) in enumerate(tiles(q.shape[1])):
            out[m, a:b] = q[m, a:b].double() * float(s[m, c])
    return out


def naive_dequant_block(q, s):
    """One [O, I] weight with its [P, C] scales."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for p, (a, b) in enumerate(tiles(q.shape[0])):
        for c, (e, f) in enumerate(tiles(q.shape[1])):
            out[a:b, e:f] = q[a:b, e:f].double() * float(s[p, c])
    return out


def group_of_rows(cu, M):
    out, g = [], 0
    cu = cu.tolist()
    for r in range(M):
        while g < len(cu) and r >= cu[g]:
            g += 1
        out.append(g)
    return out


def bits(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t


def same(a, b):
    return torch.equal(bits(a), bits(b))


def check_error_bound(x, deq, scale_of_element):
    """The e4m3 bounds of the module docstring, element by element (fp64)."""
    x, deq, s = x.double(), deq.double(), scale_of_element.double()
    err = (x - deq).abs()
    normal = x.abs() >= 2.0 ** -6 * s
    slack = 1 + 2.0 ** -20                      # x / s is one fp32 division
    assert torch.all(err[normal] <= 2.0 ** -4 * x.abs()[normal] * slack)
    assert torch.all(err[normal] <= 2.0 ** -3 * x.abs()[normal])           # the looser bound
    assert torch.all(err[~normal] <= 2.0 ** -10 * s[~normal] * slack)


def row_scale_of_elements(s, I):
    return s.repeat_interleave(128, dim=1)[:, :I]


def make_cu(counts):
    return torch.tensor(np.cumsum(counts), dtype=torch.int32)


COUNTS = {"skewed": [5, 0, 1, 9, 0, 3], "one_group": [0, 0, 17, 0], "all_empty": [0, 0],
          "ones": [1, 1, 1, 1]}


def operands(counts, O=144, I=160, pad=3, seed=0, pow2=False):
    """Quantised x [M, I] and weights [epn, O, I]; I = 160 and O = 144 end in cut-short tiles."""
    gen = torch.Generator().manual_seed(seed)
    epn = len(counts) // 2
    M = int(sum(counts)) + pad
    x = (torch.randn(M, I, generator=gen) * torch.logspace(-3, 1, I)).bfloat16()
    wl = (torch.randn(epn, O, I, generator=gen) * 0.05).bfloat16()
    ws = (torch.randn(epn, O, I, generator=gen) * 0.05).bfloat16()
    xq, xs = qf.quantize_rows(x, pow2)
    wlq, wls = qf.quantize_blocks(wl, pow2)
    wsq, wss = qf.quantize_blocks(ws, pow2)
    return x, wl, ws, (xq, xs, wlq, wls, wsq, wss, make_cu(counts))


# ------------------------------------------------------------------------------------------
# quantisation
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("I", [16, 128, 300])
def test_quantize_rows_scales_and_error_bounds(I, pow2):
    gen = torch.Generator().manual_seed(I)
    x = torch.randn(7, I, generator=gen) * torch.logspace(-4, 3, I)   # 7 decades in a row
    x[2] = 0.0                                                        # an all-zero row
    x[3, :5] = torch.tensor([1e-30, -1e-35, 3e-12, 0.0, 7.0])
    q, s = torch.ops.moonep.quantize_fp8_rows(x, pow2)
    assert q.dtype == E4M3 and s.dtype == torch.float32
    assert q.shape == x.shape and s.shape == (7, (I + 127) // 128)
    assert torch.equal(s, naive_row_scales(x, pow2))
    deq = naive_dequant_rows(q, s)
    check_error_bound(x, deq, row_scale_of_elements(s, I))
    assert torch.all(deq[2] == 0) and torch.all(s[2] == 2.0 ** -126)
    # every tile's largest element lands at the top of the e4m3 range
    for m in range(7):
        for c, (a, b) in enumerate(tiles(I)):
            top = float(q[m, a:b].float().abs().max())
            if m == 2:
                assert top == 0.0
            elif pow2:
                assert 224.0 <= top <= 448.0
                assert float(s[m, c]) == 2.0 ** round(math.log2(float(s[m, c])))
            else:
                assert top == 448.0


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(200, 300), (2, 144, 160), (3, 128, 256)])
def test_quantize_blocks_scales_and_error_bounds(shape, pow2):
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=gen).bfloat16()
    q, s = torch.ops.moonep.quantize_fp8_blocks(w, pow2)
    O, I = shape[-2:]
    assert q.dtype == E4M3 and q.shape == w.shape
    assert s.shape == shape[:-2] + ((O + 127) // 128, (I + 127) // 128)
    q3, s3, w3 = q.reshape(-1, O, I), s.reshape(-1, *s.shape[-2:]), w.reshape(-1, O, I)
    for n in range(w3.shape[0]):
        for p, (a, b) in enumerate(tiles(O)):
            for c, (e, f) in enumerate(tiles(I)):
                want = naive_scale(float(w3[n, a:b, e:f].float().abs().max()), pow2)
                assert float(s3[n, p, c]) == float(want)
        deq = naive_dequant_block(q3[n], s3[n])
        per_elem = s3[n].repeat_interleave(128, 0).repeat_interleave(128, 1)[:O, :I]
        check_error_bound(w3[n], deq, per_elem)
    if pow2:
        m, _ = torch.frexp(s)
        assert torch.all(m == 0.5), "pow2 scales are exact powers of two"


def test_block_quantisation_commutes_with_transpose():
    """The dgrad reads W^T with the transposed scale grid: the same numbers, bitwise."""
    w = torch.randn(3, 144, 272).bfloat16()
    for pow2 in (False, True):
        q, s = qf.quantize_blocks(w, pow2)
        qt, st = qf.quantize_blocks(w.transpose(1, 2).contiguous(), pow2)
        assert same(qt, q.transpose(1, 2).contiguous()) and torch.equal(st, s.transpose(1, 2))


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(144, 272), (3, 144, 272), (2, 3, 130, 260), (256, 128),
                                   (1, 16, 16), (5, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_transposed_block_quantisation_is_the_transpose(shape, pow2, dtype):
    """transpose=True (op, public API, reference and blocks_fp8) == quantize(w)^T bitwise, scale
    grid [..., C, P]; cut-short tiles at both ends, all-zero blocks, per-block magnitudes."""
    gen = torch.Generator().manual_seed(sum(shape) + pow2)
    w = torch.randn(*shape, generator=gen)
    w = w * torch.exp2(torch.randint(-12, 8, shape[:-2] + (1, 1), generator=gen).float())
    w[..., :128, :128] *= 2.0 ** -9                 # a block of another magnitude
    if shape[-1] > 128 and shape[-2] > 128:
        w[..., 128:, 128:] = 0.0                    # all-zero blocks: the floor scale
    w = w.to(dtype)
    O, I = shape[-2:]
    q, s = qf.quantize_blocks(w, pow2)
    want_q, want_s = q.mT.contiguous(), s.mT.contiguous()
    for got_q, got_s in (torch.ops.moonep.quantize_fp8_blocks(w, pow2, True),
                         qf.quantize_fp8_blocks(w, pow2_scales=pow2, transpose=True),
                         qf.quantize_blocks(w, pow2, transpose=True),
                         qf.blocks_fp8(w, pow2, transpose=True)):
        assert got_q.shape == shape[:-2] + (I, O) and got_q.is_contiguous()
        assert got_s.shape == shape[:-2] + ((I + 127) // 128, (O + 127) // 128)
        assert got_s.is_contiguous()
        assert same(got_q, want_q) and torch.equal(got_s, want_s)
    # and == quantize(w^T): the layout the FP8 backward feeds to the forward GEMM
    q2, s2 = qf.quantize_blocks(w.mT.contiguous(), pow2)
    assert same(q2, want_q) and torch.equal(s2, want_s)


def test_dgrad_is_the_forward_gemm_on_transposed_weights():
    """dy @ W_g == grouped_mm_fp8(dy, W^T) bitwise on the reference path, W^T quantised
    transposed (the FP8 layer's backward, moe_experts_fp8.py)."""
    for pow2 in (False, True):
        _, wl, ws, (_, _, wlq, wls, wsq, wss, cu) = operands(COUNTS["skewed"], pow2=pow2)
        M = int(cu[-1]) + 3
        dy = (torch.randn(M, 144, generator=torch.Generator().manual_seed(1))).bfloat16()
        dq, ds = qf.quantize_rows(dy, pow2)
        old = g8.grouped_mm_fp8_dgrad(dq, ds, wlq, wls, wsq, wss, cu)
        tl_, tls = qf.quantize_fp8_blocks(wl, pow2_scales=pow2, transpose=True)
        ts, tss = qf.quantize_fp8_blocks(ws, pow2_scales=pow2, transpose=True)
        new = g8.grouped_mm_fp8(dq, ds, tl_, tls, ts, tss, cu)
        assert torch.equal(new, old)


@pytest.mark.parametrize("pow2", [False, True])
def test_swiglu_quantize_quantises_the_fp32_swiglu(pow2):
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(9, 272, generator=gen).bfloat16()
    u = torch.randn(9, 272, generator=gen).bfloat16()
    q, s = torch.ops.moonep.swiglu_quantize_fp8(g, u, pow2)
    gf = g.float()
    a32 = gf * torch.sigmoid(gf) * u.float()          # moonep::swiglu's formula, fp32, no bf16
    q2, s2 = qf.quantize_rows(a32, pow2)
    assert same(q, q2) and torch.equal(s, s2)
    exact = torch.nn.functional.silu(g.double()) * u.double()
    check_error_bound(exact.float(), naive_dequant_rows(q, s), row_scale_of_elements(s, 272))


def test_quantize_opcheck():
    x = torch.randn(5, 300).bfloat16()
    w = torch.randn(2, 144, 160)
    for pow2 in (False, True):
        opcheck(torch.ops.moonep.quantize_fp8_rows.default, (x, pow2))
        opcheck(torch.ops.moonep.quantize_fp8_blocks.default, (w, pow2))
        opcheck(torch.ops.moonep.quantize_fp8_blocks.default, (w, pow2, True))
        opcheck(torch.ops.moonep.quantize_fp8_blocks.default, (w[0, :, :144].bfloat16(), pow2,
                                                               True))
        opcheck(torch.ops.moonep.swiglu_quantize_fp8.default, (x, x.flip(0), pow2))


def test_quantize_bad_input():
    x = torch.randn(4, 32)
    with pytest.raises(TypeError, match="floating"):
        qf.quantize_fp8_rows(x.int())
    with pytest.raises(TypeError, match="floating"):
        qf.quantize_fp8_rows(x.to(E4M3))
    with pytest.raises(ValueError, match="2-D"):
        qf.quantize_fp8_rows(x[None])
    with pytest.raises(ValueError, match="at least 2-D"):
        qf.quantize_fp8_blocks(x[0])
    with pytest.raises(TypeError, match="pow2_scales"):
        qf.quantize_rows(x, 1)
    with pytest.raises(TypeError, match="transpose"):
        qf.quantize_blocks(x, False, 1)
    with pytest.raises(ValueError, match="must match"):
        qf.swiglu_quantize_fp8(x, x[:, :16])
    with pytest.raises(TypeError, match="share one dtype"):
        qf.swiglu_quantize_fp8(x, x.double())


# ------------------------------------------------------------------------------------------
# non-finite input: the tile (block) holding it is NaN, every other one bitwise unchanged
# ------------------------------------------------------------------------------------------

NONFINITE = {"nan": float("nan"), "-nan": -float("nan"), "inf": float("inf"),
             "-inf": -float("inf")}
NAN_SCALE_BITS = 0x7FC00000             # fp32 quiet NaN: the scale of a non-finite tile
NAN_E4M3_BITS = 0x7F                     # e4m3fn NaN: each of its elements


def check_poisoned(q, s, q0, s0, bad, tile_of_element):
    """q, s: quantisation of the poisoned input; q0, s0: of the clean one; bad: bool over the
    scale grid (the tiles that hold a non-finite value); tile_of_element: bool over q's
    elements, True inside a bad tile.  The bad tiles are all NaN (scale bits, element bytes,
    dequantised values); everything else is bitwise the clean result."""
    assert bad.any() and not bad.all()
    sb, s0b = s.view(torch.int32), s0.view(torch.int32)
    assert bool((sb[bad] == NAN_SCALE_BITS).all()), "a non-finite tile's scale is NaN"
    assert torch.equal(sb[~bad], s0b[~bad]), "the other tiles' scales are unchanged"
    qb, q0b = bits(q), bits(q0)
    assert bool((qb[tile_of_element] == NAN_E4M3_BITS).all()), "its elements are e4m3 NaN"
    assert torch.equal(qb[~tile_of_element], q0b[~tile_of_element]), "other elements unchanged"


@pytest.mark.parametrize("kind", list(NONFINITE))
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_nonfinite_poisons_its_tile_only(kind, pow2, dtype):
    gen = torch.Generator().manual_seed(5)
    M, I = 9, 300                                      # 3 tiles a row, the last cut short
    x0 = (torch.randn(M, I, generator=gen) * 3).to(dtype)
    x = x0.clone()
    hits = [(1, 0), (4, 200), (4, 250), (8, 299)]       # two in one tile; the short last tile
    for r, c in hits:
        x[r, c] = NONFINITE[kind]
    bad = torch.zeros(M, qf.scale_cols(I), dtype=torch.bool)
    for r, c in hits:
        bad[r, c // 128] = True
    in_bad = bad.repeat_interleave(128, 1)[:, :I]
    for q, s in (qf.quantize_rows(x, pow2), torch.ops.moonep.quantize_fp8_rows(x, pow2)):
        check_poisoned(q, s, *qf.quantize_rows(x0, pow2), bad, in_bad)
        deq = qf.dequantize_rows(q, s)
        assert bool(deq[in_bad].isnan().all()) and bool(deq[~in_bad].isfinite().all())
        assert torch.equal(qf.dequantize_rows_bf16(q, s).isnan(), in_bad)


@pytest.mark.parametrize("kind", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("transpose", [False, True])
def test_quantize_blocks_nonfinite_poisons_its_block_only(kind, pow2, transpose):
    gen = torch.Generator().manual_seed(6)
    w0 = (torch.randn(2, 200, 300, generator=gen) * 0.1).bfloat16()     # 2 x 3 blocks each
    w = w0.clone()
    hits = [(0, 5, 7), (1, 150, 290)]                   # the second: a cut-short corner block
    for n, o, i in hits:
        w[n, o, i] = NONFINITE[kind]
    bad = torch.zeros(2, 2, 3, dtype=torch.bool)        # [n, P, C] of w
    for n, o, i in hits:
        bad[n, o // 128, i // 128] = True
    in_bad = bad.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :200, :300]
    if transpose:
        bad, in_bad = bad.mT, in_bad.mT
    for q, s in (qf.quantize_blocks(w, pow2, transpose),
                 torch.ops.moonep.quantize_fp8_blocks(w, pow2, transpose)):
        check_poisoned(q, s, *qf.quantize_blocks(w0, pow2, transpose), bad, in_bad)
        deq = qf.dequantize_blocks(q, s)
        assert bool(deq[in_bad].isnan().all()) and bool(deq[~in_bad].isfinite().all())


@pytest.mark.parametrize("pow2", [False, True])
def test_swiglu_quantize_and_scale_rows_backward_nonfinite(pow2):
    """The two fused quantisers of the FP8 layer follow the same rule: silu(g) * u of an Inf g
    is NaN or Inf, and so is a dy tile with an Inf dz."""
    gen = torch.Generator().manual_seed(7)
    g0 = torch.randn(6, 272, generator=gen).bfloat16()
    u = torch.randn(6, 272, generator=gen).bfloat16()
    g = g0.clone()
    g[2, 130] = float("inf")                   # silu(inf) * u = +-inf (or nan for u = 0)
    bad = torch.zeros(6, 3, dtype=torch.bool)
    bad[2, 1] = True
    in_bad = bad.repeat_interleave(128, 1)[:, :272]
    check_poisoned(*torch.ops.moonep.swiglu_quantize_fp8(g, u, pow2),
                   *torch.ops.moonep.swiglu_quantize_fp8(g0, u, pow2), bad, in_bad)
    dz0, y, w = _layer_rows(6, 272, seed=4)
    dz = dz0.clone()
    dz[2, 130] = float("nan")
    dy, q, s, d_rows = torch.ops.moonep.scale_rows_backward_fp8(dz, w, y, pow2)
    dy0, q0, s0, d_rows0 = torch.ops.moonep.scale_rows_backward_fp8(dz0, w, y, pow2)
    check_poisoned(q, s, q0, s0, bad, in_bad)
    assert torch.equal(d_rows.isnan(), bad.any(1)) and torch.equal(d_rows[:2], d_rows0[:2])


# ------------------------------------------------------------------------------------------
# the FP8 layer's fused elementwise ops: the torch formulation they replaced, bitwise
# ------------------------------------------------------------------------------------------

def _layer_rows(M, I, seed):
    """dz, y bf16 [M, I] (magnitudes 2^-20 .. 2^12 per row, zero rows) and route weights."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-20, 13, (M, 1), generator=gen).float())
    y = (torch.randn(M, I, generator=gen) * mag).bfloat16()
    dz = (torch.randn(M, I, generator=gen) * mag.flip(0)).bfloat16()
    w = torch.rand(M, generator=gen)
    if M > 3:
        w[1] = 0.0                                  # a padding row's weight
        dz[2] = 0.0                                 # an all-zero row -> the floor scale
    return dz, y, w


FUSED_SHAPES = [(0, 16), (1, 16), (5, 300), (37, 200), (20, 272)]


@pytest.mark.parametrize("M,I", FUSED_SHAPES)
def test_scale_rows_is_the_torch_formulation(M, I):
    _, y, w = _layer_rows(M, I, seed=M + I)
    want = (y.float() * w[:, None]).to(torch.bfloat16)          # moe_experts_fp8's old z
    for got in (qf.scale_rows(y, w), torch.ops.moonep.scale_rows(y, w)):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("M,I", FUSED_SHAPES)
def test_scale_rows_backward_is_the_torch_formulation(M, I, pow2):
    dz, y, w = _layer_rows(M, I, seed=3 * M + I + int(pow2))
    dzf = dz.float()                                             # the backward's old lines
    dy = (dzf * w[:, None]).to(torch.bfloat16)
    d_rows = (dzf * y.float()).sum(-1)
    q, s = torch.ops.moonep.quantize_fp8_rows(dy, pow2)
    for got in (qf.scale_rows_backward(dz, w, y, pow2),
                torch.ops.moonep.scale_rows_backward_fp8(dz, w, y, pow2)):
        gdy, gq, gs, gp = got
        assert torch.equal(gdy, dy) and gdy.dtype == torch.bfloat16
        assert same(gq, q) and torch.equal(gs, s)
        assert gp.dtype == torch.float32 and torch.equal(gp, d_rows)


@pytest.mark.parametrize("M,I", FUSED_SHAPES)
def test_scale_rows_autograd_is_the_torch_formulation(M, I):
    """The bf16 layer's z = scale_rows(y, w): its grads (moonep::scale_rows_backward) are
    bitwise those torch's autograd gives the formulation it replaced, on the CPU."""
    dz, y, w = _layer_rows(M, I, seed=7 * M + I)
    grads = []
    for f in (lambda y, w: (y * w[:, None]).to(torch.bfloat16), torch.ops.moonep.scale_rows):
        yr, wr = y.clone().requires_grad_(True), w.clone().requires_grad_(True)
        f(yr, wr).backward(dz)
        grads.append((yr.grad, wr.grad))
    (gy0, gw0), (gy1, gw1) = grads
    assert gy1.dtype == torch.bfloat16 and torch.equal(gy1, gy0)
    assert gw1.dtype == torch.float32 and torch.equal(gw1, gw0)
    dy, d_rows = torch.ops.moonep.scale_rows_backward(dz, w, y)
    assert torch.equal(dy, gy0) and torch.equal(d_rows, gw0)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("M,I", FUSED_SHAPES)
def test_dequantize_fp8_rows_is_the_torch_formulation(M, I, pow2):
    _, y, _ = _layer_rows(M, I, seed=5 * M + I)
    q, s = qf.quantize_rows(y, pow2)
    want = qf.dequantize_rows(q, s).to(torch.bfloat16)           # the backward's old h_bf
    for got in (qf.dequantize_rows_bf16(q, s), torch.ops.moonep.dequantize_fp8_rows(q, s)):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_fused_layer_ops_opcheck():
    dz, y, w = _layer_rows(37, 200, seed=11)
    opcheck(torch.ops.moonep.scale_rows.default, (y, w.requires_grad_(True)))
    w = w.detach()
    opcheck(torch.ops.moonep.scale_rows_backward.default, (dz, w, y))
    for pow2 in (False, True):
        opcheck(torch.ops.moonep.scale_rows_backward_fp8.default, (dz, w, y, pow2))
        q, s = qf.quantize_rows(y, pow2)
        args = (q, s)
        opcheck(torch.ops.moonep.dequantize_fp8_rows.default, args, test_utils=E4M3_INPUT_CHECKS)
        no_mutation_no_alias(torch.ops.moonep.dequantize_fp8_rows.default, args)
    with torch.device("meta"):                                   # the fakes: a GPU-sized call
        dz, y, w = torch.empty(32768, 7168, dtype=torch.bfloat16), None, torch.empty(32768)
        assert torch.ops.moonep.scale_rows(dz, w).shape == (32768, 7168)
        dy, q, s, p = torch.ops.moonep.scale_rows_backward_fp8(dz, w, dz, False)
        dy2, p2 = torch.ops.moonep.scale_rows_backward(dz, w, dz)
        assert (dy2.shape, dy2.dtype, p2.shape, p2.dtype) == (
            (32768, 7168), torch.bfloat16, (32768,), torch.float32)
        assert (dy.dtype, q.dtype, s.shape, p.shape, p.dtype) == (
            torch.bfloat16, E4M3, (32768, 56), (32768,), torch.float32)
        h = torch.ops.moonep.dequantize_fp8_rows(q, s)
        assert h.shape == (32768, 7168) and h.dtype == torch.bfloat16


def test_fused_layer_ops_bad_input():
    dz, y, w = _layer_rows(6, 144, seed=2)
    with pytest.raises(qf.FP8ArgumentError, match="bfloat16"):
        torch.ops.moonep.scale_rows(y.float(), w)
    with pytest.raises(qf.FP8ArgumentError, match="row_weights"):
        torch.ops.moonep.scale_rows(y, w.double())
    with pytest.raises(qf.FP8ArgumentError, match="row_weights"):
        torch.ops.moonep.scale_rows(y, w[:5])
    with pytest.raises(ValueError, match="must match"):
        torch.ops.moonep.scale_rows_backward_fp8(dz, w, y[:, :128], False)
    with pytest.raises(ValueError, match="must match"):
        torch.ops.moonep.scale_rows_backward(dz, w, y[:, :128])
    with pytest.raises(ValueError, match="2-D"):
        qf.scale_rows(y[None], w)
    with pytest.raises(qf.FP8ArgumentError, match="pow2_scales"):
        qf.scale_rows_backward(dz, w, y, 1)
    q, s = qf.quantize_rows(y)
    with pytest.raises(ValueError, match="scale"):
        torch.ops.moonep.dequantize_fp8_rows(q, s[:, :1])
    with pytest.raises(qf.FP8ArgumentError, match="e4m3"):
        torch.ops.moonep.dequantize_fp8_rows(y, s)


# ------------------------------------------------------------------------------------------
# the FP8 grouped GEMMs against dequantise-then-matmul
# ------------------------------------------------------------------------------------------

def _naive(aq, as_, wlq, wls, wsq, wss, cu, dgrad):
    """Row by row in fp64: W_g x (forward) or dy W_g (dgrad), W_g dequantised."""
    a = naive_dequant_rows(aq, as_)
    epn = wlq.shape[0]
    W = [naive_dequant_block(wlq[b], wls[b]) for b in range(epn)] + \
        [naive_dequant_block(wsq[b], wss[b]) for b in range(epn)]
    out = torch.zeros(aq.shape[0], wlq.shape[2 if dgrad else 1], dtype=torch.float64)
    for r, g in enumerate(group_of_rows(cu, aq.shape[0])):
        if g < len(cu):
            out[r] = a[r] @ W[g] if dgrad else W[g] @ a[r]
    return out


def naive_fwd(xq, xs, wlq, wls, wsq, wss, cu):
    return _naive(xq, xs, wlq, wls, wsq, wss, cu, dgrad=False)


def naive_dgrad(dq, ds, wlq, wls, wsq, wss, cu):
    return _naive(dq, ds, wlq, wls, wsq, wss, cu, dgrad=True)


def close_to_bf16_rounding(y, ref):
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, rtol=2.0 ** -8,
                               atol=1e-6 * float(ref.abs().max().clamp_min(1e-30)))


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("case", list(COUNTS))
def test_grouped_mm_fp8_equals_dequantise_then_matmul(case, pow2):
    _, _, _, ops = operands(COUNTS[case], seed=1, pow2=pow2)
    y = g8.grouped_mm_fp8(*ops)
    assert y.shape == (ops[0].shape[0], 144)
    close_to_bf16_rounding(y, naive_fwd(*ops))
    assert torch.all(y[int(ops[-1][-1]):] == 0), "padding rows are zero"


@pytest.mark.parametrize("case", ["skewed", "one_group", "all_empty"])
def test_grouped_mm_fp8_dgrad_equals_dequantise_then_matmul(case):
    counts = COUNTS[case]
    _, _, _, (xq, xs, wlq, wls, wsq, wss, cu) = operands(counts, seed=2)
    dy = torch.randn(xq.shape[0], 144).bfloat16()
    dq, ds = qf.quantize_rows(dy)
    dx = g8.grouped_mm_fp8_dgrad(dq, ds, wlq, wls, wsq, wss, cu)
    assert dx.shape == (xq.shape[0], 160)
    close_to_bf16_rounding(dx, naive_dgrad(dq, ds, wlq, wls, wsq, wss, cu))
    assert torch.all(dx[int(cu[-1]):] == 0)


def test_padding_rows_are_not_read():
    _, _, _, (xq, xs, *rest) = operands(COUNTS["skewed"], pad=4, seed=3)
    end = int(rest[-1][-1])
    xs2 = xs.clone()
    xs2[end:] = float("nan")
    xq2 = xq.clone()
    xq2.view(torch.uint8)[end:] = 0x7F                                 # e4m3 NaN
    assert torch.equal(g8.grouped_mm_fp8(xq2, xs2, *rest), g8.grouped_mm_fp8(xq, xs, *rest))


# ------------------------------------------------------------------------------------------
# the differentiable recipe: grouped_linear_fp8
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pow2", [False, True])
def test_grouped_linear_fp8_forward_and_backward_follow_the_recipe(pow2):
    counts = COUNTS["skewed"]
    epn = len(counts) // 2
    x, wl, ws, (xq, xs, wlq, wls, wsq, wss, cu) = operands(counts, seed=4, pow2=pow2)
    xr, wlr, wsr = (t.clone().requires_grad_(True) for t in (x, wl, ws))
    y = g8.grouped_linear_fp8(xr, wlr, wsr, cu, pow2_scales=pow2)
    assert same(y, g8.grouped_mm_fp8(xq, xs, wlq, wls, wsq, wss, cu))
    dy = torch.randn(y.shape).bfloat16()
    y.backward(dy)
    # dgrad in FP8: dy per 1 x 128 tile along O, the weights' own blocks (transposed)
    dq, ds = qf.quantize_rows(dy, pow2)
    assert same(xr.grad, g8.grouped_mm_fp8_dgrad(dq, ds, wlq, wls, wsq, wss, cu))
    # wgrad from the kept bf16 x (fp32 accumulation, bf16 out), not from its e4m3 copy
    ref = torch.zeros(2 * epn, 144, 160, dtype=torch.float64)
    for r, g in enumerate(group_of_rows(cu, x.shape[0])):
        if g < len(cu):
            ref[g] += torch.outer(dy[r].double(), x[r].double())
    got = torch.cat([wlr.grad, wsr.grad]).double()
    assert wlr.grad.dtype == torch.bfloat16
    rel = float((got - ref).norm() / ref.norm())
    assert rel < 2.0 ** -8
    xd = naive_dequant_rows(xq, xs)
    ref_q = torch.zeros_like(ref)
    for r, g in enumerate(group_of_rows(cu, x.shape[0])):
        if g < len(cu):
            ref_q[g] += torch.outer(dy[r].double(), xd[r])
    assert float((got - ref_q).norm() / ref_q.norm()) > 4 * rel, "wgrad used the e4m3 x"


def test_grouped_linear_fp8_partial_requires_grad():
    x, wl, ws, (*_, cu) = operands(COUNTS["skewed"], seed=5)
    wl.requires_grad_(True)
    g8.grouped_linear_fp8(x, wl, ws, cu).float().sum().backward()
    assert wl.grad is not None and x.grad is None and ws.grad is None


def test_grouped_linear_fp8_close_to_bf16():
    """Sanity of the recipe against the bf16 op on the same values: e4m3's 3 mantissa bits on
    both operands (~2.6 % RMS each) leave ~4 % relative error on y."""
    x, wl, ws, (*_, cu) = operands(COUNTS["skewed"], seed=6)
    y8 = g8.grouped_linear_fp8(x, wl, ws, cu)
    yb = gm.grouped_mm(x.float(), wl.float(), ws.float(), cu)
    rel = float((y8.float() - yb).norm() / yb.norm())
    assert 1e-3 < rel < 8e-2, rel


# ------------------------------------------------------------------------------------------
# opcheck, fake tensors, compile
# ------------------------------------------------------------------------------------------

# opcheck's test_schema compares every input before and after the call with torch.allclose,
# which has no e4m3 kernel on the CPU: for ops with e4m3 inputs it runs the other three checks,
# and the schema's claim (no input mutated, the output aliases none) is checked bitwise below.
E4M3_INPUT_CHECKS = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")


def no_mutation_no_alias(op, args):
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = op(*args)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            assert same(a, b), "an input was mutated"
            assert out.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()


@pytest.mark.parametrize("case", ["skewed", "all_empty"])
def test_opcheck_fp8_gemms(case):
    x, wl, ws, (xq, xs, wlq, wls, wsq, wss, cu) = operands(COUNTS[case], seed=7)
    args = (xq, xs, wlq, wls, wsq, wss, cu)
    opcheck(torch.ops.moonep.grouped_mm_fp8.default, args, test_utils=E4M3_INPUT_CHECKS)
    no_mutation_no_alias(torch.ops.moonep.grouped_mm_fp8.default, args)
    dq, ds = qf.quantize_rows(torch.randn(xq.shape[0], 144))
    args = (dq, ds, wlq, wls, wsq, wss, cu)
    opcheck(torch.ops.moonep.grouped_mm_fp8_dgrad.default, args, test_utils=E4M3_INPUT_CHECKS)
    no_mutation_no_alias(torch.ops.moonep.grouped_mm_fp8_dgrad.default, args)
    for rg in (False, True):
        args = [t.clone().requires_grad_(rg) for t in (x, wl, ws)]
        opcheck(torch.ops.moonep.grouped_linear_fp8.default, (*args, cu, False))


@pytest.mark.parametrize("device", ["meta"] + (["cuda"] if torch.cuda.is_available() else []))
def test_fake_shapes(device):
    """The fakes alone (meta tensors: no data, no kernel), the shapes of a GPU-sized call."""
    with torch.device(device):
        xq = torch.empty(100, 256, dtype=E4M3)
        xs = torch.empty(100, 2, dtype=torch.float32)
        w = torch.empty(4, 128, 256, dtype=E4M3)
        s = torch.empty(4, 1, 2, dtype=torch.float32)
        cu = torch.empty(8, dtype=torch.int32)
        y = g8.grouped_mm_fp8(xq, xs, w, s, w, s, cu)
        assert y.shape == (100, 128) and y.dtype == torch.bfloat16 and y.device.type == device
        yq, ys = qf.quantize_fp8_rows(y)
        assert yq.dtype == E4M3 and ys.shape == (100, 1)
        dx = g8.grouped_mm_fp8_dgrad(yq, ys, w, s, w, s, cu)
        assert dx.shape == (100, 256)
        wt, st = qf.quantize_fp8_blocks(torch.empty(4, 384, 256), transpose=True)
        assert wt.shape == (4, 256, 384) and wt.dtype == E4M3 and st.shape == (4, 2, 3)
        with pytest.raises(ValueError, match="multiple of 16"):
            w200 = w[:, :, :200].contiguous()
            g8.grouped_mm_fp8(xq[:, :200].contiguous(), xs, w200, s, w200, s, cu)


def test_compile_fullgraph_aot_eager():
    torch._dynamo.reset()
    x, wl, ws, (*_, cu) = operands(COUNTS["skewed"], seed=8)

    def f(a, b, c):
        return g8.grouped_linear_fp8(a, b, c, cu).float().square().sum()

    grads = []
    for fn in (torch.compile(f, backend="aot_eager", fullgraph=True), f):
        args = [t.clone().requires_grad_(True) for t in (x, wl, ws)]
        fn(*args).backward()
        grads.append([a.grad for a in args])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------
# bad input: a clear ValueError / TypeError before any kernel runs
# ------------------------------------------------------------------------------------------

def _bad_cases():
    _, _, _, (xq, xs, wlq, wls, wsq, wss, cu) = operands(COUNTS["skewed"], seed=9)
    _, _, _, (_, _, wq2, ws2, _, _, _) = operands(COUNTS["skewed"], O=136, seed=9)
    return [
        ("x bf16", (xq.bfloat16(), xs, wlq, wls, wsq, wss, cu), ValueError, "e4m3"),
        ("w bf16", (xq, xs, wlq.bfloat16(), wls, wsq, wss, cu), ValueError, "e4m3"),
        ("x scale fp16", (xq, xs.half(), wlq, wls, wsq, wss, cu), ValueError, "float32"),
        ("x scale shape", (xq, xs[:, :1], wlq, wls, wsq, wss, cu), ValueError, r"ceil\(I/128\)"),
        ("w scale shape", (xq, xs, wlq, wls[:, :, :1], wsq, wss, cu), ValueError, "128x128"),
        ("x scale transposed", (xq, xs.t().contiguous().t(), wlq, wls, wsq, wss, cu),
         ValueError, "contiguous"),
        ("x cols", (xq[:, :144].contiguous(), xs, wlq, wls, wsq, wss, cu), ValueError,
         "columns"),
        ("slot shape", (xq, xs, wlq, wls, wsq[:1], wss[:1], cu), ValueError, "same shape"),
        ("O not 16x", (xq, xs, wq2, ws2, wq2, ws2, cu), ValueError, "O=136 must be a multiple of 16"),
        ("cu int64", (xq, xs, wlq, wls, wsq, wss, cu.long()), ValueError, "int32"),
        ("cu decreasing", (xq, xs, wlq, wls, wsq, wss,
                           torch.tensor([5, 4, 6, 7, 8, 9], dtype=torch.int32)), ValueError,
         "non-decreasing"),
        # the dispatcher itself refuses a non-tensor for a Tensor argument, before the op runs
        ("not a tensor", (xq, xs.tolist(), wlq, wls, wsq, wss, cu), RuntimeError,
         "Expected a value of type 'Tensor'"),
    ]


@pytest.mark.parametrize("name,args,exc,msg", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_fp8_gemm(name, args, exc, msg, monkeypatch):
    calls = []
    monkeypatch.setattr(g8, "_ref", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(g8, "_launch", lambda *a, **k: calls.append(1))
    with pytest.raises(exc, match=msg):
        g8.grouped_mm_fp8(*args)
    assert not calls, "a kernel ran before the check"


def test_bad_input_grouped_linear_fp8():
    x, wl, ws, (*_, cu) = operands(COUNTS["skewed"], seed=10)
    with pytest.raises(ValueError, match="multiple of 16"):
        g8.grouped_linear_fp8(x[:, :152], wl[:, :, :152], ws[:, :, :152], cu)
    with pytest.raises(TypeError, match="floating"):
        g8.grouped_linear_fp8(x.to(E4M3), wl, ws, cu)
    with pytest.raises(TypeError, match="dtype"):
        g8.grouped_linear_fp8(x.float(), wl, ws, cu)
    with pytest.raises(ValueError, match=r"\(torch.float32\) and w_slot_BOI \(torch.bfloat16\) differ"):       # ValueError too
        g8.grouped_linear_fp8(x, wl.float(), ws, cu)


def test_backend_choice_on_cpu():
    assert g8.backend_for_fp8(torch.empty(1)) == "reference"
