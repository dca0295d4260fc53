"""GPU tests of the FP8 weight gradient: the token-major Triton quantisers
(moonep_ops/ops/quantize_fp8_tokens_triton.py) bitwise against their CPU reference, the CUTLASS
wgrad kernel (cutlass_kernels/kernel_fp8_wgrad.cu, moonep_grouped_gemm_fp8_wgrad) against the
dequantise-then-fp32-matmul reference, the device's config choice against the host mirror, CUDA
graph replay with new group sizes, and the FP8 layer (weight cache + FP8 wgrad) on the GPU
against the CPU reference, also captured in a CUDA graph.

Skips without CUDA, on a device other than sm90, and (the kernel tests) without a loaded
libmoonep_gemm.so of ABI >= native.GEMM_FP8_WGRAD_ABI_VERSION.

Inputs: fresh random values whose magnitude varies per 128-token tile and per feature (a scale
read from the wrong tile or feature, or a transposed scale grid, moves the result by up to 2^8);
group sizes random, skewed (one hot group), adversarial (every row in one group), with empty
groups, one-row groups and offsets not multiples of 128 (token_padding 1).  Tolerance of the
kernel (it sums in another order and promotes per 128-token K block, then rounds to bf16): per
group max |out - ref| <= 1e-2 * max |ref|; outputs poisoned with NaN first, so an unwritten
element fails; an empty local group's dW is exactly zero, an empty slot group's untouched under
MOONEP_GEMM_KEEP_EMPTY_SLOTS (the _into op).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import moonep_ops  # noqa: F401
from moonep_ops import native
from moonep_ops.gemm import fp8_wgrad_cost as wc
from moonep_ops.ops import quantize_fp8 as qf
from moonep_ops.ops import quantize_fp8_tokens as qt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOL = 1e-2
E4M3 = torch.float8_e4m3fn


def _lib_or_reason():
    if not torch.cuda.is_available():
        return None, "needs CUDA"
    if torch.cuda.get_device_capability() != (9, 0):
        return None, "libmoonep_gemm.so is built for sm_90a"
    lib = native.gemm_fp8_wgrad()
    if lib is None:
        return None, f"FP8 wgrad GEMM not available: {native.gemm_fp8_wgrad_unavailable()}"
    return lib, ""


_LIB, _WHY = _lib_or_reason()
needs_lib = pytest.mark.skipif(_LIB is None, reason=_WHY or "FP8 wgrad GEMM unavailable")


def _triton():
    try:
        from moonep_ops.ops import quantize_fp8_tokens_triton as k
    except ImportError as e:
        pytest.skip(f"triton not importable: {e}")
    return k


_seed = [9100]


def fresh_gen(device="cuda"):
    _seed[0] += 1
    return torch.Generator(device=device).manual_seed(_seed[0])


# group sizes (G = 2 epn): random with empty groups, skewed, adversarial, token_padding 1
COUNTS = {
    "random": [300, 0, 129, 64, 0, 500, 7, 200],
    "skewed": [1500, 3, 0, 1, 0, 0, 40, 2],
    "adversarial": [0, 0, 0, 2000, 0, 0, 0, 0],
    "tp1_singles": [1, 1, 130, 1, 255, 1, 0, 17],
    "aligned": [256, 128, 0, 384, 128, 0, 512, 128],
    "all_empty": [0, 0, 0, 0],
}


def tile_varied(M, F, gen, device="cuda"):
    """[M, F] bf16 whose magnitude varies per 128-row tile and per column (2^-4 .. 2^4)."""
    x = torch.randn(M, F, device=device, generator=gen)
    rs = torch.exp2(torch.randint(-4, 5, ((M + 127) // 128, 1), device=device, generator=gen)
                    .float()).repeat_interleave(128, 0)[:M]
    cs = torch.exp2(torch.randint(-4, 5, (1, F), device=device, generator=gen).float())
    return (x * rs * cs).bfloat16()


def operands(counts, O, I, pad=37, device="cuda", pow2=False):
    M = sum(counts) + pad
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=device)
    g = fresh_gen(device)
    dy, x = tile_varied(M, O, g, device), tile_varied(M, I, g, device)
    return dy, x, cu


def quantised(dy, x, cu, pow2=False):
    return (*qt.quantize_fp8_tokens(dy, cu, pow2_scales=pow2),
            *qt.quantize_fp8_tokens(x, cu, pow2_scales=pow2))


def check_groups(gl, gs, ref_l, ref_s, counts, epn, slots_untouched=None):
    for g, m in enumerate(counts):
        got = (gl[g] if g < epn else gs[g - epn]).float()
        ref = (ref_l[g] if g < epn else ref_s[g - epn]).float()
        if m == 0:
            if g < epn or slots_untouched is None:
                assert torch.equal(got, torch.zeros_like(got)), f"empty group {g} not zero"
            else:
                assert torch.equal((gs[g - epn]).view(torch.int16),
                                   slots_untouched[g - epn].view(torch.int16)), g
            continue
        assert torch.isfinite(got).all(), f"group {g}: non-finite (unwritten?)"
        err = (got - ref).abs().max().item()
        scale = max(ref.abs().max().item(), 1e-30)
        assert err <= TOL * scale, (g, m, err / scale)


# ---- the quantisers: Triton == reference, bitwise, on every written tile ----------------------

def _used(cu, M, G):
    Nb = qt.token_tiles(M, G)
    used = torch.zeros(Nb, dtype=torch.bool)
    for g, s, e, t0 in qt.group_tiles(cu.cpu(), M):
        used[t0:t0 + -(-(e - s) // 128)] = True
    return used


def _same(a, b):
    a, b = a.cpu(), b.cpu()
    if a.dtype == E4M3:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    elif a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    assert a.shape == b.shape and torch.equal(a, b)


def _same_tokens(qT, sT, rq, rs, cu, M):
    used = _used(cu, M, cu.shape[0])
    cols = used.repeat_interleave(128)
    _same(qT.cpu()[:, cols], rq[:, cols])
    _same(sT.cpu()[used], rs[used])


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("case", sorted(COUNTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_token_quantiser_bitwise(case, pow2, dtype):
    _triton()
    counts = COUNTS[case]
    dy, _, cu = operands(counts, 272, 16)
    dy = dy.to(dtype)
    if case == "random":                                   # non-finite tiles stay bitwise too
        dy[5, 3], dy[400, 17], dy[401, 200] = float("nan"), float("inf"), -float("inf")
    qT, sT = qt.quantize_fp8_tokens(dy, cu, pow2_scales=pow2)
    rq, rs = qt.quantize_tokens(dy.cpu(), cu.cpu(), pow2_scales=pow2)
    _same_tokens(qT, sT, rq, rs, cu, dy.shape[0])


@pytest.mark.parametrize("case", ["random", "tp1_singles", "adversarial"])
def test_token_quantiser_from_e4m3_rows_bitwise(case):
    _triton()
    dy, _, cu = operands(COUNTS[case], 7168 // 4, 16)
    h, hs = qf.quantize_fp8_rows(dy)
    qT, sT = qt.quantize_fp8_tokens(h, cu, x_scale=hs)
    rq, rs = qt.quantize_tokens(h.cpu(), cu.cpu(), hs.cpu())
    _same_tokens(qT, sT, rq, rs, cu, h.shape[0])


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("case", ["random", "tp1_singles", "all_empty", "aligned"])
def test_fused_rows_tokens_bitwise(case, pow2):
    _triton()
    dy, y, cu = operands(COUNTS[case], 144, 144)
    rows = int(cu[-1])
    q, s, qT, sT = qt.quantize_fp8_rows_tokens(dy, cu, pow2_scales=pow2)
    rq, rs, rqT, rsT = qt.quantize_rows_tokens(dy.cpu(), cu.cpu(), pow2)
    _same(q[:rows], rq[:rows])                     # the groups' rows (the rest: unspecified)
    _same(s[:rows], rs[:rows])
    _same_tokens(qT, sT, rqT, rsT, cu, dy.shape[0])
    w = torch.rand(dy.shape[0], device="cuda")
    q, s, qT, sT, d = qt.scale_rows_backward_fp8_tokens(dy, w, y, cu, pow2_scales=pow2)
    rq, rs, rqT, rsT, rd = qt.scale_rows_backward_tokens(dy.cpu(), w.cpu(), y.cpu(), cu.cpu(),
                                                         pow2)
    _same(q[:rows], rq[:rows])
    _same(s[:rows], rs[:rows])
    _same_tokens(qT, sT, rqT, rsT, cu, dy.shape[0])
    # d_rows: the kernel sums each tile, then torch the tiles (fp32 reassociation)
    bound = (dy.float() * y.float()).abs().sum(-1).cpu()[:rows] * 1e-5 + 1e-30
    assert bool(((d.cpu()[:rows] - rd[:rows]).abs() <= bound).all())
    assert not d[rows:].any()


# ---- the wgrad kernel ----------------------------------------------------------------------

@needs_lib
def test_config_table_matches_the_library():
    assert _LIB.gemm_fp8_wgrad_num_configs() == len(wc.WGRAD_CONFIGS)
    import ctypes
    for i, cfg in enumerate(wc.WGRAD_CONFIGS):
        out = (ctypes.c_int * 8)()
        assert _LIB.gemm_fp8_wgrad_config_info(i, out) == 0
        assert tuple(out) == cfg.geometry(), cfg.name


@needs_lib
@pytest.mark.parametrize("config", [None] + list(wc.NAMES))
@pytest.mark.parametrize("case", sorted(COUNTS))
def test_wgrad_kernel_matches_reference(case, config):
    from moonep_ops.ops import grouped_mm_fp8_wgrad as gw
    counts = COUNTS[case]
    epn = len(counts) // 2
    O, I = (256, 384) if case != "adversarial" else (2048, 7168 // 4)
    dy, x, cu = operands(counts, O, I)
    q = quantised(dy, x, cu)
    gl = torch.full((epn, O, I), float("nan"), dtype=torch.bfloat16, device="cuda")
    gs = torch.full((epn, O, I), float("nan"), dtype=torch.bfloat16, device="cuda")
    gw._launch(*q, cu, gl, gs, False, config=config)
    torch.cuda.synchronize()
    rl, rs = gw.reference_fp8_wgrad(*(t.cpu() for t in q), cu.cpu(), epn)
    check_groups(gl.cpu(), gs.cpu(), rl, rs, counts, epn)
    # the _into form (MOONEP_GEMM_KEEP_EMPTY_SLOTS): empty slot groups untouched
    before = torch.full_like(gs, 3.0)
    gs2 = before.clone()
    gw.grouped_mm_fp8_wgrad_into(*q, cu, gl, gs2)
    torch.cuda.synchronize()
    check_groups(gl.cpu(), gs2.cpu(), rl, rs, counts, epn, slots_untouched=before.cpu())


@needs_lib
def test_pdl_and_forced_pick_are_bitwise_the_same():
    from moonep_ops.ops import grouped_mm_fp8_wgrad as gw
    counts = COUNTS["random"]
    dy, x, cu = operands(counts, 256, 384)
    q = quantised(dy, x, cu)
    outs = []
    for pdl in (True, False):
        gl = torch.empty(4, 256, 384, dtype=torch.bfloat16, device="cuda")
        gs = torch.empty_like(gl)
        ws = gw._launch(*q, cu, gl, gs, False, pdl=pdl)
        chosen = int(ws[:4].view(torch.int32).item())
        outs.append((gl, gs))
        gl2, gs2 = torch.empty_like(gl), torch.empty_like(gs)
        gw._launch(*q, cu, gl2, gs2, False, config=chosen, pdl=pdl)
        outs.append((gl2, gs2))
    torch.cuda.synchronize()
    for a, b in outs[1:]:
        assert torch.equal(a.view(torch.int16), outs[0][0].view(torch.int16))
        assert torch.equal(b.view(torch.int16), outs[0][1].view(torch.int16))


def _hists(n=24):
    rng = np.random.default_rng(5)
    out = []
    for i in range(n):
        G = int(rng.choice([8, 16, 64]))
        tot = int(rng.choice([256, 4096, 32768]))
        p = rng.dirichlet(np.full(G, float(rng.choice([0.1, 1.0, 10.0]))))
        c = rng.multinomial(tot, p)
        out.append(c.tolist())
    return out


@needs_lib
@pytest.mark.parametrize("counts", _hists(), ids=lambda c: f"G{len(c)}_{sum(c)}")
def test_device_pick_is_the_host_models(counts):
    from moonep_ops.ops import grouped_mm_fp8_wgrad as gw
    for O, I in ((2048, 7168), (768, 2048)):
        M = sum(counts) + 64
        epn = len(counts) // 2
        Nb = qt.token_tiles(M, len(counts))
        cu = torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
        a = torch.zeros(O, Nb * 128, dtype=E4M3, device="cuda")
        b = torch.zeros(I, Nb * 128, dtype=E4M3, device="cuda")
        sa = torch.ones(Nb, O, device="cuda")
        sb = torch.ones(Nb, I, device="cuda")
        gl = torch.empty(epn, O, I, dtype=torch.bfloat16, device="cuda")
        gs = torch.empty_like(gl)
        ws = gw._launch(a, sa, b, sb, cu, gl, gs, False)
        chosen = wc.NAMES[int(ws[:4].view(torch.int32).item())]
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert chosen == wc.select(counts, O, I, sms), (counts, O, I)


@needs_lib
def test_rows_past_m_are_clamped_and_bad_arguments_fail():
    """Offsets past the buffer read nothing out of bounds (clamped on the device); the C
    entry's argument checks fail with a message before any launch."""
    from moonep_ops.ops import grouped_mm_fp8_wgrad as gw
    counts = [100, 50, 0, 30]
    dy, x, cu = operands(counts, 128, 128, pad=0)
    q = quantised(dy, x, cu)
    gl = torch.empty(2, 128, 128, dtype=torch.bfloat16, device="cuda")
    gs = torch.empty_like(gl)
    bad = cu.clone()
    bad[-1] = 10 ** 6
    gw._launch(*q, bad, gl, gs, False)
    torch.cuda.synchronize()                              # no fault
    ws = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = torch.cuda.current_stream().cuda_stream
    Nb = q[1].shape[0]
    base = [q[0].data_ptr(), q[1].data_ptr(), q[2].data_ptr(), q[3].data_ptr(), gl.data_ptr(),
            gs.data_ptr(), cu.data_ptr()]
    table = gw._tuning_table()

    def call(G=4, epn=2, nb=Nb, m=128, n=128, config=-1, flags=0, nbytes=1 << 20, ptrs=base):
        return _LIB.grouped_gemm_fp8_wgrad(*ptrs, G, epn, nb, m, n, config, table, flags,
                                           ws.data_ptr(), nbytes, sms, stream)

    for kw, msg in ((dict(G=6), b"2*epn"), (dict(nb=1), b"n_tiles"), (dict(m=120), b"16"),
                    (dict(config=9), b"config"), (dict(flags=4), b"flags"),
                    (dict(nbytes=16), b"workspace"),
                    (dict(ptrs=[base[0] + 1] + base[1:]), b"aligned")):
        assert call(**kw) == -1, kw
        assert msg in _LIB.gemm_last_error(), (kw, _LIB.gemm_last_error())
    assert call() == 0
    torch.cuda.synchronize()


