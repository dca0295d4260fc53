"""Soak: N compiled training steps (mode="reduce-overhead") of a MoE layer on the CUDA
symmetric-memory backend with fresh random routing every step (every other step skewed).

    python benchmarks/soak_cuda.py [--steps 1000] [--tokens 1024]

Checks, and exits non-zero when one fails: peak device memory after step N equals the peak after
step 1; no recompilation (set_stance("fail_on_recompile") after warm-up); no CUDA-graph
re-recording after warm-up (counted on inductor's cudagraph-tree manager); the Buffer's device
error word stays 0; losses finite.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch._dynamo.utils import counters

from moonep_ops import Buffer, MoonEPMoE
from moonep_ops.nn.train_step import enable_backward_tracing, sgd_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    a = ap.parse_args(argv)
    enable_backward_tracing()
    records = [0]
    try:                                           # count CUDA-graph recordings
        from torch._inductor import cudagraph_trees as ct
        orig = ct.CUDAGraphTreeManager.record_function

        def counted(self, *args, **kw):
            records[0] += 1
            return orig(self, *args, **kw)
        ct.CUDAGraphTreeManager.record_function = counted
    except (ImportError, AttributeError):
        records[0] = -1
    s, D, E, K = a.tokens, a.dim, a.experts, a.topk
    buf = Buffer(s, D, K, E, token_padding=128, dtype=torch.bfloat16, device="cuda", backend="symm")
    torch.manual_seed(0)
    layer = MoonEPMoE.for_buffer(buf, a.hidden)
    params = list(layer.parameters())
    skew = torch.linspace(-1, 1, D, device="cuda") * 2.0

    step = sgd_step(layer, params, 1e-3, mean=True)

    cstep = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    g = torch.Generator(device="cuda").manual_seed(1)

    def batch(i):
        x = torch.randn(s, D, device="cuda", generator=g)
        if i % 2:
            x = x + skew                                  # skewed routing on odd steps
        return x.bfloat16(), torch.randn(s, D, device="cuda", generator=g)

    for i in range(3):                                    # warm-up: compile, record
        cstep(*batch(i))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    rec0 = records[0]
    losses = torch.zeros(a.steps, device="cuda")        # preallocated: no per-step growth
    t0 = time.time()
    torch.compiler.set_stance("fail_on_recompile")
    try:
        losses[0].copy_(cstep(*batch(3)))
        torch.cuda.synchronize()
        peak1 = torch.cuda.max_memory_allocated()
        for i in range(4, a.steps + 3):
            losses[i - 3].copy_(cstep(*batch(i)))
    finally:
        torch.compiler.set_stance("default")
    torch.cuda.synchronize()
    dt = time.time() - t0
    peakN = torch.cuda.max_memory_allocated()
    err = buf.backend.error_word() if hasattr(buf.backend, "error_word") else 0
    finite = all(math.isfinite(v) for v in losses.tolist())
    rerecords = records[0] - rec0 if records[0] >= 0 else "n/a"
    skips = counters["inductor"].get("cudagraph_skips", 0)
    ok = peak1 == peakN and err == 0 and finite and rerecords in (0, "n/a") and skips == 0
    print(f"soak: {a.steps} steps in {dt:.1f} s ({dt / a.steps * 1e3:.2f} ms/step), tokens={s} "
          f"D={D} F={a.hidden} E={E} K={K}; peak after step 1 {peak1 / 2**20:.1f} MiB, after "
          f"step {a.steps} {peakN / 2**20:.1f} MiB; graph re-recordings {rerecords}; "
          f"recompiles 0 (fail_on_recompile); cudagraph skips {skips}; error word {err}; "
          f"losses finite {finite}: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
