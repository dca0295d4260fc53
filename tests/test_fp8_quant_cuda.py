"""The FP8 quantisers on CUDA (moonep_ops/ops/quantize_fp8_triton.py) against the torch reference
(moonep_ops/ops/quantize_fp8.py), bitwise: e4m3 bytes and fp32 scales, the plain and the
transposed (transpose=True) block quantiser; the layers' fused elementwise kernels (scale_rows,
scale_rows_backward with and without its quantisation, dequantize_rows_bf16) against their
references; and the FP8 layer's backward on CUDA (which runs on those transposed weights and
kernels) against the CPU reference.

Skips without CUDA or without Triton.  Inputs are fresh random values whose magnitude varies
per tile and block (2^-20 .. 2^12), with all-zero tiles, exact powers of two and dims that cut
the last tile short; bf16, fp16 and fp32 inputs; pow2 scales on and off.  Non-finite inputs
(NaN, -NaN, Inf, -Inf): the kernels bitwise the CPU reference (the tile NaN, every other tile
as without it), and the FP8 layer on CUDA keeps a poisoned token to its own output row.
"""
from __future__ import annotations

import pytest
import torch

from moonep_ops.ops import quantize_fp8 as qf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _kernels():
    k = qf._kernels(torch.empty(0, device="cuda"))
    if k is None:
        pytest.skip("Triton is not importable (setup.py extra 'gpu')")
    return k


def _data(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, device="cuda", generator=g)
    # per-128-column magnitude 2^-20 .. 2^12, so scales differ tile to tile
    cols = shape[-1]
    mag = torch.exp2(torch.randint(-20, 13, (shape[-2] if len(shape) > 1 else 1, (cols + 127) // 128),
                                   device="cuda", generator=g).float())
    x = x * mag.repeat_interleave(128, dim=-1)[..., :cols]
    x.view(-1)[:: 97] = 0.0
    x.view(-1)[5:: 131] = 2.0 ** 7                 # exact powers of two
    if x.dim() >= 2 and x.shape[-2] > 3:
        x[..., 3, :] = 0.0                          # an all-zero row -> all-zero tiles
    return x.to(dtype)


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a, b), f"{(a != b).sum().item()} of {a.numel()} differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(1, 16), (37, 200), (515, 2048), (64, 7168), (300, 2112)])
def test_rows_bitwise(shape, dtype, pow2):
    k = _kernels()
    x = _data(shape, dtype, seed=hash((shape, pow2)) % 1000)
    q, s = k.quantize_rows(x, pow2)
    qr, sr = qf.quantize_rows(x, pow2)
    _same(q, qr)
    _same(s, sr)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(16, 16), (200, 336), (2, 256, 512), (4, 2048, 7168 // 4),
                                   (3, 2, 130, 260)])
def test_blocks_bitwise(shape, pow2):
    k = _kernels()
    w = _data(shape, torch.bfloat16, seed=len(shape) * 7 + int(pow2))
    q, s = k.quantize_blocks(w, pow2)
    qr, sr = qf.quantize_blocks(w, pow2)
    _same(q, qr)
    _same(s, sr)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(16, 16), (144, 272), (200, 336), (2, 256, 512),
                                   (4, 2048, 7168 // 4), (3, 2, 130, 260), (2, 7168, 256)])
def test_blocks_transposed_bitwise(shape, dtype, pow2):
    """The kernel's transpose=True (tiles stored transposed from the one read) == the
    reference's quantize(w^T) == the kernel's plain result transposed, bitwise."""
    k = _kernels()
    w = _data(shape, dtype, seed=len(shape) * 11 + int(pow2) + 3)
    q, s = k.quantize_blocks(w, pow2, True)
    qr, sr = qf.quantize_blocks(w, pow2, transpose=True)
    _same(q, qr)
    _same(s, sr)
    qp, sp = k.quantize_blocks(w, pow2)
    _same(q, qp.mT.contiguous())
    _same(s, sp.mT.contiguous())
    qo, so = torch.ops.moonep.quantize_fp8_blocks(w, pow2, True)    # the op routes to it
    _same(qo, q)
    _same(so, s)


# Non-finite input: a NaN or an Inf makes its tile (block) NaN, scale 0x7FC00000 and elements
# 0x7F, every other tile bitwise as without it, and the kernels bitwise the CPU reference (Triton's
# max reduction drops NaN: before the fix a NaN tile kept a finite scale and finite elements).

NAN_SCALE_BITS, NAN_E4M3_BITS = 0x7FC00000, 0x7F
NONFINITE = (float("nan"), -float("nan"), float("inf"), -float("inf"))


def _same_bits(a, b):
    """_same by the bits (a NaN equals only the same NaN)."""
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float8_e4m3fn: torch.uint8}
    assert a.dtype == b.dtype and a.shape == b.shape
    a, b = a.view(view.get(a.dtype, a.dtype)), b.view(view.get(b.dtype, b.dtype))
    assert torch.equal(a, b), f"{(a != b).sum().item()} of {a.numel()} differ"


