"""GPU tests of the FP8 grouped GEMM of libmoonep_gemm.so (moonep_grouped_gemm_fp8), called
through moonep_ops/native.py's ctypes table directly (no op layer).

Skips without CUDA, on a device other than sm90 (the library is built for sm_90a only), and
without a loaded libmoonep_gemm.so of GEMM ABI >= native.GEMM_FP8_ABI_VERSION (the one that
exports the FP8 entry).  Every config is tested forced and the device's own choice (config -1)
against the host mirror of its cost model (moonep_ops/gemm/fp8_cost.py).

Every case draws fresh random bf16-range inputs whose magnitude varies per 1 x 128 tile and per
128 x 128 block (so a scale read from the wrong tile, or a transposed scale grid, changes the
result by up to 2^8), quantises them here (amax / 448 scales, e4m3, the recipe of
moonep_ops/ops/quantize_fp8.py), poisons the output with NaN, and compares with a dequantise-
then-fp32-matmul reference rounded to bf16.  Bitwise equality is not expected (the kernel sums
in another order and promotes per 128-deep K block); the tolerance is, per group,
max |out - ref| <= 1e-2 * max |ref| of the group.  Padding rows (at or past cu_seqlens[-1]) must
be exactly zero.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moonep_ops import native
from moonep_ops.gemm import fp8_cost

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE = 128
TOL = 1e-2


def _lib_or_reason():
    if not torch.cuda.is_available():
        return None, "needs CUDA"
    if torch.cuda.get_device_capability() != (9, 0):
        return None, "libmoonep_gemm.so is built for sm_90a"
    lib = native.gemm_fp8()         # the FP8 ABI and every FP8 export, by the reported version
    if lib is None:
        return None, f"FP8 grouped GEMM not available: {native.gemm_fp8_unavailable()}"
    return lib, ""


_LIB, _WHY = _lib_or_reason() if torch.cuda.is_available() else (None, "needs CUDA")
needs_fp8 = pytest.mark.skipif(_LIB is None, reason=_WHY or "FP8 GEMM unavailable")

_seed = [7000]


def fresh_gen():
    _seed[0] += 1
    return torch.Generator(device="cuda").manual_seed(_seed[0])


# ---- quantisation (the test's own; per 1 x 128 tile / per 128 x 128 block, amax / 448) ------

def quant_rows(x):
    """x [M, K] fp32 -> (q [M, K] e4m3, scale [M, ceil(K/128)] fp32)."""
    M, K = x.shape
    C = math.ceil(K / TILE)
    xp = torch.nn.functional.pad(x, (0, C * TILE - K)).view(M, C, TILE)
    s = (xp.abs().amax(-1) / FP8_MAX).clamp_min(2.0 ** -126)
    q = (xp / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(M, C * TILE)[:, :K]
    return q.contiguous(), s.contiguous()


def quant_blocks(w):
    """w [E, N, K] fp32 -> (q [E, N, K] e4m3, scale [E, ceil(N/128), ceil(K/128)] fp32)."""
    E, N, K = w.shape
    P, C = math.ceil(N / TILE), math.ceil(K / TILE)
    wp = torch.nn.functional.pad(w, (0, C * TILE - K, 0, P * TILE - N)).view(E, P, TILE, C, TILE)
    s = (wp.abs().amax(dim=(2, 4)) / FP8_MAX).clamp_min(2.0 ** -126)
    q = (wp / s[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.view(E, P * TILE, C * TILE)[:, :N, :K]
    return q.contiguous(), s.contiguous()


def deq_rows(q, s):
    K = q.shape[1]
    return q.float() * s.repeat_interleave(TILE, dim=1)[:, :K]


def deq_blocks(q, s):
    N, K = q.shape[1:]
    return q.float() * s.repeat_interleave(TILE, 1).repeat_interleave(TILE, 2)[:, :N, :K]


def tile_varied(shape, tiles, gen):
    """randn(shape) times 2^u per tile, u ~ U[-4, 4]: `tiles` gives the tile extent per dim."""
    x = torch.randn(*shape, device="cuda", generator=gen)
    grid = [math.ceil(d / t) for d, t in zip(shape, tiles)]
    f = torch.exp2(torch.rand(*grid, device="cuda", generator=gen) * 8 - 4)
    for dim, t in enumerate(tiles):
        f = f.repeat_interleave(t, dim=dim)
    return x * f[tuple(slice(0, d) for d in shape)]


def make(counts, n, k, pad=37, gen=None):
    gen = gen or fresh_gen()
    epn = len(counts) // 2
    M = int(sum(counts)) + pad
    x = tile_varied((M, k), (1, TILE), gen)
    wl = tile_varied((epn, n, k), (1, TILE, TILE), gen) * 0.05
    ws = tile_varied((epn, n, k), (1, TILE, TILE), gen) * 0.05
    aq, as_ = quant_rows(x)
    blq, bls = quant_blocks(wl)
    bsq, bss = quant_blocks(ws)
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
    return aq, as_, blq, bls, bsq, bss, cu


def reference(aq, as_, blq, bls, bsq, bss, cu):
    """Dequantise, multiply per group in fp64 (no TF32 whatever the global flags), round to bf16
    once."""
    a = deq_rows(aq, as_).double()
    wl, ws = deq_blocks(blq, bls).double(), deq_blocks(bsq, bss).double()
    epn = wl.shape[0]
    out = torch.zeros(aq.shape[0], wl.shape[1], dtype=torch.bfloat16, device="cuda")
    ends = cu.tolist()
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            w = wl[g] if g < epn else ws[g - epn]
            out[start:end] = (a[start:end] @ w.t()).to(torch.bfloat16)
        start = max(start, end)
    return out


def workspace(G):
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    nbytes = _LIB.gemm_fp8_workspace_bytes(G, sms)
    assert nbytes > 0
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda"), nbytes, sms


PDL = 2                 # moonep_gemm.h MOONEP_GEMM_PDL
_TABLE = None


def table():
    global _TABLE
    if _TABLE is None:
        from moonep_ops.ops import grouped_mm_fp8 as g8
        _TABLE = g8._tuning_table()
    return _TABLE


def call(aq, as_, blq, bls, bsq, bss, cu, d, ws=None, config=-1, flags=PDL):
    """The C entry on the current stream; returns its rc (0 or -1)."""
    epn, n, k = blq.shape
    G = 2 * epn
    buf, nbytes, sms = ws if ws is not None else workspace(G)
    return _LIB.grouped_gemm_fp8(aq.data_ptr(), as_.data_ptr(), blq.data_ptr(), bls.data_ptr(),
                                 bsq.data_ptr(), bss.data_ptr(), d.data_ptr(), cu.data_ptr(),
                                 G, epn, aq.shape[0], n, k, config, table(), flags,
                                 buf.data_ptr(), nbytes, sms,
                                 torch.cuda.current_stream().cuda_stream)


def run(inputs, config=-1, flags=PDL, ws=None):
    aq, blq = inputs[0], inputs[2]
    d = torch.full((aq.shape[0], blq.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    native.gemm_check(call(*inputs, d, ws=ws, config=config, flags=flags),
                      "moonep_grouped_gemm_fp8")
    torch.cuda.synchronize()
    return d


def chosen(ws) -> int:
    """The config the last call on workspace ``ws`` ran: the workspace's first int (the prep
    kernel writes it there, kernel_fp8_fwd.cu Layout.chosen)."""
    return int(ws[0][:4].view(torch.int32).item())


def check(out, ref, cu):
    """Per-group max error against the group's max |ref|; padding rows exactly zero."""
    assert torch.isfinite(out.float()).all(), "non-finite output (a poisoned element unwritten?)"
    ends = cu.tolist()
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            o, r = out[start:end].double(), ref[start:end].double()
            err = (o - r).abs().max().item()
            scale = r.abs().max().item()
            assert err <= TOL * scale, f"group {g} rows [{start}, {end}): max err {err:.3g} " \
                                       f"> {TOL} * max|ref| {scale:.3g}"
        start = max(start, end)
    tail = out[max(ends[-1], 0):]
    assert (tail.float() == 0).all(), f"{int((tail.float() != 0).sum())} nonzero padding elements"


