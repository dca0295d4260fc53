"""Lifetimes on the GPU: 300 create / forward + backward / destroy cycles of a Buffer (CUDA
symmetric-memory backend) with its ExpertPool and a MoE layer keep the allocated device memory
constant; leaking one pool per cycle would exceed the band many times over (asserted too)."""
from __future__ import annotations

import gc

import pytest
import torch

from moonep_ops import Buffer, MoonEPMoE, native, registry

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or native.ep() is None
                                or native.gemm() is None,
                                reason="needs a CUDA device and both moonep libraries")

S, D, K, E, F, TP = 64, 256, 4, 8, 512, 128
WARMUP, CYCLES = 10, 300


def _cycle(x):
    buf = Buffer(S, D, K, E, token_padding=TP, dtype=torch.bfloat16, device="cuda", backend="symm")
    layer = MoonEPMoE.for_buffer(buf, F)
    y = layer(x.requires_grad_())
    y.float().sum().backward()
    buf.check_errors()
    nbytes = buf.expert_pool(D, F, torch.bfloat16).nbytes()
    buf.destroy()
    return nbytes


def test_create_forward_destroy_keeps_device_memory_constant():
    torch.manual_seed(0)
    x = torch.randn(S, D, device="cuda", dtype=torch.bfloat16)
    for _ in range(WARMUP):
        pool_bytes = _cycle(x.detach().clone())
    gc.collect()
    torch.cuda.synchronize()
    pools0, backends0 = registry.live_count("pool"), registry.live_count("backend")
    before = torch.cuda.memory_allocated()
    for _ in range(CYCLES):
        _cycle(x.detach().clone())
    gc.collect()
    torch.cuda.synchronize()
    growth = torch.cuda.memory_allocated() - before
    band = 4 << 20
    assert CYCLES * pool_bytes > 50 * band          # a leaked pool per cycle would show
    assert growth <= band, f"allocated device memory grew by {growth / 2**20:.1f} MiB"
    assert registry.live_count("pool") == pools0 and registry.live_count("backend") == backends0