def _poison(x, seed, n=6):
    """x with n elements set to NaN / -NaN / Inf / -Inf at random places (one in the last
    column: a cut-short tile), and the list of (flat leading index, row, col) it hit."""
    g = torch.Generator().manual_seed(seed)
    x = x.clone()
    flat = x.view(-1, *x.shape[-2:])
    hits = []
    for j in range(n):
        b = int(torch.randint(flat.shape[0], (1,), generator=g))
        r = int(torch.randint(flat.shape[1], (1,), generator=g))
        c = flat.shape[2] - 1 if j == 0 else int(torch.randint(flat.shape[2], (1,), generator=g))
        flat[b, r, c] = NONFINITE[j % 4]
        hits.append((b, r, c))
    return x, hits


def _check_nonfinite(q, s, q_clean, s_clean, bad, in_bad):
    sb, qb = s.view(torch.int32), q.view(torch.uint8)
    assert bool((sb[bad] == NAN_SCALE_BITS).all())
    assert bool((qb[in_bad] == NAN_E4M3_BITS).all())
    assert torch.equal(sb[~bad], s_clean.view(torch.int32)[~bad])
    assert torch.equal(qb[~in_bad], q_clean.view(torch.uint8)[~in_bad])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(1, 16), (37, 200), (515, 2048), (64, 7168)])
