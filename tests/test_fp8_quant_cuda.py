"""The FP8 quantisers on CUDA (moonep_ops/ops/quantize_fp8_triton.py) against the torch reference
(moonep_ops/ops/quantize_fp8.py), bitwise: e4m3 bytes and fp32 scales.

Skips without CUDA or without Triton.  Inputs are fresh random values whose magnitude varies
per tile and block (2^-20 .. 2^12), with all-zero tiles, exact powers of two and dims that cut
the last tile short; bf16, fp16 and fp32 inputs; pow2 scales on and off.
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


def test_ops_use_the_kernels_on_cuda(monkeypatch):
    """The custom ops route CUDA tensors to the kernels (and MOONEP_FP8_QUANT=reference back)."""
    k = _kernels()
    calls = []
    real = k.quantize_blocks
    monkeypatch.setattr(k, "quantize_blocks", lambda w, p: calls.append(1) or real(w, p))
    w = _data((2, 256, 256), torch.bfloat16, 3)
    torch.ops.moonep.quantize_fp8_blocks(w)
    assert calls == [1]
    monkeypatch.setenv("MOONEP_FP8_QUANT", "reference")
    torch.ops.moonep.quantize_fp8_blocks(w)
    assert calls == [1]
