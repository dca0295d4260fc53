"""CPU tests of the MoE grouped GEMM ops (moonep_ops.grouped_gemm) and its cost model.

The oracle is an independent row-by-row loop (`naive_*`): each row finds its group by scanning
cu_seqlens and multiplies with that group's weight in float64.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.library import opcheck

from moonep_ops import native
from moonep_ops.gemm import cost_model as gemm_cost_model, tuning as gemm_tuning
from moonep_ops.ops import grouped_mm as gg

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------

def make_cu(counts, dtype=torch.int32):
    return torch.tensor(np.cumsum(counts), dtype=dtype)


def group_of_rows(cu, M):
    """Group of each row (len(cu) for padding rows), by a plain scan."""
    out, g = [], 0
    cu = cu.tolist()
    for r in range(M):
        while g < len(cu) and r >= cu[g]:
            g += 1
        out.append(g)
    return out


def weight(wl, ws, g):
    return wl[g] if g < wl.shape[0] else ws[g - wl.shape[0]]


def naive_fwd(x, wl, ws, cu):
    y = torch.zeros(x.shape[0], wl.shape[1], dtype=torch.float64)
    for r, g in enumerate(group_of_rows(cu, x.shape[0])):
        if g < len(cu):
            y[r] = weight(wl, ws, g).double() @ x[r].double()
    return y


def naive_dgrad(dy, wl, ws, cu):
    dx = torch.zeros(dy.shape[0], wl.shape[2], dtype=torch.float64)
    for r, g in enumerate(group_of_rows(cu, dy.shape[0])):
        if g < len(cu):
            dx[r] = dy[r].double() @ weight(wl, ws, g).double()
    return dx


def naive_wgrad(dy, x, cu, epn):
    N, K = dy.shape[1], x.shape[1]
    dw = torch.zeros(2 * epn, N, K, dtype=torch.float64)
    for r, g in enumerate(group_of_rows(cu, x.shape[0])):
        if g < len(cu):
            dw[g] += torch.outer(dy[r].double(), x[r].double())
    return dw[:epn], dw[epn:]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(counts, N=16, K=24, pad=3, dtype=torch.float32, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    epn = len(counts) // 2
    M = int(sum(counts)) + pad
    x = torch.randn(M, K, generator=gen, dtype=torch.float64).to(dtype)
    wl = torch.randn(epn, N, K, generator=gen, dtype=torch.float64).to(dtype)
    ws = torch.randn(epn, N, K, generator=gen, dtype=torch.float64).to(dtype)
    cu = make_cu(counts)
    if requires_grad:
        for t in (x, wl, ws):
            t.requires_grad_(True)
    return x, wl, ws, cu


COUNTS = {
    "skewed": [5, 0, 1, 9, 0, 3],
    "one_group": [0, 0, 17, 0],
    "ones": [1, 1, 1, 1, 1, 1, 1, 1],
    "all_empty": [0, 0],
    "balanced": [4, 4, 4, 4],
}


# ------------------------------------------------------------------------------------------
# numerics against the naive loop
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5),
                                       (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("case", list(COUNTS))
def test_forward_matches_naive(case, dtype, tol):
    x, wl, ws, cu = inputs(COUNTS[case], dtype=dtype, seed=1)
    y = gg.grouped_mm(x, wl, ws, cu)
    assert y.dtype == dtype and y.shape == (x.shape[0], wl.shape[1])
    ref = naive_fwd(x, wl, ws, cu)
    if ref.norm() > 0:
        assert rel_err(y, ref) < tol
    end = int(cu[-1])
    assert torch.all(y[end:] == 0), "padding rows must be zero"


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("case", ["skewed", "one_group", "ones"])
def test_dgrad_wgrad_match_naive(case, dtype, tol):
    counts = COUNTS[case]
    epn = len(counts) // 2
    x, wl, ws, cu = inputs(counts, dtype=dtype, seed=2)
    dy = torch.randn(x.shape[0], wl.shape[1], dtype=dtype)
    dx = gg.grouped_mm_dgrad(dy, wl, ws, cu)
    assert rel_err(dx, naive_dgrad(dy, wl, ws, cu)) < tol
    assert torch.all(dx[int(cu[-1]):] == 0)
    gl, gs = gg.grouped_mm_wgrad(dy, x, cu, epn)
    rl, rs = naive_wgrad(dy, x, cu, epn)
    assert gl.dtype == torch.float32 and gs.dtype == torch.float32
    assert rel_err(torch.cat([gl, gs]), torch.cat([rl, rs])) < max(tol, 1e-6)
    # empty groups get an exactly zero gradient
    for g, c in enumerate(counts):
        if c == 0:
            assert torch.all((gl if g < epn else gs)[g % epn] == 0)


@pytest.mark.parametrize("case", ["skewed", "one_group"])
def test_wgrad_out_dtype(case):
    counts = COUNTS[case]
    epn = len(counts) // 2
    x, wl, ws, cu = inputs(counts, dtype=torch.bfloat16, seed=13)
    dy = torch.randn(x.shape[0], wl.shape[1]).to(torch.bfloat16)
    gl, gs = gg.grouped_mm_wgrad(dy, x, cu, epn, out_dtype=torch.bfloat16)
    assert gl.dtype == torch.bfloat16 and gs.dtype == torch.bfloat16
    rl, rs = naive_wgrad(dy, x, cu, epn)
    assert rel_err(torch.cat([gl, gs]), torch.cat([rl, rs])) < 1e-2
    with pytest.raises(TypeError, match="out_dtype"):
        gg.grouped_mm_wgrad(dy, x, cu, epn, out_dtype=torch.float16)
    opcheck(torch.ops.moonep.grouped_mm_wgrad.default, (dy, x, cu, epn, -1, torch.bfloat16))


def test_wgrad_accumulates():
    counts = COUNTS["skewed"]
    epn = len(counts) // 2
    x, wl, ws, cu = inputs(counts, seed=3)
    dy = torch.randn(x.shape[0], wl.shape[1])
    base_l = torch.randn(epn, wl.shape[1], wl.shape[2])
    base_s = torch.randn(epn, wl.shape[1], wl.shape[2])
    gl, gs = base_l.clone(), base_s.clone()
    gg.grouped_mm_wgrad_accumulate(dy, x, cu, gl, gs)
    rl, rs = naive_wgrad(dy, x, cu, epn)
    assert rel_err(gl, base_l.double() + rl) < 1e-6
    assert rel_err(gs, base_s.double() + rs) < 1e-6
    gg.grouped_mm_wgrad_accumulate(dy, x, cu, gl, gs)   # twice: += again
    assert rel_err(gl, base_l.double() + 2 * rl) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(COUNTS))
def test_wgrad_into_writes_once(case, dtype):
    """Local grads overwritten (empty local groups -> 0), non-empty slots overwritten, empty
    slots untouched: the pool's unused slots keep whatever they hold (zero, in the MoE path)."""
    counts = COUNTS[case]
    epn = len(counts) // 2
    x, wl, ws, cu = inputs(counts, dtype=dtype, seed=21)
    dy = torch.randn(x.shape[0], wl.shape[1]).to(dtype)
    gl = torch.full((epn, wl.shape[1], wl.shape[2]), 7.0, dtype=dtype)   # poison
    gs = torch.full_like(gl, -3.0)
    gg.grouped_mm_wgrad_into(dy, x, cu, gl, gs)
    rl, rs = naive_wgrad(dy, x, cu, epn)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(gl, rl) < tol                    # empty local groups: rl is 0 there
    for b in range(epn):
        if counts[epn + b] > 0:
            assert rel_err(gs[b], rs[b]) < tol
        else:
            assert torch.all(gs[b] == -3.0), f"empty slot {b} was written"
    with pytest.raises(TypeError, match="input dtype"):
        gg.grouped_mm_wgrad_into(dy, x, cu, gl.double(), gs.double())
    with pytest.raises(ValueError, match="shape"):
        gg.grouped_mm_wgrad_into(dy, x, cu, gl[:, 1:], gs)
    opcheck(torch.ops.moonep.grouped_mm_wgrad_into.default, (dy, x, cu, gl, gs, -1))