def test_rows_nonfinite_bitwise(shape, dtype, pow2):
    k = _kernels()
    x0 = _data(shape, dtype, seed=hash((shape, pow2)) % 1000 + 17)
    x, hits = _poison(x0, seed=shape[0] + int(pow2))
    q, s = k.quantize_rows(x, pow2)
    qr, sr = qf.quantize_rows(x.cpu(), pow2)                     # the CPU reference
    _same_bits(q.cpu(), qr)
    _same_bits(s.cpu(), sr)
    _same_bits(q, qf.quantize_rows(x, pow2)[0])                        # and the reference on CUDA
    bad = torch.zeros_like(s, dtype=torch.bool)
    for _, r, c in hits:
        bad[r, c // 128] = True
    in_bad = bad.repeat_interleave(128, 1)[:, :shape[1]]
    _check_nonfinite(q, s, *k.quantize_rows(x0, pow2), bad, in_bad)
    deq = qf.dequantize_rows(q, s)
    assert torch.equal(deq.isnan(), in_bad) and bool(deq[~in_bad].isfinite().all())
    qo, so = torch.ops.moonep.quantize_fp8_rows(x, pow2)           # the op routes to it
    _same_bits(qo, q)
    _same_bits(so, s)


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(200, 336), (2, 256, 512), (4, 2048, 7168 // 4), (3, 2, 130, 260)])
def test_blocks_nonfinite_bitwise(shape, dtype, pow2, transpose):
    k = _kernels()
    w0 = _data(shape, dtype, seed=len(shape) * 13 + int(pow2) + 5)
    w, hits = _poison(w0, seed=len(shape) + 2 * int(pow2) + int(transpose))
    q, s = k.quantize_blocks(w, pow2, transpose)
    qr, sr = qf.quantize_blocks(w.cpu(), pow2, transpose)       # the CPU reference
    _same_bits(q.cpu(), qr)
    _same_bits(s.cpu(), sr)
    O, I = shape[-2:]
    bad = torch.zeros(s.numel() // s.shape[-1] // s.shape[-2], qf.scale_cols(O),
                      qf.scale_cols(I), dtype=torch.bool, device="cuda")
    for b, r, c in hits:
        bad[b, r // 128, c // 128] = True
    in_bad = bad.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :O, :I]
    if transpose:
        bad, in_bad = bad.mT, in_bad.mT
    _check_nonfinite(q.view(-1, *q.shape[-2:]), s.view(-1, *s.shape[-2:]),
                     *(t.view(-1, *t.shape[-2:]) for t in k.quantize_blocks(w0, pow2, transpose)),
                     bad, in_bad)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", [(37, 200), (515, 2048), (17, 7168)])
def test_scale_rows_backward_nonfinite(shape, pow2):
    """dy's tiles follow the same rule: q and scales bitwise the CPU reference; dy NaN / Inf
    where the reference's is (a NaN's payload may differ between devices' bf16 casts)."""
    k = _kernels()
    y = _data(shape, torch.bfloat16, seed=hash(shape) % 1000 + 27)
    dz, hits = _poison(_data(shape, torch.bfloat16, seed=hash(shape) % 1000 + 28), seed=3)
    w = _row_weights(shape[0], seed=shape[0] + 5)
    got = k.scale_rows_backward(dz, w, y, pow2)
    want = qf.scale_rows_backward(dz.cpu(), w.cpu(), y.cpu(), pow2)
    for a, b in zip(got[1:3], want[1:3]):
        _same_bits(a.cpu(), b)
    dy, dyr = got[0].cpu().float(), want[0].float()
    assert torch.equal(dy.isnan(), dyr.isnan()) and torch.equal(dy.isinf(), dyr.isinf())
    fin = dyr.isfinite()
    assert torch.equal(dy[fin], dyr[fin])
    rows = sorted({r for _, r, _ in hits})
    assert not bool(got[3][rows].isfinite().any())           # d_rows of the poisoned rows


@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_layer_confines_a_nonfinite_token_cuda(pow2):
    """The FP8 layer on CUDA (Triton quantisers, FP8 GEMMs): a token with an Inf or a NaN gets a
    non-finite output row, every other token's row is bitwise the clean run's."""
    _kernels()
    from moonep_ops.buffer import Buffer
    from moonep_ops.nn.moe import MoonEPMoE
    S, D, K, E, F = 48, 272, 3, 4, 144
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(S, D, generator=gen).bfloat16().cuda()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(S)]).int().cuda()
    rw = torch.softmax(torch.randn(S, K, generator=gen), -1).cuda()
    buf = Buffer(S, D, K, E, token_padding=128, dtype=torch.bfloat16, device="cuda",
                 backend="single")
    try:
        layer = MoonEPMoE.for_buffer(buf, F, precision="fp8", fp8_pow2_scales=pow2).cuda()
        with torch.no_grad():
            clean = layer(x, topk_ids=ids, topk_weights=rw)
            for t, val in ((5, float("inf")), (20, float("nan"))):
                xp = x.clone()
                xp[t, 200] = val
                out = layer(xp, topk_ids=ids, topk_weights=rw)
                assert not bool(out[t].isfinite().any()), "the poisoned token's row"
                others = torch.arange(S, device="cuda") != t
                _same_bits(out[others], clean[others])
    finally:
        buf.destroy()


# The FP8 layer's fused elementwise kernels (scale_rows, scale_rows_backward, dequantize_rows_bf16)
# against their references (the torch formulations they replaced in moe_experts_fp8.py), bitwise
# on fresh random inputs: M = 0 and 1, rows and columns that cut the last 16-row block and the
# last 128-column tile short, the DeepSeek-V3 D = 7168 and F = 2048.

FUSED_SHAPES = [(0, 16), (1, 16), (1, 7168), (37, 200), (515, 2048), (64, 7168), (300, 2112),
                (17, 7168)]