_rng = np.random.default_rng(11)
CASES = {
    # name: (counts [G = 2 epn], n, k, pad rows)
    "uniform_epn4": ([256] * 8, 256, 512, 37),
    "skewed_hot_epn8": ([30, 0, 3000, 17, 64, 1, 0, 200, 5, 0, 90, 0, 128, 7, 0, 33], 512, 1024, 37),
    "empty_groups_epn4": ([0, 300, 0, 0, 129, 0, 1, 0], 384, 256, 37),
    "all_padding_epn4": ([0] * 8, 256, 256, 200),
    "m_not_128_epn2": ([77, 130, 5, 250], 256, 384, 3),
    "slot_only_one_k_tile_epn1": ([0, 333], 128, 128, 0),
    "k16_one_partial_k_tile_epn1": ([50, 70], 128, 16, 9),
    "partial_n_k_tiles_epn2": ([100, 60, 0, 200], 208, 400, 11),
    "k2112_not_multiple_of_128_epn1": ([700, 300], 2048, 2112, 21),
    "deepseek_k7168_n2048_epn8": ([int(c) for c in _rng.integers(0, 600, 16)], 2048, 7168, 100),
    "random_epn8": ([int(c) for c in _rng.integers(0, 300, 16)], 1024, 2048, 64),
}