def test_padding_rows_not_read():
    x, wl, ws, cu = inputs(COUNTS["skewed"], pad=5, seed=4)
    x2 = x.clone()
    x2[int(cu[-1]):] = float("nan")
    y = gg.grouped_mm(x2, wl, ws, cu)
    assert torch.equal(y, gg.grouped_mm(x, wl, ws, cu))


# ------------------------------------------------------------------------------------------
# autograd
# ------------------------------------------------------------------------------------------

def test_autograd_matches_naive():
    counts = COUNTS["skewed"]
    epn = len(counts) // 2
    x, wl, ws, cu = inputs(counts, dtype=torch.float64, seed=5, requires_grad=True)
    dy = torch.randn(x.shape[0], wl.shape[1], dtype=torch.float64)
    gg.grouped_mm(x, wl, ws, cu).backward(dy)
    assert rel_err(x.grad, naive_dgrad(dy, wl.detach(), ws.detach(), cu)) < 1e-12
    rl, rs = naive_wgrad(dy, x.detach(), cu, epn)
    assert wl.grad.dtype == wl.dtype
    assert rel_err(wl.grad, rl) < 1e-6 and rel_err(ws.grad, rs) < 1e-6   # fp32 accumulation


def test_gradcheck_small():
    x, wl, ws, cu = inputs([2, 0, 1, 3], N=3, K=4, pad=1, dtype=torch.float64, seed=6,
                           requires_grad=True)
    # weight grads are accumulated in fp32 (the kernels' contract), so loosen the tolerance
    assert torch.autograd.gradcheck(lambda a, b, c: gg.grouped_mm(a, b, c, cu), (x, wl, ws),
                                    eps=1e-6, atol=1e-4, rtol=1e-3)


def test_partial_requires_grad():
    x, wl, ws, cu = inputs(COUNTS["skewed"], seed=7)
    wl.requires_grad_(True)
    y = gg.grouped_mm(x, wl, ws, cu)
    y.sum().backward()
    assert wl.grad is not None and x.grad is None and ws.grad is None


# ------------------------------------------------------------------------------------------
# opcheck, fake / meta, compile
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["skewed", "all_empty"])
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("zero_tail", [True, False])
def test_opcheck_forward(case, requires_grad, zero_tail):
    # (zero_tail=False only here: the CPU reference writes zeros, which "undefined" allows; a
    # kernel's undefined rows would differ between opcheck's runs)
    x, wl, ws, cu = inputs(COUNTS[case], seed=8, requires_grad=requires_grad)
    opcheck(torch.ops.moonep.grouped_mm.default, (x, wl, ws, cu, -1, zero_tail))


