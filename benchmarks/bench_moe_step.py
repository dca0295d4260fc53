"""MoE layer training step on one GPU: eager vs torch.compile (default and reduce-overhead).

    python benchmarks/bench_moe_step.py [--tokens 4096] [--dim 2048] [--hidden 1024] [--experts 64]
                                        [--precision bf16|fp8] [--modes default reduce-overhead]

R = 1 Buffer (single-rank backend), bf16, router skewed so the plan is non-trivial.  Reports the
median step time (forward, backward, SGD update) over --iters steps with fresh routing each step,
graph breaks, recompiles, and inductor's cudagraph skips for mode="reduce-overhead".
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch._dynamo.utils import counters

from moonep_ops import Buffer, MoonEPMoE
from moonep_ops.testing.train_step import enable_backward_tracing, sgd_step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                    help="the routed experts' precision (docs/fp8.md)")
    ap.add_argument("--modes", nargs="+", default=["default", "reduce-overhead"],
                    help="torch.compile modes to time after eager")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    enable_backward_tracing()
    dev = torch.device("cuda")
    buf = Buffer(a.tokens, a.dim, a.topk, a.experts, token_padding=128, dtype=torch.bfloat16,
                 device=dev)
    torch.manual_seed(0)
    layer = MoonEPMoE.for_buffer(buf, a.hidden, precision=a.precision)
    params = list(layer.parameters())

    step = sgd_step(layer, params, 1e-6)

    g = torch.Generator(device=dev).manual_seed(1)
    batches = [(torch.randn(a.tokens, a.dim, device=dev, generator=g).bfloat16(),
                torch.randn(a.tokens, a.dim, device=dev, generator=g)) for _ in range(4)]

    def timed(fn, label):
        for i in range(3):
            fn(*batches[i % 4])
        torch.cuda.synchronize()
        ts = []
        for i in range(a.iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(*batches[i % 4])
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        med = statistics.median(ts)
        print(f"| {label} | {med:.3f} | {min(ts):.3f} |", flush=True)
        return med

    print(f"tokens={a.tokens} H={a.dim} F={a.hidden} E={a.experts} K={a.topk} bf16, "
          f"experts {a.precision}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| mode | median ms/step | min ms |")
    print("|---|---|---|")
    t_eager = timed(step, "eager")
    res = {}
    for mode in a.modes:
        torch._dynamo.reset()
        counters.clear()
        cs = torch.compile(step, fullgraph=True, mode=mode)
        res[mode] = timed(cs, f"compile {mode}")
        skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
        print(f"  {mode}: graph breaks {sum(counters['graph_break'].values())}, unique graphs "
              f"{counters['stats']['unique_graphs']}, cudagraph skips {skips}")
    print("; ".join(f"compiled({m}) vs eager: {t_eager / v:.2f}x" for m, v in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
