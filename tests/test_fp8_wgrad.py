"""The FP8 weight gradient on CPU: the token-major quantisers
(moonep_ops/ops/quantize_fp8_tokens.py), moonep::grouped_mm_fp8_wgrad(_into)
(moonep_ops/ops/grouped_mm_fp8_wgrad.py), its cost model's host mirror
(moonep_ops/gemm/fp8_wgrad_cost.py) against the kernel source, and the ABI gate in native.py.

Oracles written here, independently of the library: per-group, per-tile, per-feature loops for
the token tiles' scales (numpy float32) and elements (torch's own e4m3 cast is the one shared
primitive), the tile map t0_g = floor(s_g / 128) + g re-derived by hand, dequantisation by loops.
The GPU side (the kernels against these references) is tests/test_fp8_wgrad_cuda.py.
"""
from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.library import opcheck

import moonep_ops  # noqa: F401  (registers the ops)
from moonep_ops import native
from moonep_ops.gemm import fp8_wgrad_cost as wc
from moonep_ops.gemm import tuning_fp8_wgrad
from moonep_ops.ops import grouped_mm_fp8_wgrad as gw
from moonep_ops.ops import quantize_fp8 as qf
from moonep_ops.ops import quantize_fp8_tokens as qt

ROOT = Path(__file__).resolve().parent.parent
E4M3 = torch.float8_e4m3fn
NAN_BITS = 0x7FC00000


# ------------------------------------------------------------------------------------------
# helpers and oracles
# ------------------------------------------------------------------------------------------

def cu_of(counts):
    return torch.tensor(np.cumsum(counts), dtype=torch.int32)


# group sizes: token_padding 1 (groups start anywhere), 128-aligned, empty groups, all empty,
# one-row groups, one hot group, a tail of padding rows past the last group
COUNTS = {
    "tp1": ([130, 1, 269, 0, 250, 77], 740),
    "aligned": ([256, 128, 0, 384, 128, 0], 1024),
    "empty_mid": ([0, 0, 5, 0, 0, 300], 330),
    "all_empty": ([0, 0, 0, 0], 200),
    "singles": ([1, 1, 1, 1, 1, 1], 6),
    "hot": ([1000, 3, 0, 0, 0, 17], 1100),
}


def naive_scale(amax, pow2):
    if not math.isfinite(amax):
        return np.array([NAN_BITS], dtype=np.uint32).view(np.float32)[0]
    s = max(np.float32(amax) / np.float32(448.0), np.float32(2.0 ** -126))
    if pow2:
        s = np.float32(2.0 ** math.ceil(math.log2(float(s))))
    return np.float32(s)


