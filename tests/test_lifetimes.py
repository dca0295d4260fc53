"""Lifetimes: a Buffer owns its backend and its ExpertPools, and ``destroy()`` frees them.

Hundreds of create / forward / destroy cycles keep the process's resident memory flat, and the
registry's live counts return to where they were.  The sizes are chosen so that leaking one
pool per cycle would exceed the noise band many times over (asserted too, so the test cannot
pass vacuously), and a deliberate leak of the pool's tensors is shown to be caught.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys

import torch

import moonep_ops  # noqa: F401
from moonep_ops import registry
from moonep_ops.buffer import Buffer
from moonep_ops.nn.moe import MoonEPMoE

S, D, K, E, F, TP = 16, 64, 2, 4, 256, 4      # R = 1: B = E = 4 home experts, 4 slots
DTYPE = torch.float32
NOISE_BYTES = 8 << 20                        # allowed RSS growth over the measured cycles
WARMUP, CYCLES, TRIALS = 20, 300, 3


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _layer_forward(buf: Buffer, x: torch.Tensor) -> torch.Tensor:
    """The MoE layer on ``buf`` (the one place that knows the layer's constructor)."""
    return MoonEPMoE.for_buffer(buf, F)(x)


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(S, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(S)]).to(torch.int32)
    rw = torch.rand(S, K, generator=g)
    B = E
    w1 = torch.randn(B, F, D, generator=g) * 0.05
    w3 = torch.randn(B, F, D, generator=g) * 0.05
    w2 = torch.randn(B, D, F, generator=g) * 0.05
    return x, ids, rw, (w1, w3, w2)


def _cycle(x, ids, rw, weights, keep=None) -> int:
    """One Buffer's whole life: pool, dispatch, experts, combine, the layer, destroy.
    Returns the pool's bytes.  ``keep``: a list to leak the pool's tensors into."""
    buf = Buffer(S, D, K, E, dtype=DTYPE, token_padding=TP)
    pool = buf.expert_pool(D, F, DTYPE)
    h, w, cu, plan = buf.dispatch(x, ids, rw)
    y, _, _ = torch.ops.moonep.moe_experts(h, cu, plan.experts_to_copy, *weights, pool.name)
    out, _ = buf.combine(plan, (y * w[:, None]).contiguous())
    layer_out = _layer_forward(buf, x)
    assert out.shape == layer_out.shape == x.shape and torch.isfinite(out).all()
    nbytes = pool.nbytes()
    if keep is not None:
        keep.append(pool.tensors())
    buf.destroy()
    return nbytes


def _growth(cycles: int, keep=None) -> tuple[int, int]:
    """(RSS growth over ``cycles`` cycles after the warm-up, pool bytes per cycle)."""
    x, ids, rw, weights = _inputs()
    for _ in range(WARMUP):
        nbytes = _cycle(x, ids, rw, weights)
    gc.collect()
    before = _rss()
    for _ in range(cycles):
        _cycle(x, ids, rw, weights, keep)
    gc.collect()
    return _rss() - before, nbytes


def _rss_checks() -> None:
    torch.manual_seed(0)
    # the least of TRIALS windows: a leak grows RSS in every window, the allocator's occasional
    # untrimmed heap top in one (measured: 9-11 MiB in single windows of 2 of 4 whole-suite
    # runs, 0.3-0.6 MiB in standalone ones)
    growth, pool_bytes = min(_growth(CYCLES) for _ in range(TRIALS))
    # a leaked pool per cycle would be 10x the band at least: the test is not vacuous
    assert pool_bytes * CYCLES > 10 * NOISE_BYTES, (pool_bytes, CYCLES)
    assert growth < NOISE_BYTES, (f"RSS grew {growth / 2**20:.1f} MiB over {CYCLES} cycles "
                                  f"(a pool is {pool_bytes / 2**20:.2f} MiB)")
    # and the measurement sees such a leak: keep the pools' tensors alive for a few cycles
    keep: list = []
    n = 4 * NOISE_BYTES // pool_bytes + 1
    leaked, _ = _growth(n, keep)
    assert leaked > 2 * NOISE_BYTES, f"a leak of {n} pools grew RSS by {leaked / 2**20:.1f} MiB"
    del keep


def test_create_forward_destroy_keeps_rss_flat():
    """In a fresh process: RSS measures the heap, which earlier tests of the same process leave in
    any state (freed memory the leaked pools could reuse unseen)."""
    code = ("import sys; sys.path.insert(0, %r); import test_lifetimes as t; t._rss_checks(); "
            "print('ok')" % os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_destroy_returns_registry_counts():
    gc.collect()
    pools, backends = registry.live_count("pool"), registry.live_count("backend")
    bufs = [Buffer(S, D, K, E, dtype=DTYPE, token_padding=TP) for _ in range(3)]
    for b in bufs:
        b.expert_pool(D, F, DTYPE)
        b.expert_pool(D, 2 * F, DTYPE)
        b.expert_pool(D, F, DTYPE)                       # same shape: the same pool
    assert registry.live_count("pool") == pools + 6
    assert registry.live_count("backend") == backends + 3
    x, ids, rw, _ = _inputs()
    _layer_forward(bufs[0], x)                           # the layer uses the Buffer's pool
    assert registry.live_count("pool") == pools + 6
    names = [p.name for b in bufs for p in b._pools.values()]
    for b in bufs:
        b.destroy()
        b.destroy()                                      # idempotent
    assert registry.live_count("pool") == pools
    assert registry.live_count("backend") == backends
    for n in names:
        assert n not in registry._LIVE