CONFIGS = ["auto"] + list(fp8_cost.NAMES)


@needs_fp8
def test_config_table_matches_the_library():
    assert _LIB.gemm_fp8_num_configs() == len(fp8_cost.FP8_CONFIGS)
    import ctypes
    for i, cfg in enumerate(fp8_cost.FP8_CONFIGS):
        out = (ctypes.c_int * 8)()
        assert _LIB.gemm_fp8_config_info(i, out) == 0
        assert tuple(out) == cfg.geometry(), cfg.name
    assert _LIB.gemm_fp8_config_info(len(fp8_cost.FP8_CONFIGS), (ctypes.c_int * 8)()) == -1


@needs_fp8
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", list(CASES))
def test_fp8_grouped_gemm_matches_reference(name, config):
    counts, n, k, pad = CASES[name]
    inputs = make(counts, n, k, pad)
    out = run(inputs, config=fp8_cost.config_index(config))
    check(out, reference(*inputs), inputs[-1])


@needs_fp8
def test_pdl_and_forced_pick_are_bitwise_the_same():
    """The same config with and without PDL, and auto against its chosen config forced: bitwise
    equal (the launch mode and the choice change no arithmetic)."""
    inputs = make([300, 0, 129, 64, 0, 500, 7, 200], 512, 1024, 40)
    ws = workspace(8)
    auto = run(inputs, ws=ws)
    c = chosen(ws)
    assert torch.equal(auto, run(inputs, config=c, flags=0))
    for i in range(len(fp8_cost.NAMES)):
        assert torch.equal(run(inputs, config=i), run(inputs, config=i, flags=0)), i


@needs_fp8
@pytest.mark.skipif(not native.gemm_keep_tail(), reason="library ABI < 11 (rebuild it)")
@pytest.mark.parametrize("config", [-1] + list(range(len(fp8_cost.NAMES))))
def test_keep_tail_leaves_the_tail_and_nothing_else(config):
    """MOONEP_GEMM_KEEP_TAIL (4): the rows past cu[-1] keep their NaN, the group rows are
    bitwise those of the zeroing call."""
    inputs = make([300, 0, 129, 64, 0, 500, 7, 200], 512, 1024, 300)
    end = int(inputs[-1][-1])
    zeroed, kept = run(inputs, config=config), run(inputs, config=config, flags=PDL | 4)
    assert (zeroed[end:].float() == 0).all()
    assert torch.isnan(kept[end:].float()).all()
    assert torch.equal(zeroed[:end], kept[:end])


_pick_rng = np.random.default_rng(5)