def oracle_tokens(xf, counts, pow2):
    """(qT uint8, sT fp32, used columns mask) by loops, from an fp32 [M, I] tensor."""
    M, I = xf.shape
    G = len(counts)
    Nb = M // 128 + G
    qT = torch.zeros(I, Nb * 128, dtype=torch.uint8)
    sT = torch.zeros(Nb, I, dtype=torch.float32)
    used = torch.zeros(Nb, dtype=torch.bool)
    s = 0
    for g, m in enumerate(counts):
        t0 = s // 128 + g
        for b in range((m + 127) // 128):
            r0, r1 = s + 128 * b, min(s + 128 * b + 128, s + m)
            t = t0 + b
            assert not used[t], "two groups' tiles overlap"
            used[t] = True
            for i in range(I):
                col = xf[r0:r1, i]
                amax = float(col.abs().max()) if bool(torch.isfinite(col).all()) else math.inf
                sc = naive_scale(amax, pow2)
                sT[t, i] = float(sc)
                if not math.isfinite(amax):
                    qT[i, t * 128:t * 128 + (r1 - r0)] = 0x7F
                else:
                    v = torch.clamp(col / torch.tensor(sc), -448, 448).to(E4M3)
                    qT[i, t * 128:t * 128 + (r1 - r0)] = v.view(torch.uint8)
        s += m
    return qT, sT, used


def same_bits(a, b):
    if a.dtype == E4M3:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    elif a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and bool(torch.equal(a, b))


def used_cols(used):
    return used.repeat_interleave(128)


# ------------------------------------------------------------------------------------------
# the token quantiser
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("case", sorted(COUNTS))
def test_tokens_match_the_oracle(case, pow2):
    counts, M = COUNTS[case]
    torch.manual_seed(1)
    x = (torch.randn(M, 160) * torch.logspace(-3, 2, 160)).bfloat16()
    cu = cu_of(counts)
    qT, sT = qt.quantize_fp8_tokens(x, cu, pow2_scales=pow2)
    oq, os_, used = oracle_tokens(x.float(), counts, pow2)
    assert qT.shape == (160, 128 * (M // 128 + len(counts))) and qT.dtype == E4M3
    assert sT.shape == (M // 128 + len(counts), 160) and sT.dtype == torch.float32
    cols = used_cols(used)
    assert same_bits(qT[:, cols].contiguous(), oq.view(E4M3)[:, cols].contiguous())
    assert same_bits(sT[used].contiguous(), os_[used].contiguous())
    # the reference's unused tiles: q 0, scale 0 (the CUDA kernels leave them unwritten)
    assert not qT.view(torch.uint8)[:, ~cols].any() and not sT[~used].any()


def test_tile_map_never_crosses_a_group_and_fits():
    """t0_g = floor(s_g/128) + g: tiles of distinct groups never overlap and end by Nb, for
    every placement of group boundaries (exhaustive over small cases)."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        G = int(rng.integers(1, 9))
        counts = rng.integers(0, 400, size=G)
        counts[rng.random(G) < 0.3] = 0
        M = int(counts.sum() + rng.integers(0, 300))
        Nb = qt.token_tiles(M, G)
        taken = np.zeros(Nb, dtype=bool)
        for g, s, e, t0 in qt.group_tiles(cu_of(counts), M):
            nb = -(-(e - s) // 128)
            assert t0 + nb <= Nb
            assert not taken[t0:t0 + nb].any()
            taken[t0:t0 + nb] = True


def test_tokens_from_e4m3_rows_dequantise_in_fp32_first():
    counts, M = COUNTS["tp1"]
    torch.manual_seed(2)
    h, hs = qf.quantize_rows(torch.randn(M, 272) * 3)
    cu = cu_of(counts)
    qT, sT = qt.quantize_fp8_tokens(h, cu, x_scale=hs)
    oq, os_, used = oracle_tokens(qf.dequantize_rows(h, hs), counts, False)
    cols = used_cols(used)
    assert same_bits(qT[:, cols].contiguous(), oq.view(E4M3)[:, cols].contiguous())
    assert same_bits(sT[used].contiguous(), os_[used].contiguous())


def test_dequantised_tokens_are_close():
    """|x - deq| <= 2^-4 |x| (normal e4m3) or 2^-10 s (subnormal), per element."""
    counts, M = COUNTS["hot"]
    torch.manual_seed(3)
    x = torch.randn(M, 144) * 5
    cu = cu_of(counts)
    qT, sT = qt.quantize_fp8_tokens(x, cu)
    d = qt.dequantize_tokens(qT, sT, cu, M)
    rows = int(cu[-1])
    err = (d[:rows] - x[:rows]).abs()
    # the scale of each element, by rows of its tile
    sc = torch.zeros(rows, 144)
    for g, s, e, t0 in qt.group_tiles(cu, M):
        for r in range(s, e):
            sc[r] = sT[t0 + (r - s) // 128]
    bound = torch.maximum(x[:rows].abs() * 2.0 ** -4, sc * 2.0 ** -10)
    assert bool((err <= bound).all())
    assert not d[rows:].any()


def test_nonfinite_poisons_only_its_tile_and_feature():
    counts, M = COUNTS["tp1"]
    torch.manual_seed(4)
    x = torch.randn(M, 144).bfloat16()
    cu = cu_of(counts)
    q0, s0 = qt.quantize_fp8_tokens(x, cu)
    for val in (float("nan"), float("inf"), -float("inf")):
        xb = x.clone()
        xb[140, 17] = val                     # group 2 (rows 131..399), its first tile
        q1, s1 = qt.quantize_fp8_tokens(xb, cu)
        t = 131 // 128 + 2
        assert s1[t, 17].view(torch.int32) == NAN_BITS
        col = q1.view(torch.uint8)[17, t * 128:t * 128 + 128]
        assert bool((col == 0x7F).all())      # the tile holds 128 valid rows (131..258)
        s1[t, 17] = s0[t, 17]
        q1.view(torch.uint8)[17, t * 128:t * 128 + 128] = q0.view(torch.uint8)[17, t * 128:
                                                                                t * 128 + 128]
        assert same_bits(q1, q0) and same_bits(s1, s0)


def test_nonfinite_partial_tile_keeps_zero_padding():
    counts, M = [5, 3], 8
    x = torch.randn(M, 16)
    x[6, 0] = float("nan")
    qT, sT = qt.quantize_fp8_tokens(x, cu_of(counts))
    t = 5 // 128 + 1
    col = qT.view(torch.uint8)[0, t * 128:t * 128 + 128]
    assert bool((col[:3] == 0x7F).all()) and not col[3:].any()


def test_rows_tokens_is_both_quantisers():
    for case in ("tp1", "empty_mid"):
        counts, M = COUNTS[case]
        x = torch.randn(M, 176).bfloat16()
        cu = cu_of(counts)
        for pow2 in (False, True):
            q, s, qT, sT = qt.quantize_fp8_rows_tokens(x, cu, pow2_scales=pow2)
            rq, rs = qf.quantize_rows(x, pow2)
            tq, ts = qt.quantize_fp8_tokens(x, cu, pow2_scales=pow2)
            assert same_bits(q, rq) and same_bits(s, rs)
            assert same_bits(qT, tq) and same_bits(sT, ts)


def test_scale_rows_backward_tokens_is_the_fused_op_plus_tokens():
    counts, M = COUNTS["tp1"]
    torch.manual_seed(5)
    dz, y = torch.randn(M, 160).bfloat16(), torch.randn(M, 160).bfloat16()
    w = torch.rand(M)
    cu = cu_of(counts)
    for pow2 in (False, True):
        q, s, qT, sT, d = qt.scale_rows_backward_fp8_tokens(dz, w, y, cu, pow2_scales=pow2)
        dy, rq, rs, rd = qf.scale_rows_backward(dz, w, y, pow2)
        tq, ts = qt.quantize_fp8_tokens(dy, cu, pow2_scales=pow2)
        assert same_bits(q, rq) and same_bits(s, rs) and same_bits(d, rd)
        assert same_bits(qT, tq) and same_bits(sT, ts)


# ------------------------------------------------------------------------------------------
# the wgrad op
# ------------------------------------------------------------------------------------------

def wgrad_operands(counts, M, O=144, I=160, seed=0, pow2=False):
    g = torch.Generator().manual_seed(seed)
    dy = (torch.randn(M, O, generator=g) * torch.logspace(-2, 1, O)).bfloat16()
    x = torch.randn(M, I, generator=g).bfloat16()
    cu = cu_of(counts)
    a, sa = qt.quantize_fp8_tokens(dy, cu, pow2_scales=pow2)
    b, sb = qt.quantize_fp8_tokens(x, cu, pow2_scales=pow2)
    return dy, x, cu, (a, sa, b, sb)


def naive_dequant_tokens(qT, sT, counts, M):
    """fp32 [M, F] by loops over groups, tiles and rows (q * s: one fp32 product each)."""
    F = qT.shape[0]
    out = torch.zeros(M, F)
    s = 0
    for g, m in enumerate(counts):
        t0 = s // 128 + g
        for r in range(m):
            t = t0 + r // 128
            out[s + r] = qT[:, t * 128 + r % 128].float() * sT[t]
        s += m
    return out


@pytest.mark.parametrize("case", sorted(COUNTS))
def test_reference_is_dequantise_then_matmul_exactly(case):
    counts, M = COUNTS[case]
    epn = len(counts) // 2
    _, _, cu, (a, sa, b, sb) = wgrad_operands(counts, M, seed=6)
    gl, gs = gw.grouped_mm_fp8_wgrad(a, sa, b, sb, cu, epn)
    da, db = naive_dequant_tokens(a, sa, counts, M), naive_dequant_tokens(b, sb, counts, M)
    assert same_bits(da, qt.dequantize_tokens(a, sa, cu, M))
    s = 0
    for g, m in enumerate(counts):
        got = gl[g] if g < epn else gs[g - epn]
        if m == 0:
            assert not got.any(), "an empty group's dW is zero"
        else:
            want = (da[s:s + m].t() @ db[s:s + m]).to(torch.bfloat16)
            assert same_bits(got.view(torch.int16), want.view(torch.int16)), g
        s += m


@pytest.mark.parametrize("pow2", [False, True])
def test_wgrad_error_against_bf16(pow2):
    """The FP8 wgrad against the exact fp64 dW of the bf16 operands: ~2.6 % RMS per e4m3
    operand, so a few % relative (Frobenius) per non-empty group."""
    counts, M = [512, 300, 0, 129], 1000
    dy, x, cu, (a, sa, b, sb) = wgrad_operands(counts, M, seed=7, pow2=pow2)
    gl, gs = gw.grouped_mm_fp8_wgrad(a, sa, b, sb, cu, 2)
    s = 0
    for g, m in enumerate(counts):
        got = (gl[g] if g < 2 else gs[g - 2]).double()
        ref = dy[s:s + m].double().t() @ x[s:s + m].double()
        if m:
            rel = float((got - ref).norm() / ref.norm())
            assert 5e-3 < rel < 6e-2, (g, rel)
        s += m


def test_into_semantics():
    """grouped_mm_wgrad_into's contract: every local dW written (empty groups zeroed), a slot's
    dW written when its group has rows, an empty slot group's left as it was."""
    counts, M = [300, 0, 0, 0, 40, 0], 400         # local: 300, 0, 0; slots: 0, 40, 0
    _, _, cu, (a, sa, b, sb) = wgrad_operands(counts, M, seed=8)
    gl = torch.full((3, 144, 160), 7.0, dtype=torch.bfloat16)
    gs = torch.full((3, 144, 160), 7.0, dtype=torch.bfloat16)
    gw.grouped_mm_fp8_wgrad_into(a, sa, b, sb, cu, gl, gs)
    rl, rs = gw.grouped_mm_fp8_wgrad(a, sa, b, sb, cu, 3)
    assert torch.equal(gl, rl) and not rl[1:].any()
    assert rl[0].any() and rs[1].any()
    assert torch.equal(gs[1], rs[1])
    for b_ in (0, 2):
        assert torch.equal(gs[b_], torch.full_like(gs[b_], 7.0))


def test_argument_errors_before_any_work():
    counts, M = [10, 20], 30
    _, _, cu, (a, sa, b, sb) = wgrad_operands(counts, M, seed=10)
    op = gw.grouped_mm_fp8_wgrad
    E = qf.FP8ArgumentError
    with pytest.raises(E, match="e4m3"):
        op(a.view(torch.uint8), sa, b, sb, cu, 1)
    with pytest.raises(E, match="float32"):
        op(a, sa.double(), b, sb, cu, 1)
    with pytest.raises(ValueError, match="multiple of 128"):
        op(a[:, :200].contiguous(), sa, b, sb, cu, 1)
    with pytest.raises(ValueError, match="one scale per 128-token tile"):
        op(a, sa[:-1].contiguous(), b, sb, cu, 1)
    with pytest.raises(ValueError, match="same buffer"):
        op(a, sa, b[:, :128].contiguous(), sb[:1].contiguous(), cu, 1)
    with pytest.raises(ValueError, match="multiple of 16"):
        op(a[:136].contiguous(), sa[:, :136].contiguous(), b, sb, cu, 1)
    with pytest.raises(ValueError, match="length G = 2"):
        op(a, sa, b, sb, cu, 2)
    with pytest.raises(E, match="int32"):
        op(a, sa, b, sb, cu.long(), 1)
    with pytest.raises(ValueError, match="non-decreasing"):
        op(a, sa, b, sb, torch.tensor([20, 10], dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="contiguous"):
        op(a.t().contiguous().t(), sa, b, sb, cu, 1)
    with pytest.raises(E, match="epn"):
        op(a, sa, b, sb, cu, 0)
    gl = torch.zeros(1, 144, 160, dtype=torch.bfloat16)
    with pytest.raises(E, match="bfloat16"):
        gw.grouped_mm_fp8_wgrad_into(a, sa, b, sb, cu, gl.float(), gl.clone())
    with pytest.raises(ValueError, match=r"\[epn, O, I\]"):
        gw.grouped_mm_fp8_wgrad_into(a, sa, b, sb, cu, gl, gl[:, :, :144].contiguous())
    with pytest.raises(ValueError, match="overlap"):
        gw.grouped_mm_fp8_wgrad_into(a, sa, b, sb, cu, gl, gl)
    with pytest.raises(E, match="bool"):      # (torch.ops coerces ints to bool: the reference)
        qt.quantize_tokens(torch.randn(30, 16), cu, pow2_scales=1)
    with pytest.raises(ValueError, match="non-decreasing"):
        qt.quantize_fp8_tokens(torch.randn(4, 16), cu)       # cu[-1] = 30 > M = 4
    with pytest.raises(E, match="floating"):
        qt.quantize_fp8_tokens(torch.zeros(30, 16, dtype=torch.int32), cu)
    with pytest.raises(ValueError, match="ceil"):
        qt.quantize_fp8_tokens(a.t().contiguous()[:30], cu, x_scale=torch.ones(30, 1))


# ------------------------------------------------------------------------------------------
# opcheck, schemas, fakes, compile
# ------------------------------------------------------------------------------------------

# opcheck's test_schema compares inputs with torch.allclose, which has no e4m3 CPU kernel: for
# ops with e4m3 inputs the other three checks run (as tests/test_fp8_ops.py does).
E4M3_INPUT_CHECKS = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("case", ["tp1", "all_empty", "aligned"])
def test_opcheck_new_ops(case):
    counts, M = COUNTS[case]
    epn = len(counts) // 2
    dy, x, cu, (a, sa, b, sb) = wgrad_operands(counts, M, seed=11)
    for pow2 in (False, True):
        opcheck(torch.ops.moonep.quantize_fp8_tokens.default, (x, cu, None, pow2))
        opcheck(torch.ops.moonep.quantize_fp8_rows_tokens.default, (dy, cu, pow2))
        opcheck(torch.ops.moonep.scale_rows_backward_fp8_tokens.default,
                (dy, torch.rand(M), x[:, :144].contiguous(), cu, pow2))
    h, hs = qf.quantize_rows(x.float())
    opcheck(torch.ops.moonep.quantize_fp8_tokens.default, (h, cu, hs, False),
            test_utils=E4M3_INPUT_CHECKS)
    opcheck(torch.ops.moonep.grouped_mm_fp8_wgrad.default, (a, sa, b, sb, cu, epn),
            test_utils=E4M3_INPUT_CHECKS)
    gl = torch.zeros(epn, 144, 160, dtype=torch.bfloat16)
    gs = torch.zeros(epn, 144, 160, dtype=torch.bfloat16)
    opcheck(torch.ops.moonep.grouped_mm_fp8_wgrad_into.default, (a, sa, b, sb, cu, gl, gs),
            test_utils=E4M3_INPUT_CHECKS)
    # the schema's claims for the e4m3-input ops, checked bitwise: no input mutated
    before = [t.clone() for t in (a, sa, b, sb, cu)]
    gw.grouped_mm_fp8_wgrad(a, sa, b, sb, cu, epn)
    assert all(same_bits(t, u) for t, u in zip((a, sa, b, sb, cu), before))


def test_schemas():
    names = ["quantize_fp8_tokens", "quantize_fp8_rows_tokens", "scale_rows_backward_fp8_tokens",
             "grouped_mm_fp8_wgrad", "grouped_mm_fp8_wgrad_into"]
    got = [str(getattr(torch.ops.moonep, n).default._schema) for n in names]
    assert got == [
        "moonep::quantize_fp8_tokens(Tensor x, Tensor cu_seqlens, Tensor? x_scale=None, "
        "bool pow2_scales=False) -> (Tensor, Tensor)",
        "moonep::quantize_fp8_rows_tokens(Tensor x, Tensor cu_seqlens, bool pow2_scales=False)"
        " -> (Tensor, Tensor, Tensor, Tensor)",
        "moonep::scale_rows_backward_fp8_tokens(Tensor dz, Tensor row_weights, Tensor y, "
        "Tensor cu_seqlens, bool pow2_scales=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        "moonep::grouped_mm_fp8_wgrad(Tensor dyT, Tensor dyT_scale, Tensor xT, Tensor xT_scale, "
        "Tensor cu_seqlens, int epn) -> (Tensor, Tensor)",
        "moonep::grouped_mm_fp8_wgrad_into(Tensor dyT, Tensor dyT_scale, Tensor xT, "
        "Tensor xT_scale, Tensor cu_seqlens, Tensor(a!) grad_local, Tensor(b!) grad_slot) -> ()",
    ]


def test_fake_shapes_on_meta():
    with torch.device("meta"):
        x = torch.empty(40960, 7168, dtype=torch.bfloat16)
        cu = torch.empty(64, dtype=torch.int32)
        qT, sT = qt.quantize_fp8_tokens(x, cu)
        assert qT.shape == (7168, 128 * (320 + 64)) and sT.shape == (384, 7168)
        d = torch.empty(40960, 2048, dtype=torch.bfloat16)
        q, s, dT, dS = qt.quantize_fp8_rows_tokens(d, cu)
        assert q.shape == (40960, 2048) and s.shape == (40960, 16) and dT.shape == (2048, 49152)
        gl, gs = gw.grouped_mm_fp8_wgrad(dT, dS, qT, sT, cu, 32)
        assert gl.shape == gs.shape == (32, 2048, 7168) and gl.dtype == torch.bfloat16


def test_compile_fullgraph():
    torch._dynamo.reset()
    counts, M = COUNTS["tp1"]
    dy, x, cu, _ = wgrad_operands(counts, M, seed=12)

    def f(dy, x, cu):
        a, sa = qt.quantize_fp8_tokens(dy, cu)
        b, sb = qt.quantize_fp8_tokens(x, cu)
        return gw.grouped_mm_fp8_wgrad(a, sa, b, sb, cu, 3)

    want = f(dy, x, cu)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(dy, x, cu)
    assert all(torch.equal(u, v) for u, v in zip(got, want))


# ------------------------------------------------------------------------------------------
# the cost model's host mirror against the kernel source; the ABI gate
# ------------------------------------------------------------------------------------------

SRC = (ROOT / "cutlass_kernels" / "kernel_fp8_wgrad.cu").read_text()


def test_config_table_mirrors_the_kernel_source():
    block = SRC[SRC.index("using Configs = std::tuple<"):]
    block = block[:block.index("constexpr int kNumConfigs")]
    cxx = []
    for m in re.finditer(r"WgradConfig<([^>]*)>[,>;]*\s*//\s*(\S+)", block):
        vals = [v.strip() for v in m.group(1).split(",")]
        nums = [int(v) if v not in ("true", "false") else int(v == "true") for v in vals]
        cxx.append((m.group(2), tuple(nums)))
    assert [n for n, _ in cxx] == list(wc.NAMES)
    for (name, v), cfg in zip(cxx, wc.WGRAD_CONFIGS):
        assert v == (cfg.BM, cfg.BN, int(cfg.pingpong), cfg.CM, cfg.CN, cfg.EN,
                     int(cfg.raster_n)), name
    t = wc.tuning_table()
    mx = wc.MAX_CONFIGS
    for i, name in enumerate(wc.NAMES):
        assert (t[i], t[mx + i], t[2 * mx + i]) == pytest.approx(tuning_fp8_wgrad.CONSTANTS[name])
    assert set(tuning_fp8_wgrad.CONSTANTS) == set(wc.NAMES)


def test_cost_model_rule():
    sms = 132
    base = wc.predict([1024] * 32 + [0] * 32, 2048, 7168, sms)
    more = wc.predict([2048] * 32 + [0] * 32, 2048, 7168, sms)
    for n in wc.NAMES:
        assert more[n] > base[n] > tuning_fp8_wgrad.CONSTANTS[n][0]
    empty = wc.predict([0] * 8, 2048, 7168, sms)
    for n in wc.NAMES:
        assert empty[n] == pytest.approx(tuning_fp8_wgrad.CONSTANTS[n][0])
    pred = {n: 100.0 for n in wc.NAMES}
    pred[wc.NAMES[0]] = 100.4
    assert wc.pick(pred, tie_tol=0.0) == wc.NAMES[1]
    assert wc.pick(pred, tie_tol=0.005) == wc.NAMES[0]
    for bad in ("nope", 5, -2, True):
        with pytest.raises(ValueError):
            wc.config_index(bad)


CC = shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(CC is None, reason="needs a C compiler for the stub library")
@pytest.mark.parametrize("abi,wgrad,has", [(12, True, True), (12, False, False),
                                           (11, True, False)])
def test_wgrad_kernel_only_from_an_abi12_library(tmp_path, monkeypatch, abi, wgrad, has):
    names = [n for n in native.GEMM_PROTOTYPES if n != "moonep_gemm_abi_version"]
    names += list(native.GEMM_FP8_PROTOTYPES) + (list(native.GEMM_FP8_WGRAD_PROTOTYPES)
                                                 if wgrad else [])
    src = [f"int moonep_gemm_abi_version(void) {{ return {abi}; }}"]
    src += [f"int {n}(void) {{ return 0; }}" for n in names]
    (tmp_path / "stub.c").write_text("\n".join(src) + "\n")
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(tmp_path / "libmoonep_gemm.so"),
                    str(tmp_path / "stub.c")], check=True)
    monkeypatch.setenv("MOONEP_LIB_DIR", str(tmp_path))
    monkeypatch.delenv("MOONEP_DISABLE_NATIVE", raising=False)
    monkeypatch.delenv("MOONEP_GEMM_BACKEND", raising=False)
    lib = native._Lib("libmoonep_gemm.so", "moonep_gemm_abi_version", native.GEMM_ABI_VERSION,
                      native.GEMM_PROTOTYPES, {}, versions=native.GEMM_ABI_VERSIONS,
                      since=native.GEMM_SINCE)
    monkeypatch.setattr(native, "_GEMM", lib)
    assert native.gemm_fp8() is not None                  # the forward FP8 GEMM either way
    assert (native.gemm_fp8_wgrad() is not None) == has
    cuda_like = type("T", (), {"device": torch.device("cuda")})()
    assert gw.backend_for_fp8_wgrad(cuda_like) == ("cutlass" if has else "reference")
    if not has:
        with pytest.raises(native.NativeLibraryMissing, match="wgrad"):
            native.require_gemm_fp8_wgrad()
    assert gw.backend_for_fp8_wgrad(torch.empty(1)) == "reference"
