"""GPU tests of the grouped GEMM (CUTLASS library and the torch._grouped_mm fallback).

Skips without CUDA; the CUTLASS tests also skip without moonep_ops/lib/libmoonep_gemm.so.
Every check draws fresh random inputs, poisons outputs (NaN) before the run, and compares with
an fp32 per-group reference: ||out - ref|| / ||ref|| < 1e-2 (bf16 operands).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.library import opcheck

from moonep_ops import native
from moonep_ops.gemm import cost_model as gemm_cost_model
from moonep_ops.ops import grouped_mm as gg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_lib = pytest.mark.skipif(native.gemm() is None,
                               reason=f"CUTLASS library not loaded: {native.gemm_load_error()}")

TOL = 1e-2
KINDS = {"fwd": 0, "dgrad": 1, "wgrad": 2, "wgrad_lp": 3}
_seed = [1000]


def fresh_gen():
    _seed[0] += 1
    return torch.Generator(device="cuda").manual_seed(_seed[0])


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output (unwritten poisoned element?)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


COUNTS = {
    "skewed_empty": [700, 0, 3, 1, 0, 2000, 129, 0, 64, 65, 1, 0, 300, 9, 0, 128],
    "ones": [1] * 16,
    "one_group": [0] * 5 + [3001] + [0] * 10,
    "all_empty": [0] * 16,
    "balanced": [256] * 16,
    # G = 256: the prep kernel's 256-thread block with a thread per group in every thread;
    # G > 256: its 1024-thread block
    "g256": [int(c) for c in np.random.default_rng(4).integers(0, 40, 256)],
    "many_groups": [int(c) for c in np.random.default_rng(3).integers(0, 40, 320)],
}


def make(counts, N, K, pad=37, gen=None):
    gen = gen or fresh_gen()
    epn = len(counts) // 2
    M = int(sum(counts)) + pad
    r = lambda *s: (torch.randn(*s, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    x, wl, ws = r(M, K), r(epn, N, K), r(epn, N, K)
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
    return x, wl, ws, cu


def ref_fwd(x, wl, ws, cu):
    return gg._ref_fwd(x.float(), wl.float(), ws.float(), cu)


def ref_dgrad(dy, wl, ws, cu):
    return gg._ref_dgrad(dy.float(), wl.float(), ws.float(), cu)


def ref_wgrad(dy, x, cu, epn):
    N, K = dy.shape[1], x.shape[1]
    gl = torch.zeros(epn, N, K, device="cuda")
    gs = torch.zeros_like(gl)
    gg._ref_wgrad_acc(dy.float(), x.float(), cu, gl, gs)
    return gl, gs


def poisoned(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


# ------------------------------------------------------------------------------------------
# CUTLASS kernels, every config, through the raw launcher with poisoned outputs
# ------------------------------------------------------------------------------------------

def _configs(kind):
    return [-1] + list(range(len(gemm_cost_model.CONFIGS[kind])))


@needs_lib
@pytest.mark.skipif(not native.gemm_keep_tail(), reason="library ABI < 11 (rebuild it)")
@pytest.mark.parametrize("case", ["skewed_empty", "all_empty", "g256"])
@pytest.mark.parametrize("kind", ["fwd", "dgrad"])
@pytest.mark.parametrize("config", [-1, 1, 5, 6])
def test_keep_tail_leaves_the_tail_and_nothing_else(case, kind, config):
    # MOONEP_GEMM_KEEP_TAIL: the rows past cu[-1] keep what they held (here NaN), the group
    # rows are bitwise those of the zeroing call; config 5 / 6: a swap-AB and a torch-family one
    counts = COUNTS[case]
    epn = len(counts) // 2
    N, K = 384, 512
    x, wl, ws, cu = make(counts, N, K, pad=200)
    M, end = x.shape[0], int(sum(counts))
    a, cols = (x, N) if kind == "fwd" else (torch.randn(M, N, device="cuda",
                                                          generator=fresh_gen()).to(x.dtype), K)
    outs = []
    for flags in (0, gg._KEEP_TAIL):
        out = poisoned(M, cols, dtype=torch.bfloat16)
        gg._launch(kind, config, a, wl, ws, out, None, cu, epn, M, N, K, flags=flags)
        outs.append(out)
    assert torch.all(outs[0][end:] == 0)
    assert torch.isnan(outs[1][end:]).all()
    assert torch.equal(outs[0][:end], outs[1][:end])
    if kind == "fwd" and case == "skewed_empty" and config == -1:   # wgrad kinds refuse it
        dy = torch.randn(M, N, device="cuda", generator=fresh_gen()).to(x.dtype)
        gl = torch.zeros(epn, N, K, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(RuntimeError, match="KEEP_TAIL applies to fwd and dgrad only"):
            gg._launch("wgrad_lp", -1, dy, x, None, gl, torch.zeros_like(gl), cu, epn, M, N, K,
                       flags=gg._KEEP_TAIL)


@needs_lib
@pytest.mark.parametrize("case", list(COUNTS))
@pytest.mark.parametrize("config", _configs("fwd"))
@pytest.mark.parametrize("raster", [0, 1])
def test_cutlass_fwd_dgrad(case, config, raster):
    counts = COUNTS[case]
    epn = len(counts) // 2
    N, K = 384, 512                     # N not a multiple of 256: partial N tiles too
    x, wl, ws, cu = make(counts, N, K)
    M = x.shape[0]
    end = int(sum(counts))
    y = poisoned(M, N, dtype=torch.bfloat16)
    gg._launch("fwd", config, x, wl, ws, y, None, cu, epn, M, N, K, raster=raster)
    assert torch.all(y[end:] == 0)
    if end:
        assert rel_err(y, ref_fwd(x, wl, ws, cu)) < TOL
    else:
        assert torch.all(y == 0)
    dy = torch.randn(M, N, device="cuda", generator=fresh_gen()).to(torch.bfloat16)
    dx = poisoned(M, K, dtype=torch.bfloat16)
    gg._launch("dgrad", config, dy, wl, ws, dx, None, cu, epn, M, N, K, raster=raster)
    assert torch.all(dx[end:] == 0)
    if end:
        assert rel_err(dx, ref_dgrad(dy, wl, ws, cu)) < TOL


@needs_lib
@pytest.mark.parametrize("case", list(COUNTS))
@pytest.mark.parametrize("config", _configs("wgrad"))
def test_cutlass_wgrad_accumulates(case, config):
    counts = COUNTS[case]
    epn = len(counts) // 2
    N, K = 384, 512
    x, wl, ws, cu = make(counts, N, K)
    M = x.shape[0]
    dy = torch.randn(M, N, device="cuda", generator=fresh_gen()).to(torch.bfloat16)
    base_l = torch.randn(epn, N, K, device="cuda", generator=fresh_gen())
    base_s = torch.randn(epn, N, K, device="cuda", generator=fresh_gen())
    gl, gs = base_l.clone(), base_s.clone()
    gg._launch("wgrad", config, dy, x, None, gl, gs, cu, epn, M, N, K)
    rl, rs = ref_wgrad(dy, x, cu, epn)
    for g, c in enumerate(counts):
        got, base, r = (gl, base_l, rl) if g < epn else (gs, base_s, rs)
        if c == 0:
            assert torch.equal(got[g % epn], base[g % epn]), f"empty group {g} changed"
        else:
            assert rel_err(got[g % epn] - base[g % epn], r[g % epn]) < TOL, f"group {g}"


@needs_lib
@pytest.mark.parametrize("case", list(COUNTS))
@pytest.mark.parametrize("config", _configs("wgrad_lp"))
def test_cutlass_wgrad_lp_bf16_out(case, config):
    counts = COUNTS[case]
    epn = len(counts) // 2
    N, K = 384, 512
    x, wl, ws, cu = make(counts, N, K)
    M = x.shape[0]
    dy = torch.randn(M, N, device="cuda", generator=fresh_gen()).to(torch.bfloat16)
    gl = poisoned(epn, N, K, dtype=torch.bfloat16)
    gs = poisoned(epn, N, K, dtype=torch.bfloat16)
    gg._launch("wgrad_lp", config, dy, x, None, gl, gs, cu, epn, M, N, K)
    rl, rs = ref_wgrad(dy, x, cu, epn)
    for g, c in enumerate(counts):
        got, r = (gl, rl) if g < epn else (gs, rs)
        if c == 0:
            assert torch.all(got[g % epn] == 0), f"empty group {g} not zeroed"
        else:
            assert rel_err(got[g % epn], r[g % epn]) < TOL, f"group {g}"


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("case", list(COUNTS))
def test_wgrad_into_keeps_empty_slots(case, backend, monkeypatch):
    """grouped_mm_wgrad_into: local groups written (empty -> 0), non-empty slots written, empty
    slots keep their bytes (the CUTLASS path's MOONEP_GEMM_KEEP_EMPTY_SLOTS)."""
    if backend == "auto" and native.gemm() is None:
        pytest.skip("CUTLASS library not loaded")
    if backend == "torch":
        monkeypatch.setenv("MOONEP_GEMM_BACKEND", "torch")
    counts = COUNTS[case]
    epn = len(counts) // 2
    N, K = 384, 512
    x, wl, ws, cu = make(counts, N, K)
    dy = torch.randn(x.shape[0], N, device="cuda", generator=fresh_gen()).to(torch.bfloat16)
    gl = poisoned(epn, N, K, dtype=torch.bfloat16)
    marker = torch.randn(epn, N, K, device="cuda", generator=fresh_gen()).to(torch.bfloat16)
    gs = marker.clone()
    gg.grouped_mm_wgrad_into(dy, x, cu, gl, gs)
    rl, rs = ref_wgrad(dy, x, cu, epn)
    for g, c in enumerate(counts):
        got, r = (gl, rl) if g < epn else (gs, rs)
        if c == 0 and g < epn:
            assert torch.all(got[g] == 0), f"empty local group {g} not zeroed"
        elif c == 0:
            assert torch.equal(got[g - epn], marker[g - epn]), f"empty slot {g - epn} written"
        else:
            assert rel_err(got[g % epn], r[g % epn]) < TOL, f"group {g}"
    opcheck(torch.ops.moonep.grouped_mm_wgrad_into.default, (dy, x, cu, gl, gs, -1))


@needs_lib
@pytest.mark.parametrize("skew", ["zipf1.5", "hot", "tiny"])
def test_cutlass_large_shapes(skew):
    """MoE-sized problem (G=64, N=2048, K=7168) in all configs."""
    G, total = 64, 32768
    rng = np.random.default_rng(_seed[0])
    if skew == "zipf1.5":
        w = 1 / np.arange(1, G + 1) ** 1.5
    elif skew == "hot":
        w = np.ones(G); w[5] = 20
    else:
        w = np.ones(G); w[:4] = 100
    rng.shuffle(w)
    counts = np.floor(w / w.sum() * total).astype(int)
    counts[rng.integers(G, size=4)] = 0          # some empty groups
    N, K = 2048, 7168
    x, wl, ws, cu = make(counts.tolist(), N, K)
    M = x.shape[0]
    epn = G // 2
    ref = ref_fwd(x, wl, ws, cu)
    for config in _configs("fwd"):
        y = poisoned(M, N, dtype=torch.bfloat16)
        gg._launch("fwd", config, x, wl, ws, y, None, cu, epn, M, N, K)
        assert rel_err(y, ref) < TOL, config
    dy = (torch.randn(M, N, device="cuda", generator=fresh_gen()) * 0.5).to(torch.bfloat16)
    rl, rs = ref_wgrad(dy, x, cu, epn)
    for config in _configs("wgrad"):
        gl = torch.zeros(epn, N, K, device="cuda")
        gs = torch.zeros_like(gl)
        gg._launch("wgrad", config, dy, x, None, gl, gs, cu, epn, M, N, K)
        assert rel_err(torch.cat([gl, gs]), torch.cat([rl, rs])) < TOL, config


@needs_lib
def test_library_config_table_matches_python():
    lib = native.gemm()
    import ctypes
    for kind, kid in KINDS.items():
        cfgs = gemm_cost_model.CONFIGS[kind]
        assert lib.gemm_num_configs(kid) == len(cfgs)
        for i, c in enumerate(cfgs):
            info = (ctypes.c_int * 8)()
            assert lib.gemm_config_info(kid, i, info) == 0
            assert list(info) == [c.BM, c.BN, c.BK, c.CM, c.CN, int(c.pingpong), c.EN,
                                  int(c.swap)]


@needs_lib
@pytest.mark.parametrize("kind", list(KINDS))
def test_device_selector_agrees_with_python_model(kind):
    """The config picked on the GPU is the Python rule's (gemm_cost_model.pick: the fastest
    predicted, near-ties within tie_tolerance to the least MMA work), up to float32 rounding at
    the tie window's edge.  One case is the streaming benchmark's (G = 96 groups of 64 rows, the
    small-group window)."""
    rng = np.random.default_rng(7)
    N, K = 2048, 7168
    cases = []
    for trial in range(4):
        G = 64
        counts = np.floor(rng.lognormal(0, 1.5, G) / 1.0).astype(int) * (trial + 1) * 20
        counts[rng.integers(G, size=3)] = 0
        cases.append(counts)
    cases.append(np.full(96, 64))
    # G > 256 (the prep kernel's 1024-thread block), zipf-like with empty groups
    big = np.floor(rng.lognormal(0, 1.5, 320) * 40).astype(int)
    big[rng.integers(320, size=20)] = 0
    cases.append(big)
    for counts in cases:
        x, wl, ws, cu = make(counts.tolist(), N, K, pad=0)
        M, epn = x.shape[0], len(counts) // 2
        if kind in ("wgrad", "wgrad_lp"):
            dy = torch.randn(M, N, device="cuda").to(torch.bfloat16)
            gl = torch.zeros(epn, N, K, device="cuda",
                             dtype=torch.float32 if kind == "wgrad" else torch.bfloat16)
            wsp = gg._launch(kind, -1, dy, x, None, gl, torch.zeros_like(gl), cu, epn, M, N, K)
        elif kind == "fwd":
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            wsp = gg._launch(kind, -1, x, wl, ws, y, None, cu, epn, M, N, K)
        else:
            dy = torch.randn(M, N, device="cuda").to(torch.bfloat16)
            dx = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
            wsp = gg._launch(kind, -1, dy, wl, ws, dx, None, cu, epn, M, N, K)
        chosen = int(wsp[:4].view(torch.int32).item())
        sm = torch.cuda.get_device_properties(0).multi_processor_count
        mask = gg.candidate_mask(kind, M, len(counts), N, K, sm)
        fam, names = gemm_cost_model.call_candidates(kind, M, len(counts), N, K, sm_count=sm)
        cfgs = gemm_cost_model.CONFIGS[kind]
        assert {c.name for i, c in enumerate(cfgs) if (mask >> i) & 1} == set(names)
        pred = gemm_cost_model.predict(counts, N, K, kind, configs=names, sm_count=sm)
        name = cfgs[chosen].name
        if len(names) == 1:                 # the torch family: torch's rule, no device model
            assert name == names[0], (fam, names, name)
            continue
        vol = {n: gemm_cost_model.mma_volume(counts, N, K, kind, n) for n in pred}
        tol = gemm_cost_model.tie_tolerance(kind, M, len(counts))
        window, slack = min(pred.values()) * (1 + tol), 1e-3
        assert pred[name] <= window * (1 + slack), (pred, name)
        assert not [n for n in pred if pred[n] <= window * (1 - slack) and vol[n] < vol[name]], \
            (pred, vol, name)


@needs_lib
@pytest.mark.parametrize("family", ["moonep", "torch"])
@pytest.mark.parametrize("kind", ["fwd", "dgrad", "wgrad_lp"])
def test_device_runs_the_forced_family(kind, family, monkeypatch):
    """MOONEP_GEMM_FAMILY forces the never-lose rule's family: the torch family runs torch's own
    config (torch_config, no device model), the moonep family one of its candidates; both match
    the reference, and the torch family matches torch._grouped_mm (the same kernel)."""
    monkeypatch.setenv("MOONEP_GEMM_FAMILY", family)
    gg.clear_plan_cache()
    try:
        for counts in (COUNTS["skewed_empty"], [512] * 8 + [0] * 8, [64] * 16):
            N, K = 384, 512
            x, wl, ws, cu = make(counts, N, K)
            M, epn = x.shape[0], len(counts) // 2
            want = gemm_cost_model.call_candidates(kind, M, len(counts), N, K, family=family)[1]
            dy = torch.randn(M, N, device="cuda", generator=fresh_gen()).to(torch.bfloat16)
            w = torch.cat([wl, ws])
            if kind == "fwd":
                out = poisoned(M, N, dtype=torch.bfloat16)
                wsp = gg._launch(kind, -1, x, wl, ws, out, None, cu, epn, M, N, K)
                ref, tref = ref_fwd(x, wl, ws, cu), torch._grouped_mm(x, w.transpose(-2, -1), offs=cu)
                rows = int(sum(counts))
            elif kind == "dgrad":
                out = poisoned(M, K, dtype=torch.bfloat16)
                wsp = gg._launch(kind, -1, dy, wl, ws, out, None, cu, epn, M, N, K)
                ref, tref = ref_dgrad(dy, wl, ws, cu), torch._grouped_mm(dy, w, offs=cu)
                rows = int(sum(counts))
            else:
                gl = poisoned(epn, N, K, dtype=torch.bfloat16)
                gs = poisoned(epn, N, K, dtype=torch.bfloat16)
                wsp = gg._launch(kind, -1, dy, x, None, gl, gs, cu, epn, M, N, K)
                rl, rs = ref_wgrad(dy, x, cu, epn)
                out, ref = torch.cat([gl, gs]), torch.cat([rl, rs])
                tref = torch._grouped_mm(dy.t(), x, offs=cu)
                tref = tref.masked_fill(~gg._nonempty_G11(cu), 0)
                rows = None
            name = gemm_cost_model.CONFIGS[kind][int(wsp[:4].view(torch.int32).item())].name
            assert name in want, (name, want)
            assert rel_err(out, ref) < TOL
            if family == "torch":
                a, b = (out, tref) if rows is None else (out[:rows], tref[:rows])
                assert rel_err(a, b) < 2e-3, name   # the same kernel: bf16 rounding apart
    finally:
        gg.clear_plan_cache()


@needs_lib
@pytest.mark.parametrize("pdl", ["1", "0"], ids=["pdl", "no_pdl"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_pdl_launch_matches(kind, pdl, monkeypatch):
    """MOONEP_GEMM_PDL=1 (the default: the GEMM as a programmatic dependent of the prep kernel)
    and 0 (launched after it): the same results, automatic and forced, in both families, eager
    and in a captured graph."""
    monkeypatch.setenv("MOONEP_GEMM_PDL", pdl)
    counts = COUNTS["skewed_empty"]
    N, K = 384, 512
    x, wl, ws, cu = make(counts, N, K)
    M, epn = x.shape[0], len(counts) // 2
    dy = torch.randn(M, N, device="cuda", generator=fresh_gen()).to(torch.bfloat16)
    for config in _configs(kind):
        if kind in ("fwd", "dgrad"):
            a, cols = (x, N) if kind == "fwd" else (dy, K)
            out = poisoned(M, cols, dtype=torch.bfloat16)
            gg._launch(kind, config, a, wl, ws, out, None, cu, epn, M, N, K)
            ref = ref_fwd(x, wl, ws, cu) if kind == "fwd" else ref_dgrad(dy, wl, ws, cu)
            assert rel_err(out, ref) < TOL, config
        else:
            dt = torch.float32 if kind == "wgrad" else torch.bfloat16
            gl = torch.zeros(epn, N, K, device="cuda", dtype=dt)
            gs = torch.zeros_like(gl)
            gg._launch(kind, config, dy, x, None, gl, gs, cu, epn, M, N, K)
            rl, rs = ref_wgrad(dy, x, cu, epn)
            assert rel_err(torch.cat([gl, gs]).float(), torch.cat([rl, rs])) < TOL, config
    if kind == "fwd":
        y = gg.grouped_mm(x, wl, ws, cu)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = gg.grouped_mm(x, wl, ws, cu)
        for c2 in ([0, 1, 700, 3, 0, 2, 129, 64] * 2, [2100] + [0] * 15):
            cu.copy_(torch.tensor(np.cumsum(c2), dtype=torch.int32))
            y.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.all(y[sum(c2):] == 0)
            assert rel_err(y, ref_fwd(x, wl, ws, cu)) < TOL


@needs_lib
@pytest.mark.parametrize("kind", list(KINDS))
def test_one_gemm_launch_per_call(kind):
    """Choosing costs no launch: one prep kernel and ONE fused GEMM kernel per call, whichever
    config the device picks (before the fusion every candidate config was launched)."""
    from torch.profiler import ProfilerActivity, profile

    counts = [300, 0, 5, 129, 1, 700, 64, 2]
    N, K = 256, 384
    x, wl, ws, cu = make(counts, N, K, pad=0)
    M, epn = x.shape[0], len(counts) // 2
    if kind in ("wgrad", "wgrad_lp"):
        dy = torch.randn(M, N, device="cuda").to(torch.bfloat16)
        gl = torch.zeros(epn, N, K, device="cuda",
                         dtype=torch.float32 if kind == "wgrad" else torch.bfloat16)
        call = lambda: gg._launch(kind, -1, dy, x, None, gl, torch.zeros_like(gl), cu, epn, M, N, K)
    else:
        a = x if kind == "fwd" else torch.randn(M, N, device="cuda").to(torch.bfloat16)
        out = torch.empty(M, N if kind == "fwd" else K, device="cuda", dtype=torch.bfloat16)
        call = lambda: gg._launch(kind, -1, a, wl, ws, out, None, cu, epn, M, N, K)
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gemms = [n for n in names if "fused_grouped_gemm" in n]
    preps = [n for n in names if "prep_kernel" in n]
    assert len(gemms) == 1 and len(preps) == 1, names


# ------------------------------------------------------------------------------------------
# Public ops (auto backend) and the torch._grouped_mm fallback
# ------------------------------------------------------------------------------------------

def _poison_allocator():
    # Fill freed cache blocks with NaN so that an op's torch.empty output starts poisoned.
    t = torch.full((64 << 20,), float("nan"), device="cuda")
    del t


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("case", ["skewed_empty", "ones", "one_group"])
def test_public_ops_autograd(backend, case, monkeypatch):
    if backend == "torch":
        monkeypatch.setenv("MOONEP_GEMM_BACKEND", "torch")
    counts = COUNTS[case]
    epn = len(counts) // 2
    N, K = 256, 384
    x, wl, ws, cu = make(counts, N, K)
    for t in (x, wl, ws):
        t.requires_grad_(True)
    _poison_allocator()
    y = gg.grouped_mm(x, wl, ws, cu)
    end = int(sum(counts))
    assert torch.all(y[end:] == 0)
    assert rel_err(y, ref_fwd(x.detach(), wl.detach(), ws.detach(), cu)) < TOL
    with torch.no_grad():                      # zero_tail=False: the same group rows
        assert torch.equal(gg.grouped_mm(x, wl, ws, cu, zero_tail=False)[:end], y[:end])
    dy = torch.randn_like(y)
    _poison_allocator()
    y.backward(dy)
    assert rel_err(x.grad, ref_dgrad(dy, wl.detach(), ws.detach(), cu)) < TOL
    rl, rs = ref_wgrad(dy, x.detach(), cu, epn)
    assert wl.grad.dtype == torch.bfloat16
    assert rel_err(torch.cat([wl.grad, ws.grad]), torch.cat([rl, rs])) < TOL


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_opcheck_cuda(backend, monkeypatch):
    if backend == "torch":
        monkeypatch.setenv("MOONEP_GEMM_BACKEND", "torch")
    counts = COUNTS["skewed_empty"]
    epn = len(counts) // 2
    x, wl, ws, cu = make(counts, 128, 256)
    dy = torch.randn(x.shape[0], 128, device="cuda").to(torch.bfloat16)
    opcheck(torch.ops.moonep.grouped_mm.default, (x, wl, ws, cu, -1))
    xr, wlr, wsr = (t.clone().requires_grad_(True) for t in (x, wl, ws))
    opcheck(torch.ops.moonep.grouped_mm.default, (xr, wlr, wsr, cu, -1))
    opcheck(torch.ops.moonep.grouped_mm_dgrad.default, (dy, wl, ws, cu, -1))
    opcheck(torch.ops.moonep.grouped_mm_wgrad.default, (dy, x, cu, epn, -1))
    opcheck(torch.ops.moonep.grouped_mm_wgrad.default, (dy, x, cu, epn, -1, torch.bfloat16))
    gl = torch.zeros(epn, 128, 256, device="cuda")
    opcheck(torch.ops.moonep.grouped_mm_wgrad_accumulate.default,
            (dy, x, cu, gl, torch.zeros_like(gl), -1))


@needs_lib
def test_cuda_graph_capture_reads_sizes_on_device():
    """Capture once, then change cu_seqlens in place: replays follow the new sizes."""
    N, K, G = 256, 512, 16
    counts0 = [100] * G
    x, wl, ws, cu = make(counts0, N, K, pad=500)
    y = gg.grouped_mm(x, wl, ws, cu)           # warm-up (lazy init outside capture)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = gg.grouped_mm(x, wl, ws, cu)
    for counts in ([0, 1, 700, 3, 0, 2, 129, 64] * 2, [2100] + [0] * 15):
        cu.copy_(torch.tensor(np.cumsum(counts), dtype=torch.int32))
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.all(y[sum(counts):] == 0)
        assert rel_err(y, ref_fwd(x, wl, ws, cu)) < TOL