def _pick_cases():
    out = []
    for epn, n, k in ((8, 2048, 7168), (8, 7168, 2048), (16, 768, 2048), (2, 2048, 768),
                      (4, 2880, 2880), (1, 6144, 16384)):
        for kind in ("uniform", "one_hot", "random", "small"):
            G = 2 * epn
            if kind == "uniform":
                c = [1024] * epn + [0] * epn
            elif kind == "one_hot":
                c = [0] * G
                c[1] = 8192
            elif kind == "random":
                c = [int(v) * 128 for v in _pick_rng.integers(0, 24, G)]
            else:
                c = [int(v) for v in _pick_rng.integers(0, 96, G)]
            out.append((f"{epn}x{n}x{k}_{kind}", c, n, k))
    return out


@needs_fp8
@pytest.mark.parametrize("case", _pick_cases(), ids=lambda c: c[0])
def test_device_pick_is_the_host_models(case):
    """The prep kernel's choice (the workspace's chosen word) is fp8_cost.select on the same
    counts: the device evaluates the model the host documents and fits."""
    _, counts, n, k = case
    epn = len(counts) // 2
    M = sum(counts) + 64
    aq = torch.zeros(M, k, dtype=FP8, device="cuda")
    as_ = torch.ones(M, math.ceil(k / TILE), device="cuda")
    bq = torch.zeros(epn, n, k, dtype=FP8, device="cuda")
    bs = torch.ones(epn, math.ceil(n / TILE), math.ceil(k / TILE), device="cuda")
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
    ws = workspace(2 * epn)
    d = torch.empty(M, n, dtype=torch.bfloat16, device="cuda")
    native.gemm_check(call(aq, as_, bq, bs, bq, bs, cu, d, ws=ws), "auto")
    torch.cuda.synchronize()
    assert fp8_cost.NAMES[chosen(ws)] == fp8_cost.select(counts, n, k, ws[2])


@needs_fp8
def test_fp8_check_detects_wrong_scales():
    """A control for the check itself: the kernel given the scales of ten rows doubled, the
    reference not, must fail it (so the check can fail)."""
    inputs = list(make([300, 200], 256, 512, 5))
    ref = reference(*inputs)
    inputs[1] = inputs[1].clone()
    inputs[1][10:20] *= 2.0
    out = run(inputs)
    with pytest.raises(AssertionError):
        check(out, ref, inputs[-1])