def _row_weights(M, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.rand(M, device="cuda", generator=g)
    if M > 4:
        w[1] = 0.0                                   # a padding row
        w[4] = 1.0
    return w


@pytest.mark.parametrize("shape", FUSED_SHAPES)
def test_scale_rows_bitwise(shape):
    k = _kernels()
    y = _data(shape, torch.bfloat16, seed=hash(shape) % 1000)
    w = _row_weights(shape[0], seed=shape[0] + 1)
    z = k.scale_rows(y, w)
    _same(z, qf.scale_rows(y, w))
    _same(z, (y.float() * w[:, None]).to(torch.bfloat16))
    _same(torch.ops.moonep.scale_rows(y, w), z)                  # the op routes to it


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", FUSED_SHAPES)
def test_scale_rows_backward_bitwise(shape, pow2):
    k = _kernels()
    y = _data(shape, torch.bfloat16, seed=hash(shape) % 1000 + 7)
    dz = _data(shape, torch.bfloat16, seed=hash(shape) % 1000 + 8 + int(pow2))
    w = _row_weights(shape[0], seed=shape[0] + 2)
    got = k.scale_rows_backward(dz, w, y, pow2)
    want = qf.scale_rows_backward(dz, w, y, pow2)
    for a, b in zip(got[:3], want[:3]):                          # dy and its tiles: bitwise
        _same(a, b)
    dzf = dz.float()                                             # the old torch lines
    _same(got[0], (dzf * w[:, None]).to(torch.bfloat16))
    # d_rows: the same fp32 terms summed per 128-column tile, then over the tiles; against
    # an fp64 sum, within fp32 reassociation of sum |dz * y| (n = I terms)
    p64 = dzf.double() * y.double()
    exact, mag = p64.sum(-1), p64.abs().sum(-1)
    assert got[3].dtype == torch.float32 and got[3].shape == (shape[0],)
    err = (got[3].double() - exact).abs()
    assert bool((err <= 1e-5 * mag + 1e-30).all()), float((err / (mag + 1e-30)).max())
    assert bool(((want[3].double() - exact).abs() <= 1e-5 * mag + 1e-30).all())
    again = torch.ops.moonep.scale_rows_backward_fp8(dz, w, y, pow2)   # the op routes to it,
    for a, b in zip(again, got):                                       # run to run bitwise
        _same(a, b)


@pytest.mark.parametrize("shape", FUSED_SHAPES)
def test_scale_rows_backward_bf16(shape):
    """The bf16 layer's backward of z = scale_rows(y, w) (no quantisation): dy bitwise the
    FP8 kernel's and the torch formulation's; d_rows within fp32 reassociation of an fp64 sum
    (the same tile sums as the FP8 kernel's, which Triton may reduce in another order: measured
    on an H100, 10-200 rows of a call differ from the quantising variant's in the last bits);
    through autograd of moonep::scale_rows: bitwise the op's outputs."""
    k = _kernels()
    y = _data(shape, torch.bfloat16, seed=hash(shape) % 1000 + 17)
    dz = _data(shape, torch.bfloat16, seed=hash(shape) % 1000 + 18)
    w = _row_weights(shape[0], seed=shape[0] + 3)
    dy, d_rows = torch.ops.moonep.scale_rows_backward(dz, w, y)
    _same(dy, k.scale_rows_backward(dz, w, y, False)[0])
    _same(dy, (dz.float() * w[:, None]).to(torch.bfloat16))
    p64 = dz.double() * y.double()
    err = (d_rows.double() - p64.sum(-1)).abs()
    assert d_rows.dtype == torch.float32 and bool((err <= 1e-5 * p64.abs().sum(-1) + 1e-30).all())
    yr, wr = y.clone().requires_grad_(True), w.clone().requires_grad_(True)
    torch.ops.moonep.scale_rows(yr, wr).backward(dz)
    _same(yr.grad, dy)
    _same(wr.grad, d_rows)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", FUSED_SHAPES)
def test_dequantize_rows_bf16_bitwise(shape, pow2):
    k = _kernels()
    q, s = qf.quantize_rows(_data(shape, torch.bfloat16, seed=hash(shape) % 1000 + 9), pow2)
    h = k.dequantize_rows_bf16(q, s)
    _same(h, qf.dequantize_rows_bf16(q, s))
    _same(h, qf.dequantize_rows(q, s).to(torch.bfloat16))
    _same(torch.ops.moonep.dequantize_fp8_rows(q, s), h)


def test_fused_ops_use_the_kernels_on_cuda(monkeypatch):
    """The three fused ops route CUDA tensors to the kernels (MOONEP_FP8_QUANT=reference back)."""
    k = _kernels()
    calls = []
    for name in ("scale_rows", "scale_rows_backward", "dequantize_rows_bf16"):
        real = getattr(k, name)
        monkeypatch.setattr(k, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    y = _data((40, 272), torch.bfloat16, 4)
    w = _row_weights(40, 5)
    q, s = qf.quantize_rows(y)
    torch.ops.moonep.scale_rows(y, w)
    torch.ops.moonep.scale_rows_backward_fp8(y, w, y, False)
    torch.ops.moonep.dequantize_fp8_rows(q, s)
    assert calls == ["scale_rows", "scale_rows_backward", "dequantize_rows_bf16"]
    monkeypatch.setenv("MOONEP_FP8_QUANT", "reference")
    torch.ops.moonep.scale_rows(y, w)
    torch.ops.moonep.scale_rows_backward_fp8(y, w, y, False)
    torch.ops.moonep.dequantize_fp8_rows(q, s)
    assert len(calls) == 3


def _fp8_layer_grads(device, backend, pow2):
    """Forward + moe_experts_fp8_backward of one rank's FP8 experts on ``device`` (same inputs
    on every device): the five grads and the pool's slots viewed transposed."""
    from moonep_ops.buffer import Buffer
    from moonep_ops.nn.moe import MoonEPMoE
    S, D, K, E, F = 64, 272, 3, 4, 144
    gen = torch.Generator().manual_seed(21)
    w1 = (torch.randn(E, F, D, generator=gen) * 0.1).bfloat16()
    w3 = (torch.randn(E, F, D, generator=gen) * 0.1).bfloat16()
    w2 = (torch.randn(E, D, F, generator=gen) * 0.1).bfloat16()
    x = torch.randn(S, D, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(S)]).int()
    rw = torch.softmax(torch.randn(S, K, generator=gen), -1)
    dz_seed = torch.randn(S * K * 2, D, generator=gen)
    buf = Buffer(S, D, K, E, token_padding=16, dtype=torch.bfloat16, device=device,
                 backend=backend)
    try:
        layer = MoonEPMoE.for_buffer(buf, F, precision="fp8", fp8_pow2_scales=pow2).to(device)
        with torch.no_grad():
            layer.w1.copy_(w1)
            layer.w3.copy_(w3)
            layer.w2.copy_(w2)
        x, ids, rw = x.to(device), ids.to(device), rw.to(device)
        h, hs, wM, cu, plan = buf.dispatch_fp8(x, ids, rw, pow2_scales=pow2)
        ws = (layer.w1.detach(), layer.w3.detach(), layer.w2.detach())
        z, y, g, u = torch.ops.moonep.moe_experts_fp8(
            h, hs, wM, cu, plan.experts_to_copy, *ws, layer.pool_name, x, rw, plan.dst,
            plan.total_num_tokens, pow2)
        dz = dz_seed[:z.shape[0]].to(device).bfloat16()
        grads = torch.ops.moonep.moe_experts_fp8_backward(
            dz, h, hs, wM, y, g, u, cu, plan.experts_to_copy, *ws, layer.pool_name, plan.dst,
            plan.total_num_tokens, pow2)
        from moonep_ops.ops import moe_experts_fp8 as m8
        slots = [t.clone().cpu() for t in m8._pool(layer.pool_name).slot_weights(True)]
        return [t.cpu() for t in grads[:5]], slots          # no biases: grads[5] == []
    finally:
        buf.destroy()


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("backend", ["single", "symm"])
def test_fp8_layer_backward_cuda_matches_cpu_reference(backend, pow2):
    """The backward on CUDA (Triton transposed quantisers, forward GEMM on W^T, slots viewed
    transposed; the symm backend finds the viewed slots' symmetric peers by pointer) against
    the CPU reference: the quantised slots bitwise, the grads to rel 2e-2 (the GEMMs sum in
    another order and a bf16 ulp can move an e4m3 rounding)."""
    _kernels()
    if backend == "symm":
        from moonep_ops import native
        if native.ep() is None:
            pytest.skip("libmoonep_ep.so not built")
    got, got_slots = _fp8_layer_grads("cuda", backend, pow2)
    want, want_slots = _fp8_layer_grads("cpu", "single", pow2)
    for name, a, b in zip(("dx", "d_route_weights", "dw1", "dw3", "dw2"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        a, b = a.double(), b.double()
        rel = float((a - b).norm() / b.norm().clamp_min(1e-30))
        assert rel < 2e-2, (name, rel)
    for a, b in zip(got_slots, want_slots):
        _same(a, b)


def test_ops_use_the_kernels_on_cuda(monkeypatch):
    """The custom ops route CUDA tensors to the kernels (and MOONEP_FP8_QUANT=reference back)."""
    k = _kernels()
    calls = []
    real = k.quantize_blocks
    monkeypatch.setattr(k, "quantize_blocks",
                        lambda w, p, t=False: calls.append(1) or real(w, p, t))
    w = _data((2, 256, 256), torch.bfloat16, 3)
    torch.ops.moonep.quantize_fp8_blocks(w)
    assert calls == [1]
    monkeypatch.setenv("MOONEP_FP8_QUANT", "reference")
    torch.ops.moonep.quantize_fp8_blocks(w)
    assert calls == [1]