@needs_lib
def test_nonfinite_token_poisons_its_rows_only():
    from moonep_ops.ops import grouped_mm_fp8_wgrad as gw
    counts = [300, 200, 0, 0]
    dy, x, cu = operands(counts, 256, 256)
    dy[10, 7] = float("nan")                             # group 0, feature o = 7
    gl, gs = gw.grouped_mm_fp8_wgrad(*quantised(dy, x, cu), cu, 2)
    torch.cuda.synchronize()
    assert torch.isnan(gl[0, 7]).all()                   # dW_0[7, :]
    assert torch.isfinite(gl[0, :7]).all() and torch.isfinite(gl[0, 8:]).all()
    assert torch.isfinite(gl[1]).all()


@needs_lib
def test_cuda_graph_replay_reads_new_sizes():
    from moonep_ops.ops import grouped_mm_fp8_wgrad as gw
    counts1 = [300, 0, 129, 64, 0, 500, 7, 200]
    counts2 = [0, 640, 1, 0, 333, 0, 250, 33]
    M = max(sum(counts1), sum(counts2)) + 10
    O, I = 256, 384
    cu = torch.tensor(np.cumsum(counts1), dtype=torch.int32, device="cuda")
    g = fresh_gen()
    dy, x = tile_varied(M, O, g), tile_varied(M, I, g)
    gl = torch.empty(4, O, I, dtype=torch.bfloat16, device="cuda")
    gs = torch.empty_like(gl)

    def step():
        q = quantised(dy, x, cu)
        gw.grouped_mm_fp8_wgrad_into(*q, cu, gl, gs)
        return q

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = step()
    for counts in (counts1, counts2, counts1):
        cu.copy_(torch.tensor(np.cumsum(counts), dtype=torch.int32))
        gl.fill_(float("nan"))
        gs.fill_(0)
        graph.replay()
        torch.cuda.synchronize()
        rl, rs = gw.reference_fp8_wgrad(*(t.cpu() for t in q), cu.cpu(), 4)
        epn = 4
        # empty slot groups: untouched (0 here); so compare them against 0
        check_groups(gl.cpu(), gs.cpu(), rl, rs, counts, epn,
                     slots_untouched=torch.zeros(4, O, I, dtype=torch.bfloat16))