@needs_fp8
def test_fp8_rows_past_m_are_clamped():
    """cu_seqlens past M (bad offsets) is clamped on the device: nothing is written outside d."""
    aq, as_, blq, bls, bsq, bss, _ = make([100, 100, 100, 100], 128, 256, 0)
    M = aq.shape[0]
    cu = torch.tensor([100, 200, 10_000, 20_000], dtype=torch.int32, device="cuda")
    big = torch.full((M + 64, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    d = big[:M]
    native.gemm_check(call(aq, as_, blq, bls, bsq, bss, cu, d), "moonep_grouped_gemm_fp8")
    torch.cuda.synchronize()
    clamped = torch.tensor([100, 200, M, M], dtype=torch.int32, device="cuda")
    check(d, reference(aq, as_, blq, bls, bsq, bss, clamped), clamped)
    assert torch.isnan(big[M:].float()).all(), "wrote past row M"


@needs_fp8
def test_fp8_argument_errors():
    aq, as_, blq, bls, bsq, bss, cu = make([10, 10], 128, 256, 0)
    buf, nbytes, sms = workspace(2)
    d = torch.empty(aq.shape[0], 128, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.current_stream().cuda_stream
    p = [t.data_ptr() for t in (aq, as_, blq, bls, bsq, bss, d, cu)]
    M, t, nc = aq.shape[0], table(), len(fp8_cost.NAMES)
    bad = {
        "G != 2 epn": (*p, 3, 1, M, 128, 256, -1, t, PDL, buf.data_ptr(), nbytes, sms, s),
        "k % 16": (*p, 2, 1, M, 128, 200, -1, t, PDL, buf.data_ptr(), nbytes, sms, s),
        "small workspace": (*p, 2, 1, M, 128, 256, -1, t, PDL, buf.data_ptr(), nbytes - 1, sms,
                            s),
        "config out of range": (*p, 2, 1, M, 128, 256, nc, t, PDL, buf.data_ptr(), nbytes, sms,
                                s),
        "config < -1": (*p, 2, 1, M, 128, 256, -2, t, PDL, buf.data_ptr(), nbytes, sms, s),
        "auto without a table": (*p, 2, 1, M, 128, 256, -1, None, PDL, buf.data_ptr(), nbytes,
                                 sms, s),
        "unknown flag": (*p, 2, 1, M, 128, 256, -1, t, 8, buf.data_ptr(), nbytes, sms, s),
    }
    for what, args in bad.items():
        assert _LIB.grouped_gemm_fp8(*args) == -1, what
        assert _LIB.gemm_last_error(), what
    assert _LIB.grouped_gemm_fp8(*p, 2, 1, M, 128, 256, 0, None, 0, buf.data_ptr(), nbytes, sms,
                                 s) == 0      # a forced config needs no table
    assert _LIB.grouped_gemm_fp8(*p, 2, 1, M, 128, 256, -1, t, PDL, buf.data_ptr(), nbytes, sms,
                                 s) == 0
    assert _LIB.gemm_last_error() in (b"", None)      # a good call clears the message
    assert _LIB.gemm_fp8_workspace_bytes(0, sms) == 0
    torch.cuda.synchronize()


@needs_fp8
def test_fp8_cuda_graph_replay_reads_new_sizes():
    """Captured once; replayed after cu_seqlens changed (other group sizes, another padding
    start): the result is that of the new sizes, so nothing about them was read on the host."""
    counts1 = [300, 0, 129, 64, 0, 500, 7, 200]
    counts2 = [0, 640, 1, 0, 333, 0, 250, 33]          # padding from row 1257 instead of 1200
    aq, as_, blq, bls, bsq, bss, cu = make(counts1, 256, 640, 150)
    M, n = aq.shape[0], blq.shape[1]
    assert sum(counts2) <= M
    d = torch.full((M, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    ws = workspace(blq.shape[0] * 2)
    native.gemm_check(call(aq, as_, blq, bls, bsq, bss, cu, d, ws), "warm-up")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rc = call(aq, as_, blq, bls, bsq, bss, cu, d, ws)
    assert rc == 0, _LIB.gemm_last_error()
    for counts in (counts1, counts2, counts1):
        cu.copy_(torch.tensor(np.cumsum(counts), dtype=torch.int32))
        d.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(d, reference(aq, as_, blq, bls, bsq, bss, cu), cu)


@needs_fp8
def test_op_layer_runs_this_kernel():
    """moonep_ops/ops/grouped_mm_fp8.py on CUDA: the forward op is this kernel (bitwise the
    direct call), and its dgrad (the kernel on transposed weights and scale grids, n = I, k = O)
    matches the dequantised reference; padding rows zero in both."""
    from moonep_ops.ops import grouped_mm_fp8 as g8
    assert g8.backend_for_fp8(torch.empty(1, device="cuda")) == "cutlass"
    counts = [300, 0, 129, 1, 0, 77, 250, 64]
    inputs = make(counts, 384, 256, 40)
    aq, as_, blq, bls, bsq, bss, cu = inputs
    y = g8.grouped_mm_fp8(*inputs)
    torch.cuda.synchronize()
    assert torch.equal(y, run(inputs)), "the op's forward is not the direct kernel call"
    check(y, reference(*inputs), cu)
    # dgrad: dy [M, O] quantised per 1 x 128 tile along O; dx = dequant(dy) @ dequant(W_g)
    dq, ds = quant_rows(tile_varied((aq.shape[0], blq.shape[1]), (1, TILE), fresh_gen()))
    dx = g8.grouped_mm_fp8_dgrad(dq, ds, blq, bls, bsq, bss, cu)
    torch.cuda.synchronize()
    wt = lambda q, s: (q.transpose(1, 2).contiguous(), s.transpose(1, 2).contiguous())
    check(dx, reference(dq, ds, *wt(blq, bls), *wt(bsq, bss), cu), cu)