def test_zero_tail_false_keeps_group_rows_and_grads():
    # The option changes only the rows past cu[-1]: group rows and every gradient (x's tail
    # included, its true value 0) are those of the default.
    x, wl, ws, cu = inputs(COUNTS["skewed"], seed=12, requires_grad=True)
    end = int(cu[-1])
    assert end < x.shape[0]                      # the case has a tail
    outs = []
    for zt in (True, False):
        for t in (x, wl, ws):
            t.grad = None
        y = gg.grouped_mm(x, wl, ws, cu, zero_tail=zt)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
        y.backward(dy)
        dx = gg.grouped_mm_dgrad(dy, wl.detach(), ws.detach(), cu, zero_tail=zt)
        outs.append((y[:end].detach().clone(), x.grad.clone(), wl.grad.clone(),
                     ws.grad.clone(), dx[:end].clone()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.all(outs[1][1][end:] == 0)      # autograd's dx tail: zero either way


def test_opcheck_backward_ops():
    counts = COUNTS["skewed"]
    epn = len(counts) // 2
    x, wl, ws, cu = inputs(counts, seed=9)
    dy = torch.randn(x.shape[0], wl.shape[1])
    opcheck(torch.ops.moonep.grouped_mm_dgrad.default, (dy, wl, ws, cu, -1))
    opcheck(torch.ops.moonep.grouped_mm_dgrad.default, (dy, wl, ws, cu, -1, False))
    opcheck(torch.ops.moonep.grouped_mm_wgrad.default, (dy, x, cu, epn, -1))
    gl = torch.zeros(epn, wl.shape[1], wl.shape[2])
    opcheck(torch.ops.moonep.grouped_mm_wgrad_accumulate.default,
            (dy, x, cu, gl, torch.zeros_like(gl), -1))


def test_meta_and_fake_cuda_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(100, 64, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(4, 32, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(8, dtype=torch.int32, device="cuda")
        y = gg.grouped_mm(x, w, w, cu)
        assert y.shape == (100, 32) and y.device.type == "cuda" and y.dtype == torch.bfloat16
        dx = gg.grouped_mm_dgrad(y, w, w, cu)
        assert dx.shape == (100, 64)
        gl, gs = gg.grouped_mm_wgrad(y, x, cu, 4)
        assert gl.shape == (4, 32, 64) and gl.dtype == torch.float32
    xm = torch.empty(10, 8, device="meta")
    wm = torch.empty(2, 16, 8, device="meta")
    cum = torch.empty(4, dtype=torch.int32, device="meta")
    assert gg.grouped_mm(xm, wm, wm, cum).shape == (10, 16)


def test_compile_fullgraph_aot_eager():
    torch._dynamo.reset()
    x, wl, ws, cu = inputs(COUNTS["skewed"], seed=10, requires_grad=True)

    def f(a, b, c, d):
        return gg.grouped_mm(a, b, c, d).square().sum()

    loss = torch.compile(f, backend="aot_eager", fullgraph=True)(x, wl, ws, cu)
    loss.backward()
    ref_x = x.grad.clone()
    x.grad = None
    f(x, wl, ws, cu).backward()
    assert torch.allclose(ref_x, x.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------
# bad input: clear errors before any kernel runs
# ------------------------------------------------------------------------------------------

def _bad_cases():
    x, wl, ws, cu = inputs(COUNTS["skewed"], seed=11)
    return [
        ("cu int64", (x, wl, ws, cu.long()), TypeError, "int32"),
        ("cu length", (x, wl, ws, cu[:-1]), ValueError, "length"),
        ("cu 2-D", (x, wl, ws, cu[None]), ValueError, "1-D"),
        ("cu decreasing", (x, wl, ws, torch.tensor([5, 4, 6, 7, 8, 9], dtype=torch.int32)),
         ValueError, "non-decreasing"),
        ("cu past M", (x, wl, ws, cu + 100), ValueError, "non-decreasing"),
        ("x cols", (x[:, :-1], wl, ws, cu), ValueError, "columns"),
        ("x 3-D", (x[None], wl, ws, cu), ValueError, "2-D"),
        ("w shapes differ", (x, wl, ws[:, :-1], cu), ValueError, "same shape"),
        ("w 2-D", (x, wl[0], ws, cu), ValueError, "3-D"),
        ("w dtype", (x, wl.double(), ws, cu), TypeError, "differ"),
        ("x dtype", (x.double(), wl, ws, cu), TypeError, "dtype"),
        ("int weights", (x, wl.int(), ws.int(), cu), TypeError, "floating"),
        ("not a tensor", (x.tolist(), wl, ws, cu), TypeError, "Tensor"),
    ]


@pytest.mark.parametrize("name,args,exc,msg", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_forward(name, args, exc, msg):
    with pytest.raises(exc, match=msg):
        gg.grouped_mm(*args)


def test_bad_input_other_ops():
    counts = COUNTS["skewed"]
    epn = len(counts) // 2
    x, wl, ws, cu = inputs(counts, seed=12)
    dy = torch.randn(x.shape[0], wl.shape[1])
    with pytest.raises(ValueError, match="columns"):
        gg.grouped_mm_dgrad(dy[:, 1:], wl, ws, cu)
    with pytest.raises(ValueError, match="rows"):
        gg.grouped_mm_wgrad(dy[1:], x, cu, epn)
    with pytest.raises(ValueError, match="length"):
        gg.grouped_mm_wgrad(dy, x, cu, epn + 1)
    with pytest.raises(ValueError, match="epn"):
        gg.grouped_mm_wgrad(dy, x, cu, 0)
    gl = torch.zeros(epn, wl.shape[1], wl.shape[2])
    with pytest.raises(TypeError, match="float32"):
        gg.grouped_mm_wgrad_accumulate(dy, x, cu, gl.double(), gl.double())
    with pytest.raises(ValueError, match="shape"):
        gg.grouped_mm_wgrad_accumulate(dy, x, cu, gl[:, 1:], gl)
    with pytest.raises(ValueError, match="config"):
        gg.grouped_mm(x, wl, ws, cu, config=99)
    with pytest.raises(ValueError, match="unknown"):
        gg.grouped_mm(x, wl, ws, cu, config="nope")
    with pytest.raises(TypeError, match="zero_tail must be a bool"):
        gg.grouped_mm(x, wl, ws, cu, zero_tail=0)
    with pytest.raises(TypeError, match="zero_tail must be a bool"):
        gg.grouped_mm_dgrad(dy, wl, ws, cu, zero_tail=None)
    with pytest.raises(ValueError, match="length"):   # also from the fake (meta) path
        gg.grouped_mm(x.to("meta"), wl.to("meta"), ws.to("meta"), cu[:-1].to("meta"))


# ------------------------------------------------------------------------------------------
# backend selection and the native loader (no GPU here)
# ------------------------------------------------------------------------------------------

def test_backend_choice_on_cpu():
    assert gg.backend_for(torch.empty(1, dtype=torch.bfloat16), 16, 16) == "reference"


def test_native_loader_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONEP_LIB_DIR", str(tmp_path))
    monkeypatch.delenv("MOONEP_DISABLE_NATIVE", raising=False)
    lib = native._Lib("libmoonep_gemm.so", "moonep_gemm_abi_version", native.GEMM_ABI_VERSION,
                      native.GEMM_PROTOTYPES, {})
    assert lib.load() is None and "not found" in lib.error
    monkeypatch.setattr(native, "_GEMM", lib)
    assert native.gemm() is None and "not found" in native.gemm_load_error()
    with pytest.raises(native.NativeLibraryMissing, match="build"):
        native.require_gemm()


@pytest.fixture
def no_gemm_env(monkeypatch):
    for v in ("MOONEP_GEMM_CANDIDATES", "MOONEP_GEMM_FAMILY", "MOONEP_GEMM_PDL"):
        monkeypatch.delenv(v, raising=False)
    gg.clear_plan_cache()
    yield
    gg.clear_plan_cache()


def test_candidate_mask_by_mean_rows(no_gemm_env):
    # The "moonep" configs of a kind are fused into one kernel, so a candidate costs no launch:
    # the device model chooses among all of them, except a config for small groups
    # (max_mean_rows: p64x256) once the buffer holds more rows per group, and one for large groups
    # (min_mean_rows: s256x128) while it holds fewer.  "torch" configs are never candidates.
    for kind in gemm_cost_model.KINDS:
        cfgs = gemm_cost_model.CONFIGS[kind]
        for rows_per_group in (1, 64, 65, 255, 256, 4096):
            mask = gg.candidate_mask(kind, rows_per_group * 96, 96)
            for i, c in enumerate(cfgs):
                want = (c.family == "moonep"
                        and (not c.max_mean_rows or rows_per_group <= c.max_mean_rows)
                        and (not c.min_mean_rows or rows_per_group >= c.min_mean_rows))
                assert bool((mask >> i) & 1) == want, (kind, c.name, rows_per_group)
    assert any(c.max_mean_rows for c in gemm_cost_model.CONFIGS["fwd"] if c.BM == 64)
    assert "p64x256" not in gemm_cost_model.candidates("fwd", 32768, 64)
    assert "p64x256" in gemm_cost_model.candidates("dgrad", 4096, 64)
    assert "s256x128" in gemm_cost_model.candidates("fwd", 256 * 32, 32)
    assert "s256x128" not in gemm_cost_model.candidates("fwd", 255 * 32, 32)


def test_at_most_five_candidates_per_call():
    # The prep kernel's cost grows with each candidate (<= 5 us needs <= 5): every shape region.
    for kind in gemm_cost_model.KINDS:
        for rpg in list(range(1, 600, 7)) + [1023, 1024, 4096, 65536]:
            for O, I in ((768, 2048), (2048, 768), (7168, 2048), (2880, 2880), (128, 4096)):
                fam, names = gemm_cost_model.call_candidates(kind, rpg * 32, 32, O, I)
                assert 1 <= len(names) <= 5, (kind, rpg, O, I, names)
                assert {gemm_cost_model.CONFIGS[kind][gemm_cost_model.config_index(kind, n)].family
                        for n in names} == {fam}


def test_select_skips_non_candidates(monkeypatch):
    # 96 groups of 40 rows: every "moonep" config but s256x128 is a candidate; the same histogram
    # in a buffer of 65 rows per group leaves p64x256 out, and select() applies the same rule.
    monkeypatch.setattr(gemm_tuning, "NEVER_LOSE_MARGIN", {})        # the moonep family only
    counts, N, K = np.full(96, 40), 2048, 7168
    cands = gemm_cost_model.candidates("dgrad", 40 * 96, 96)
    assert "s256x128" not in cands and "t128x256" not in cands
    pred = gemm_cost_model.predict(counts, N, K, "dgrad", configs=cands)
    vol = {n: gemm_cost_model.mma_volume(counts, N, K, "dgrad", n) for n in pred}
    others = {n: t for n, t in pred.items() if n != "p64x256"}
    assert gemm_cost_model.select(counts, N, K, "dgrad") == gemm_cost_model.pick(
        pred, vol, "dgrad", gemm_cost_model.tie_tolerance("dgrad", 40 * 96, 96))
    big = gemm_cost_model.select(counts, N, K, "dgrad", rows=65 * 96)
    assert big == gemm_cost_model.pick(others, vol, "dgrad") and big != "p64x256"


def test_torch_config_is_torchs_rule():
    # aten GroupMM.cu: small = (M <= 128 || N <= 128) -> ping-pong 64x128x128, else cooperative
    # 128x256x64; 2-D x 3-D divides M by G (integer), 2-D x 2-D takes M = O, N = I.
    tc = gemm_cost_model.torch_config
    assert tc("fwd", 128 * 64, 64, 4096, 7168) == "t64x128"
    assert tc("fwd", 129 * 64, 64, 4096, 7168) == "t128x256"
    assert tc("fwd", 8192, 16, 128, 7168) == "t64x128"          # N = O <= 128
    assert tc("dgrad", 8192, 16, 128, 7168) == "t128x256"       # dgrad's N is I
    assert tc("dgrad", 8192, 16, 4096, 128) == "t64x128"
    assert tc("wgrad_lp", 64, 64, 768, 2048) == "t128x256"      # wgrad: M/G plays no part
    assert tc("wgrad_lp", 1 << 20, 8, 128, 2048) == "t64x128"
    assert tc("wgrad", 8192, 16, 4096, 7168) is None            # no torch family for fp32 +=
    for kind in ("fwd", "dgrad", "wgrad_lp"):
        fam = {c.name: c for c in gemm_cost_model.CONFIGS[kind] if c.family == "torch"}
        assert {(c.BM, c.BN, c.BK, c.CM, c.CN, c.pingpong) for c in fam.values()} == {
            (128, 256, 64, 2, 1, False), (64, 128, 128, 2, 1, True)}


def test_torch_family_tiles_round_m_to_the_cluster():
    # CUTLASS's group scheduler rounds each group's M tiles up to the 2x1 cluster: 3 tiles of
    # 128 rows become 4; the N tiles are not rounded (CN = 1)
    t = gemm_cost_model.CONFIGS["fwd"][gemm_cost_model.config_index("fwd", "t128x256")]
    tiles = gemm_cost_model.rows_tiles(np.array([384, 0, 256, 1]), 768, t)
    assert tiles.tolist() == [4 * 3, 0, 2 * 3, 2 * 3]
    assert gemm_cost_model.mma_volume([384, 0, 256], 768, 2048, "fwd", "t128x256") == 18 * 128 * 256
    w = gemm_cost_model.CONFIGS["wgrad_lp"][gemm_cost_model.config_index("wgrad_lp", "t128x256")]
    assert gemm_cost_model.wgrad_tiles(640, 2048, w) == 6 * 8        # 5 O tiles -> 6
    # the 1x2 swap twin: token tiles of 128 in pairs, weight tiles of 256 not rounded (CM = 1)
    s = gemm_cost_model.CONFIGS["fwd"][gemm_cost_model.config_index("fwd", "s256x128")]
    assert gemm_cost_model.rows_tiles(np.array([384, 1, 0]), 768, s).tolist() == [4 * 3, 2 * 3, 0]


def test_never_lose_rule(monkeypatch, no_gemm_env):
    """family_for: the torch family exactly where the model on the shape's balanced probe predicts
    torch's kernel within (1 + margin) of our best candidate; never for wgrad (fp32 +=); the op's
    mask follows it (one family per call) and MOONEP_GEMM_FAMILY forces it."""
    rows, G, O, I = 20480, 32, 768, 2048
    probe = gemm_cost_model.balanced_probe(rows, G)
    assert probe.tolist() == [1024] * 16 + [0] * 16           # (20480 - 127*32) // 16 -> 1024
    assert gemm_cost_model.balanced_probe(100, 4).tolist() == [50, 50, 0, 0]
    r = gemm_cost_model.never_lose_ratio("fwd", rows, G, O, I)
    pred = gemm_cost_model.predict(probe, O, I, "fwd")
    best = min(pred[n] for n in gemm_cost_model.candidates("fwd", rows, G))
    assert r == pytest.approx(pred["t128x256"] / best)
    for margin, fam in ((r - 1 + 1e-6, "torch"), (r - 1 - 1e-6, "moonep")):
        monkeypatch.setattr(gemm_tuning, "NEVER_LOSE_MARGIN", {"fwd": margin})
        gg.clear_plan_cache()
        assert gemm_cost_model.family_for("fwd", rows, G, O, I) == fam
        _, names = gemm_cost_model.call_candidates("fwd", rows, G, O, I)
        mask = gg.candidate_mask("fwd", rows, G, O, I)
        cfgs = gemm_cost_model.CONFIGS["fwd"]
        assert {c.name for i, c in enumerate(cfgs) if (mask >> i) & 1} == set(names)
        assert names == (["t128x256"] if fam == "torch" else
                         gemm_cost_model.candidates("fwd", rows, G))
        counts = [1024] * 16 + [0] * 16
        assert (gemm_cost_model.select(counts, O, I, "fwd", rows=rows) == "t128x256") == (
            fam == "torch")
    monkeypatch.setattr(gemm_tuning, "NEVER_LOSE_MARGIN", {})
    assert gemm_cost_model.family_for("fwd", rows, G, O, I) == "moonep"
    monkeypatch.setattr(gemm_tuning, "NEVER_LOSE_MARGIN", {"wgrad": 10.0, "fwd": 10.0})
    assert gemm_cost_model.family_for("wgrad", rows, G, O, I) == "moonep"
    assert gemm_cost_model.family_for("fwd", 0, G, O, I) == "moonep"
    gg.clear_plan_cache()
    monkeypatch.setenv("MOONEP_GEMM_FAMILY", "moonep")
    assert gg.candidate_mask("fwd", rows, G, O, I) == gg.candidate_mask("fwd", rows, G)
    monkeypatch.setenv("MOONEP_GEMM_FAMILY", "torch")
    assert gg.candidate_mask("fwd", 128 * G, G, O, I) == 1 << gemm_cost_model.config_index(
        "fwd", "t64x128")
    assert gg.candidate_mask("wgrad", rows, G, O, I) == gg.candidate_mask("wgrad", rows, G)
    monkeypatch.setenv("MOONEP_GEMM_FAMILY", "bogus")
    with pytest.raises(ValueError, match="MOONEP_GEMM_FAMILY"):
        gg.candidate_mask("fwd", rows, G, O, I)
    monkeypatch.delenv("MOONEP_GEMM_FAMILY")
    monkeypatch.setenv("MOONEP_GEMM_CANDIDATES", "c128x256,t128x256")
    with pytest.raises(ValueError, match="both families"):
        gg.candidate_mask("fwd", rows, G, O, I)


def test_families_are_contiguous_and_share_a_cluster():
    # prep.cu: the configs of a family follow one after the other, family 0 ("moonep", cluster
    # 1 x 2) first; one fused kernel per family needs one cluster shape
    for kind, cfgs in gemm_cost_model.CONFIGS.items():
        fams = [c.family for c in cfgs]
        assert fams == sorted(fams, key=gemm_cost_model.FAMILIES.index), kind
        for fam in set(fams):
            assert len({(c.CM, c.CN) for c in cfgs if c.family == fam}) == 1, (kind, fam)
        assert fams[0] == "moonep"
    assert all(c.family == "moonep" for c in gemm_cost_model.CONFIGS["wgrad"])


def test_abi_version_matches_header():
    text = (ROOT / "cutlass_kernels" / "moonep_gemm.h").read_text()
    # ABI 10 = ABI 8 plus the FP8 GEMM, 11 = 10 plus MOONEP_GEMM_KEEP_TAIL: native.py loads
    # any of them (native.GEMM_ABI_VERSIONS)
    assert int(re.search(r"#define MOONEP_GEMM_ABI_VERSION (\d+)", text).group(1)) in \
        native.GEMM_ABI_VERSIONS
    for flag, value in (("KEEP_EMPTY_SLOTS", gg._KEEP_EMPTY_SLOTS), ("PDL", gg._PDL),
                        ("KEEP_TAIL", gg._KEEP_TAIL)):
        assert int(re.search(rf"#define MOONEP_GEMM_{flag} (\d+)", text).group(1)) == value


def test_tie_tolerance_is_wider_only_on_small_groups():
    # The regime is the buffer's rows per group (shapes only): the wide window exactly where a
    # small-group config is a candidate, i.e. never for the wgrad kinds, which have none.
    for kind in gemm_cost_model.KINDS:
        has_small = any(c.max_mean_rows for c in gemm_cost_model.CONFIGS[kind])
        for rows, G in ((64 * 96, 96), (65 * 96, 96), (1, 64), (32768, 64), (0, 8)):
            small = has_small and rows <= 64 * G
            assert gemm_cost_model.small_groups(kind, rows, G) == small, (kind, rows, G)
            assert gemm_cost_model.tie_tolerance(kind, rows, G) == (
                gemm_tuning.SELECT_TIE_TOL_SMALL if small else gemm_tuning.SELECT_TIE_TOL)
        assert gemm_cost_model.tuning_table(kind, 0.125)[-1] == 0.125
    assert gemm_cost_model.small_groups("fwd", 64 * 96, 96)
    assert not gemm_cost_model.small_groups("wgrad_lp", 1, 64)


def test_candidate_mask_env(monkeypatch, no_gemm_env):
    monkeypatch.setenv("MOONEP_GEMM_CANDIDATES", "p128x128, c128x256")
    assert gg.candidate_mask("fwd", 1024, 8) == 0b011
    assert gg.candidate_mask("fwd", 1024, 8, 4096, 4096) == 0b011
    monkeypatch.setenv("MOONEP_GEMM_CANDIDATES", "")
    assert gg.candidate_mask("wgrad", 1024, 8) == 0b111


def test_cxx_config_table_matches_python():
    text = (ROOT / "cutlass_kernels" / "configs.h").read_text()
    rows = re.findall(r"X\((\w+), (\w+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+)\)",
                      text)
    from_cxx = {}
    for kind, name, *nums in rows:
        from_cxx.setdefault(kind, []).append((name, *map(int, nums)))
    for kind, cfgs in gemm_cost_model.CONFIGS.items():
        assert [(c.name, c.BM, c.BN, c.BK, c.CM, c.CN, int(c.pingpong), c.EN, int(c.swap))
                for c in cfgs] == from_cxx[kind]
        assert set(gemm_tuning.EFFICIENCY[kind]) == {c.name for c in cfgs}
    # One fused kernel per family: kernel_<kind>.cu ("moonep") and kernel_<kind>_2x1.cu
    # ("torch") list the family's configs in the same order, and prep.cu registers both.
    unit = {"moonep": "kernel_{}.cu", "torch": "kernel_{}_2x1.cu"}
    want = sorted({unit[c.family].format(k) for k, cfgs in gemm_cost_model.CONFIGS.items()
                   for c in cfgs})
    # kernel_fp8_*.cu: the FP8 grouped GEMM, its configs in fp8_cost.py (tests/test_fp8_cost.py)
    units = sorted(p.name for p in (ROOT / "cutlass_kernels").glob("kernel_*.cu")
                   if not p.name.startswith("kernel_fp8"))
    assert units == want
    prep = (ROOT / "cutlass_kernels" / "prep.cu").read_text()
    for kid, (kind, cfgs) in enumerate(gemm_cost_model.CONFIGS.items()):
        listed = []
        for fam in gemm_cost_model.FAMILIES:
            name = unit[fam].format(kind)
            if (ROOT / "cutlass_kernels" / name).exists():
                src = (ROOT / "cutlass_kernels" / name).read_text()
                entry = name[len("kernel_"):-len(".cu")]
                assert f"MOONEP_DEFINE_KIND({entry}," in src and f"&kind_entry_{entry}" in prep
                listed += re.findall(r"GroupedGemm<(\d+), (\d+), (\d+), (\d+), (\d+), (\d+), "
                                     r"(true|false)(?:, (\d+))?>", src)
        # swap-AB configs are kernel kinds 4 (fwd) and 5 (dgrad) in gemm_kernel.cuh
        assert [(int(k), *map(int, g[:5]), g[5] == "true", int(g[6] or 0)) for k, *g in listed] == \
            [(kid + 4 if c.swap else kid, c.BM, c.BN, c.BK, c.CM, c.CN, c.pingpong, c.EN)
             for c in cfgs], kind


# ------------------------------------------------------------------------------------------
# cost model
# ------------------------------------------------------------------------------------------

def _zipf_counts(G, total, s, seed=0):
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, G + 1) ** s
    rng.shuffle(w)
    c = np.floor(w / w.sum() * total).astype(int)
    c[0] += total - c.sum()
    return c


@pytest.mark.parametrize("kind", gemm_cost_model.KINDS)
def test_cost_model_basic(kind):
    N, K = 4096, 7168
    counts = _zipf_counts(64, 32768, 0.8)
    pred = gemm_cost_model.predict(counts, N, K, kind)
    assert set(pred) == {c.name for c in gemm_cost_model.CONFIGS[kind]}
    # the pick is the fastest predicted of the call's family, or a near-tie (SELECT_TIE_TOL) with
    # less MMA work
    _, names = gemm_cost_model.call_candidates(kind, int(counts.sum()), len(counts), N, K)
    fam = {n: pred[n] for n in names}
    pick, fastest = gemm_cost_model.select(counts, N, K, kind), min(fam, key=fam.get)
    assert pred[pick] <= pred[fastest] * (1 + gemm_tuning.SELECT_TIE_TOL)
    vol = lambda n: gemm_cost_model.mma_volume(counts, N, K, kind, n)  # noqa: E731
    idx = lambda n: gemm_cost_model.config_index(kind, n)  # noqa: E731
    assert pick == fastest or (vol(pick), idx(pick)) < (vol(fastest), idx(fastest))
    max_eta = max(v[0] for v in gemm_tuning.EFFICIENCY[kind].values())
    floor_us = gemm_cost_model.flops(counts, N, K) / (gemm_tuning.PEAK_TFLOPS * 1e6 * max_eta)
    for name, t in pred.items():
        assert np.isfinite(t) and t >= floor_us, (name, t, floor_us)
    # more rows never predicts less time (up to a round's tau_sw: more tiles can move two group
    # starts into one round, which pays the switch once)
    more = counts.copy()
    more[3] += 500
    pred2 = gemm_cost_model.predict(more, N, K, kind)
    assert all(pred2[n] >= pred[n] * (1 - 1e-4) - gemm_tuning.EFFICIENCY[kind][n][2]
               for n in pred)
    # nothing to do: launch cost only
    empty = gemm_cost_model.predict([0] * 64, N, K, kind)
    assert all(empty[c] == gemm_tuning.EFFICIENCY[kind][c][3] for c in empty)


def test_cost_model_tile_waste_and_memory_bound():
    N, K = 4096, 7168
    # 129-row groups: a 128-row tile wastes almost a whole second tile; the swap config's two
    # 80-row token tiles (160 rows) do not
    pred = gemm_cost_model.predict([129] * 64, N, K, "fwd")
    eta = {n: v[0] for n, v in gemm_tuning.EFFICIENCY["fwd"].items()}
    ratio = (pred["c128x256"] / pred["s256x80"]) * (eta["c128x256"] / eta["s256x80"])
    assert ratio > 1.2
    # one row per group: bound by streaming the weights, ~ G*N*K*2 bytes at the HBM rate
    G = 128
    t = min(gemm_cost_model.predict([1] * G, 2048, 7168, "fwd").values())
    weights_us = G * 2048 * 7168 * 2 / (gemm_tuning.HBM_TBPS * 1e6)
    assert weights_us <= t <= 3 * weights_us + 50


def test_cost_model_wgrad_lpt_order_invariant():
    counts = _zipf_counts(64, 65536, 1.5, seed=3)
    a = gemm_cost_model.predict(counts, 2048, 7168, "wgrad")
    b = gemm_cost_model.predict(counts[::-1].copy(), 2048, 7168, "wgrad")
    assert a == b     # the kernel sorts groups largest first, so input order does not matter


def test_cost_model_bad_input():
    with pytest.raises(ValueError):
        gemm_cost_model.predict([], 16, 16)
    with pytest.raises(ValueError):
        gemm_cost_model.predict([1, -1], 16, 16)
    with pytest.raises(ValueError):
        gemm_cost_model.predict([1, 1], 16, 16, kind="bwd")
    assert len(gemm_cost_model.tuning_table("fwd")) == 3 + 5 * len(gemm_cost_model.CONFIGS["fwd"])
    assert gemm_cost_model.tuning_table("fwd")[-1] == gemm_tuning.SELECT_TIE_TOL


def test_select_breaks_near_ties_towards_less_mma(monkeypatch):
    # G = 96 groups of 64 rows, N = 2048, K = 7168 (the streaming benchmark).  The swap config
    # pads each group's 64 rows to a 2 x 96-row cluster, so it does more MMA than c128x256's one
    # 128-row tile; tau0 (an additive constant) is moved so that it predicts slightly faster:
    # within the tie tolerance select() keeps the lesser MMA, outside it the faster prediction.
    counts, N, K = [64] * 96, 2048, 7168
    vol = {n: gemm_cost_model.mma_volume(counts, N, K, "fwd", n) for n in ("c128x256", "s256x96")}
    assert vol["s256x96"] > vol["c128x256"]
    small, big = gemm_tuning.SELECT_TIE_TOL_SMALL, gemm_tuning.SELECT_TIE_TOL
    assert gemm_cost_model.tie_tolerance("fwd", 64 * 96, 96) == small > big
    # (faster by, buffer rows, winner): 64 rows per group is the small-group regime, where the
    # window is SELECT_TIE_TOL_SMALL; the same counts in a buffer of 65 rows per group are not
    between = (small + big) / 2
    for faster_by, rows, winner in ((small / 4, None, "c128x256"), (4 * small, None, "s256x96"),
                                    (between, None, "c128x256"), (between, 65 * 96, "s256x96"),
                                    (big / 4, 65 * 96, "c128x256")):
        eff = {k: dict(v) for k, v in gemm_tuning.EFFICIENCY.items()}
        for n in eff["fwd"]:
            if n not in vol:   # the other configs out of the way
                eff["fwd"][n] = eff["fwd"][n][:3] + (1e6,) + eff["fwd"][n][4:]
        monkeypatch.setattr(gemm_tuning, "EFFICIENCY", eff)
        pred = gemm_cost_model.predict(counts, N, K, "fwd")
        target = pred["c128x256"] * (1 - faster_by)
        c = eff["fwd"]["s256x96"]
        eff["fwd"]["s256x96"] = c[:3] + (c[3] + target - pred["s256x96"],) + c[4:]
        pred = gemm_cost_model.predict(counts, N, K, "fwd")
        assert pred["s256x96"] == pytest.approx(target)
        assert gemm_cost_model.select(counts, N, K, "fwd", rows=rows) == winner, (faster_by, rows)
    # the rule itself: within the tolerance the least volume, outside it the fastest, equal
    # volumes to the first listed
    tol = gemm_tuning.SELECT_TIE_TOL
    names = [c.name for c in gemm_cost_model.CONFIGS["fwd"]]
    v = {names[0]: 2.0, names[1]: 1.0, names[2]: 1.0}
    assert gemm_cost_model.pick({names[0]: 100.0, names[1]: 100.0 * (1 + tol / 2),
                                 names[2]: 200.0}, v, "fwd") == names[1]
    assert gemm_cost_model.pick({names[0]: 100.0, names[1]: 100.0 * (1 + 2 * tol),
                                 names[2]: 200.0}, v, "fwd") == names[0]
    assert gemm_cost_model.pick({names[0]: 101.0, names[1]: 100.0, names[2]: 100.0}, v,
                                "fwd") == names[1]
    # wgrad: the volume is the output tiling's (t_w * BM * BN)
    cfg = gemm_cost_model.CONFIGS["wgrad"][0]
    t_w = -(-2048 // cfg.BM) * (-(-(-(-7168 // cfg.BN)) // cfg.CN) * cfg.CN)
    assert gemm_cost_model.mma_volume([5, 0, 7], 2048, 7168, "wgrad", cfg.name) == \
        t_w * cfg.BM * cfg.BN


def test_build_rebuilds_when_any_header_changes(tmp_path):
    # A unit is stale when its source or any header of its folder (.h, .hpp, .cuh) is newer
    # than its object: gemm_kernel.cuh holds every kernel's code.
    import os

    from moonep_ops import build

    src, obj = tmp_path / "k.cu", tmp_path / "k.o"
    src.write_text("")
    obj.write_text("")
    os.utime(src, (1000, 1000))
    os.utime(obj, (2000, 2000))
    assert not build._stale(src, obj)
    for name in ("a.cuh", "b.h", "c.hpp"):
        hdr = tmp_path / name
        hdr.write_text("")
        os.utime(hdr, (3000, 3000))
        assert build._stale(src, obj), name
        os.utime(hdr, (1500, 1500))
    assert not build._stale(src, obj)
    assert build._stale(src, tmp_path / "missing.o")


def _synthetic_zoo(path, kind, cases_spec, scale=1.3, peak=None, hbm=None):
    """A zoo-format JSON (bench_gemm_zoo.py's schema) of one kind whose forced times are the
    model's predictions x scale, half of the histograms held out, torch at the model's t128x256."""
    import json
    hists, cases = [], []
    for i, (G, O, I, counts) in enumerate(cases_spec):
        hid = f"synthetic/ep{i}/s1/h{i}"
        rows = int(sum(counts)) + 127 * G
        hists.append(dict(id=hid, family="synthetic", ep=i, s=1, hist=f"h{i}", G=G, M=rows,
                          counts=[int(c) for c in counts], held_out=bool(i % 2)))
        pred = gemm_cost_model.predict(counts, O, I, kind)
        us = {n: scale * v for n, v in pred.items()}
        us["torch"] = scale * pred["t128x256"]
        cases.append(dict(hist=hid, proj="p", kind=kind, O=O, I=I, M=rows, us=us))
    cfgs = [dict(name=c.name) for c in gemm_cost_model.CONFIGS[kind]]
    path.write_text(json.dumps(dict(
        schema="moonep-gemm-zoo/1", complete=True, configs={kind: cfgs}, hists=hists, cases=cases,
        meta=dict(peak_tflops=peak, hbm_tbps=hbm, sm_count=132), probes={})))
    return path


def test_calibration_refits_only_the_kinds_asked(tmp_path, monkeypatch):
    """The one fit (benchmarks/fit_gemm_cost_model.py, on committed-format JSON), --kinds
    wgrad_lp: wgrad_lp's constants are refitted from the measurements (every config, deterministic:
    the same input twice gives the same file); every other kind, the dense peak and the copy
    bandwidth stay as the tuning file has them (they were fitted together), and the source names
    the input file.  calibrate_grouped_gemm.py --from-json delegates to it."""
    import copy
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import fit_gemm_cost_model as fit
    before = copy.deepcopy(gemm_tuning.EFFICIENCY)
    peak, hbm = gemm_tuning.PEAK_TFLOPS, gemm_tuning.HBM_TBPS
    rng = np.random.default_rng(0)
    spec = []
    for i, (G, O, I) in enumerate(((32, 4096, 7168), (64, 2048, 7168), (48, 4096, 1536),
                                   (16, 768, 2048), (32, 2048, 768), (8, 2880, 2880))):
        spec.append((G, O, I, (rng.integers(0, 8, G) * 128).tolist()))
    src = _synthetic_zoo(tmp_path / "zoo_synthetic.json", "wgrad_lp", spec * 4,
                         peak=2 * peak, hbm=2 * hbm)
    outs = []
    for run in range(2):
        out = tmp_path / f"tuning_{run}.json"
        if run:     # a different starting file: the fit must not depend on it
            text = (tmp_path / "tuning_0.json").read_text().replace("0.0", "0.5", 3)
            out.write_text(text)
        assert fit.main([str(src), "--kinds", "wgrad_lp", "--write", str(out)]) == 0
        outs.append(gemm_tuning.read(out))
    new = outs[0]
    assert outs[1]["EFFICIENCY"]["wgrad_lp"] == new["EFFICIENCY"]["wgrad_lp"]
    assert (new["PEAK_TFLOPS"], new["HBM_TBPS"]) == (round(peak, 1), round(hbm, 3))
    assert list(new["EFFICIENCY"]) == list(gemm_cost_model.KINDS)
    for kind in ("fwd", "dgrad", "wgrad"):
        assert new["EFFICIENCY"][kind] == {n: tuple(v) for n, v in before[kind].items()}
    assert set(new["EFFICIENCY"]["wgrad_lp"]) == {c.name for c in gemm_cost_model.CONFIGS["wgrad_lp"]}
    assert new["EFFICIENCY"]["wgrad_lp"] != {n: tuple(v) for n, v in before["wgrad_lp"].items()}
    assert not new["SEEDED"].get("wgrad_lp")           # every wgrad_lp config measured
    assert "zoo_synthetic.json" in new["CALIBRATION_SOURCES"]["wgrad_lp"]
    assert "fit_gemm_cost_model" in new["CALIBRATION_SOURCES"]["wgrad_lp"]
    assert {k: new["CALIBRATION_SOURCES"][k] for k in ("fwd", "dgrad", "wgrad")} == {
        k: gemm_tuning.CALIBRATION_SOURCES[k] for k in ("fwd", "dgrad", "wgrad")}
    assert set(new["NEVER_LOSE_MARGIN"]) <= {"fwd", "dgrad", "wgrad_lp"}
    with pytest.raises(SystemExit, match="unknown kind"):
        fit.main([str(src), "--kinds", "wgrad,bogus", "--write", str(tmp_path / "x.json")])
    # calibrate_grouped_gemm.py --from-json runs the same fit
    monkeypatch.setattr(sys, "argv", ["calibrate_grouped_gemm.py"])
    import calibrate_grouped_gemm as cal
    out = tmp_path / "tuning_cal.json"
    assert cal.main(["--from-json", str(src), "--kinds", "wgrad_lp", "--write", str(out)]) == 0
    assert gemm_tuning.read(out)["EFFICIENCY"] == new["EFFICIENCY"]


def test_bench_report_and_kinds_option(monkeypatch, capsys):
    """bench_grouped_gemm.py: an unknown --kinds is refused before anything runs, and the report
    prints the streaming roofline columns (older JSON without a bound prints nan)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_grouped_gemm as bench
    with pytest.raises(SystemExit):
        bench.main(["--kinds", "fwd,bogus"])
    assert "unknown kind" in capsys.readouterr().err
    s = dict(G=96, rows_per_group=160, ours_tbps=3.4, best_tbps=3.41, torch_tbps=2.55,
             bound_tbps=3.86, device_choice="s256x80")
    md = bench.report([], [s, {k: v for k, v in s.items() if k != "bound_tbps"}], {}, env="x")
    assert "| 96 | 160 | 3.40 | 3.41 | 2.55 | 3.86 | 0.88 | s256x80 |" in md
    assert "| nan | nan | s256x80 |" in md


def test_tuning_follows_the_device_kind(monkeypatch):
    """The GEMM launcher puts the constants of the call's kind of GPU in force before it plans
    (gemm.tuning.DEVICE_FILES: an H100 gets tuning_h100.json, other devices tuning.json) and
    forgets the plans and tables made with the others; the tables differ between the files."""
    from moonep_ops.ops import grouped_mm_kernels as gk
    tuning, gcm = gemm_tuning, gemm_cost_model
    assert tuning.file_for("NVIDIA H100 80GB HBM3") == "tuning_h100.json"
    assert tuning.file_for("NVIDIA H200") == tuning.DEFAULT_FILE == "tuning.json"
    assert tuning.ACTIVE_FILE == "tuning.json"
    h200 = gcm.tuning_table("fwd")
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    monkeypatch.setattr(gk, "_TUNING_FILE", {})
    gk.ENTRIES[("probe",)] = ()
    try:
        gk.use_tuning_of(torch.device("cuda", 0))
        assert tuning.ACTIVE_FILE == "tuning_h100.json" and not gk.ENTRIES
        h100 = gcm.tuning_table("fwd")
        assert h100 != h200 and h100 == gcm.tuning_table("fwd")
        assert tuning.EFFICIENCY == tuning.read("tuning_h100.json")["EFFICIENCY"]
        gk.ENTRIES[("probe",)] = ()
        gk.use_tuning_of(torch.device("cuda", 0))            # in force already: nothing forgotten
        assert ("probe",) in gk.ENTRIES
        gk.use_tuning_of(torch.device("cuda", 1))
        assert tuning.ACTIVE_FILE == "tuning.json" and gcm.tuning_table("fwd") == h200
        gk.use_tuning_of(torch.device("cpu"))                 # off CUDA: nothing changes
        assert tuning.ACTIVE_FILE == "tuning.json"
    finally:
        tuning.select(tuning.DEFAULT_FILE)
        gk.clear_plan_cache()