@needs_lib
def test_op_layer_runs_this_kernel():
    from moonep_ops.ops import grouped_mm_fp8_wgrad as gw
    assert gw.backend_for_fp8_wgrad(torch.empty(1, device="cuda")) == "cutlass"
    dy, x, cu = operands(COUNTS["random"], 256, 384)
    q = quantised(dy, x, cu)
    gl, gs = gw.grouped_mm_fp8_wgrad(*q, cu, 4)
    gl2, gs2 = torch.empty_like(gl), torch.empty_like(gs)
    gw._launch(*q, cu, gl2, gs2, False)
    torch.cuda.synchronize()
    assert torch.equal(gl.view(torch.int16), gl2.view(torch.int16))


# ---- the FP8 layer on the GPU: cache + FP8 wgrad against the CPU reference; CUDA graphs -------

def _layer_grads(device, fp8_wgrad, cache):
    from moonep_ops import Buffer, MoonEPMoE
    S, D, K, E, F = 64, 272, 3, 4, 144
    gen = torch.Generator().manual_seed(21)
    w1 = (torch.randn(E, F, D, generator=gen) * 0.1).bfloat16()
    w3 = (torch.randn(E, F, D, generator=gen) * 0.1).bfloat16()
    w2 = (torch.randn(E, D, F, generator=gen) * 0.1).bfloat16()
    x = torch.randn(S, D, generator=gen).bfloat16()
    gy = torch.randn(S, D, generator=gen)
    buf = Buffer(S, D, K, E, token_padding=16, dtype=torch.bfloat16, device=device)
    try:
        layer = MoonEPMoE.for_buffer(buf, F, precision="fp8", fp8_wgrad=fp8_wgrad,
                                     fp8_weight_cache=cache)
        # every parameter from one CPU generator (the router's gate too: initialised on the
        # device, it would route the CUDA and CPU layers differently)
        pgen = torch.Generator().manual_seed(22)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(torch.randn(p.shape, generator=pgen) * 0.1)
            layer.w1.copy_(w1)
            layer.w3.copy_(w3)
            layer.w2.copy_(w2)
        xd = x.to(device).requires_grad_(True)
        out = layer(xd)
        (out.float() * gy.to(device)).sum().backward()
        return [t.detach().cpu() for t in (out, xd.grad, layer.w1.grad, layer.w3.grad,
                                           layer.w2.grad)]
    finally:
        buf.destroy()


