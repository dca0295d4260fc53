"""Soak: N compiled training steps (mode="reduce-overhead") of a MoE layer on the CUDA
symmetric-memory backend with fresh random routing every step (every other step skewed), a
Quantile-Balancing step after each, and a batch with NaN tokens every ``--nan-every`` steps.

    python benchmarks/soak_cuda.py [--steps 2000] [--tokens 1024] [--nan-every 100]

Checks, and exits non-zero when one fails: peak device memory after step N equals the peak after
step 1; no recompilation (set_stance("fail_on_recompile") after warm-up); no CUDA-graph
re-recording after warm-up (counted on inductor's cudagraph-tree manager); the Buffer's device
error word stays 0 (NaN tokens are data, not errors); the loss is finite on every clean step and
not finite on exactly the NaN steps (which the step skips: no update); the balancing bias stays
finite and the router counts exactly the NaN tokens it left out.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch._dynamo.utils import counters

from moonep_ops import Buffer, MoonEPMoE
from moonep_ops.testing.train_step import enable_backward_tracing, sgd_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--nan-every", type=int, default=100, help="a NaN batch every N steps (0: none)")
    ap.add_argument("--nan-tokens", type=int, default=4)
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
    layer = MoonEPMoE.for_buffer(buf, a.hidden, balance_rate=0.1)
    params = list(layer.parameters())
    skew = torch.linspace(-1, 1, D, device="cuda") * 2.0

    step = sgd_step(layer, params, 1e-3, mean=True, skip_nonfinite=True)

    cstep = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    g = torch.Generator(device="cuda").manual_seed(1)

    def is_nan_step(i):
        return a.nan_every and i >= 3 and i % a.nan_every == 0

    def batch(i):
        x = torch.randn(s, D, device="cuda", generator=g)
        if i % 2:
            x = x + skew                                  # skewed routing on odd steps
        if is_nan_step(i):
            x[:a.nan_tokens] = float("nan")
        return x.bfloat16(), torch.randn(s, D, device="cuda", generator=g)

    def run(i):
        loss = cstep(*batch(i))
        layer.update_balance()                            # eager, after the step
        return loss

    for i in range(3):                                    # warm-up: compile, record
        run(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    rec0 = records[0]
    losses = torch.zeros(a.steps, device="cuda")        # preallocated: no per-step growth
    t0 = time.time()
    torch.compiler.set_stance("fail_on_recompile")
    try:
        losses[0].copy_(run(3))
        torch.cuda.synchronize()
        peak1 = torch.cuda.max_memory_allocated()
        for i in range(4, a.steps + 3):
            losses[i - 3].copy_(run(i))
    finally:
        torch.compiler.set_stance("default")
    torch.cuda.synchronize()
    dt = time.time() - t0
    peakN = torch.cuda.max_memory_allocated()
    err = buf.backend.error_word()
    vals = losses.tolist()
    nan_steps = [i - 3 for i in range(3, a.steps + 3) if is_nan_step(i)]
    bad = [j for j, v in enumerate(vals) if not math.isfinite(v)]
    losses_ok = bad == nan_steps
    router = layer.router
    bias_ok = bool(torch.isfinite(router.expert_bias).all())
    counted = router.nonfinite_tokens == len(nan_steps) * a.nan_tokens
    rerecords = records[0] - rec0 if records[0] >= 0 else "n/a"
    skips = counters["inductor"].get("cudagraph_skips", 0)
    ok = (peak1 == peakN and err == 0 and losses_ok and bias_ok and counted
          and rerecords in (0, "n/a") and skips == 0)
    print(f"soak: {a.steps} steps in {dt:.1f} s ({dt / a.steps * 1e3:.2f} ms/step), tokens={s} "
          f"D={D} F={a.hidden} E={E} K={K}; peak after step 1 {peak1 / 2**20:.1f} MiB, after "
          f"step {a.steps} {peakN / 2**20:.1f} MiB; graph re-recordings {rerecords}; "
          f"recompiles 0 (fail_on_recompile); cudagraph skips {skips}; error word {err}; "
          f"{len(nan_steps)} NaN batches, non-finite losses exactly there {losses_ok}, "
          f"NaN tokens counted {router.nonfinite_tokens} ({'ok' if counted else 'WRONG'}), "
          f"bias finite {bias_ok} (|bias| max {float(router.expert_bias.abs().max()):.3f}): "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