@pytest.mark.parametrize("fp8_wgrad,cache", [(True, True), (True, False), (False, True),
                                              (False, False)])
def test_fp8_layer_cuda_matches_cpu_reference(fp8_wgrad, cache):
    _triton()
    if fp8_wgrad and _LIB is None:
        pytest.skip(_WHY)
    got = _layer_grads("cuda", fp8_wgrad, cache)
    want = _layer_grads("cpu", fp8_wgrad, cache)
    for name, a, b in zip(("out", "dx", "dw1", "dw3", "dw2"), got, want):
        rel = float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
        assert rel < 2e-2, (name, rel)


@needs_lib
@pytest.mark.parametrize("step_refresh", [True, False])
def test_captured_training_step_reads_a_fresh_cache(step_refresh):
    """fwd + bwd + SGD + refresh captured in one CUDA graph: replays equal the same steps run
    eagerly, bitwise (with the step refresh the graph reads the cache, refreshed after the
    update inside the graph; without it the graph re-quantises), and the weights change."""
    from moonep_ops import Buffer, MoonEPMoE
    S, D, K, E, F = 256, 512, 4, 8, 256
    dev = torch.device("cuda")

    def build():
        buf = Buffer(S, D, K, E, token_padding=128, dtype=torch.bfloat16, device=dev)
        torch.manual_seed(3)
        layer = MoonEPMoE.for_buffer(buf, F, precision="fp8")
        return buf, layer

    g = torch.Generator(device=dev).manual_seed(4)
    xs = [torch.randn(S, D, device=dev, generator=g).bfloat16() for _ in range(4)]
    gys = [torch.randn(S, D, device=dev, generator=g) for _ in range(4)]

    def step(layer, x, gy):
        out = layer(x)
        (out.float() * gy).sum().backward()
        with torch.no_grad():
            for p in (layer.w1, layer.w3, layer.w2):
                p.sub_(p.grad * 1e-3)
                p.grad = None
            if step_refresh:
                layer.refresh_fp8_weights()
        return out

    buf0, ref = build()
    want = [step(ref, xs[i], gys[i]).clone() for i in range(4)]
    buf1, layer = build()
    sx, sgy = xs[0].clone(), gys[0].clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                      # warm-up step 0, eager on a side stream
        out0 = step(layer, sx, sgy).clone()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sout = step(layer, sx, sgy)
    got = [out0]
    for i in range(1, 4):
        sx.copy_(xs[i])
        sgy.copy_(gys[i])
        graph.replay()
        got.append(sout.clone())
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i
    assert not torch.equal(want[0], want[3])
    buf0.destroy()
    buf1.destroy()
