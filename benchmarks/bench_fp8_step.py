"""The MoE layer's training step, FP8 against bf16, at DeepSeek-V3 expert shapes, with one and
with several micro-batches per optimizer step, in CUDA graphs; every variant interleaved in one
process.

    python benchmarks/bench_fp8_step.py [--experts 32,8] [--micro 1,4] [--iters 10]
                                        [--variants bf16,fp8,fp8_cache,fp8_base] [--capture graph|eager]

One rank (R = 1 Buffer), D 7168, F 2048, K 8, 4096 tokens a micro-batch, token_padding 128, so
--experts is the experts a rank holds (32: DeepSeek-V3 at EP 8, 8: at EP 32).  A step is n
micro-batches (forward, loss = sum(out * gy), backward: the grads accumulate) then SGD on every
parameter and, for an FP8 layer with the weight cache, ``refresh_fp8_weights()`` (the cache's
step refresh: both layouts re-quantised once per step, inside the captured step).  Variants:
  bf16      precision "bf16";
  fp8       precision "fp8" with the weight cache and the FP8 wgrad (the recipe of docs/fp8.md);
  fp8_cache precision "fp8" with the weight cache only (bf16 wgrads);
  fp8_base  precision "fp8" without either (fp8_weight_cache=False, fp8_wgrad=False): the recipe
            of the 22.0 vs 19.2 ms table in docs/fp8.md, for attribution.
--capture graph (default): each (variant, n) step captured once in a CUDA graph
(torch.cuda.graph, after two eager warm-up steps on a side stream) and replayed; eager: plain
eager steps (host-bound, for reference).  Timing: every variant's replays interleaved round by
round, CUDA events around each step, median over --iters rounds.  Prints one table: ms per step,
fp8 / bf16 speed-ups, and the goals (one micro-batch >= 1.05x, four >= 1.25x).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import traceback

import torch

from moonep_ops import Buffer, MoEArgs, MoonEPMoE

GOALS = {1: 1.05, 4: 1.25}


class Variant:
    def __init__(self, name, E, a, dev):
        self.name = name
        kw = {}
        if name == "bf16":
            kw = dict(precision="bf16")
        elif name == "fp8":
            kw = dict(precision="fp8", fp8_weight_cache=True, fp8_wgrad=True)
        elif name == "fp8_cache":
            kw = dict(precision="fp8", fp8_weight_cache=True, fp8_wgrad=False)
        elif name == "fp8_base":
            kw = dict(precision="fp8", fp8_weight_cache=False, fp8_wgrad=False)
        else:
            raise SystemExit(f"unknown variant {name!r}")
        self.buf = Buffer(a.tokens, a.dim, a.topk, E, token_padding=128, dtype=torch.bfloat16,
                          device=dev)
        # built on the meta device and initialised on the GPU (the CPU would take seconds to
        # draw 32 experts of DeepSeek-V3 size), the same seed for every variant
        args = MoEArgs(num_experts=E, top_k=a.topk, capacity=a.tokens, token_padding=128, **kw)
        self.layer = MoonEPMoE(args, a.dim, a.hidden, dtype=torch.bfloat16, device="meta")
        self.layer.bind(self.buf)
        torch.manual_seed(0)
        self.layer.init_weights()
        self.params = [p for p in self.layer.parameters() if p.requires_grad]
        g = torch.Generator(device=dev).manual_seed(1)
        n = max(a.micro)
        self.xs = [torch.randn(a.tokens, a.dim, device=dev, generator=g).bfloat16()
                   for _ in range(n)]
        self.gys = [torch.randn(a.tokens, a.dim, device=dev, generator=g) * 1e-2
                    for _ in range(n)]
        self.lr = 1e-6
        self.graphs, self.mode = {}, {}

    def step(self, n):
        loss = None
        for i in range(n):
            out = self.layer(self.xs[i])
            li = (out.float() * self.gys[i]).sum()
            li.backward()
            loss = li.detach() if loss is None else loss + li.detach()
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.sub_(p.grad * self.lr)
                    p.grad = None
        self.layer.refresh_fp8_weights()          # a no-op without a weight cache
        return loss

    def capture(self, n, how):
        if how == "eager":
            self.mode[n] = "eager"
            return
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    self.step(n)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self.loss = self.step(n)
            g.replay()
            torch.cuda.synchronize()
            if not torch.isfinite(self.loss).item():
                raise RuntimeError("non-finite loss in the captured step")
            self.graphs[n], self.mode[n] = g, "graph"
        except Exception:                                   # report, time it eagerly instead
            print(f"  capture of {self.name} x{n} failed, timing it eagerly:\n"
                  + traceback.format_exc(limit=4), flush=True)
            torch.cuda.synchronize()
            self.mode[n] = "eager"

    def run(self, n):
        if self.mode[n] == "graph":
            self.graphs[n].replay()
        else:
            self.step(n)

    def release(self):
        self.graphs.clear()
        self.buf.destroy()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", default="32,8")
    ap.add_argument("--micro", default="1,4")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=7168)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", default="bf16,fp8,fp8_base")
    ap.add_argument("--capture", choices=("graph", "eager"), default="graph")
    a = ap.parse_args(argv)
    a.micro = [int(m) for m in a.micro.split(",")]
    if not torch.cuda.is_available():
        print("bench_fp8_step: needs CUDA")
        return 2
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; D {a.dim} F {a.hidden} "
          f"K {a.topk}, {a.tokens} tokens a micro-batch, R = 1, capture {a.capture}")
    rows = []
    for E in [int(e) for e in a.experts.split(",")]:
        vs = [Variant(n, E, a, dev) for n in a.variants.split(",")]
        for v in vs:
            for n in a.micro:
                v.capture(n, a.capture)
        times = {(v.name, n): [] for v in vs for n in a.micro}
        for r in range(a.iters):
            order = [(v, n) for v in vs for n in a.micro]
            order = order[r % len(order):] + order[:r % len(order)]
            for v, n in order:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                v.run(n)
                e.record()
                torch.cuda.synchronize()
                times[(v.name, n)].append(s.elapsed_time(e))
        for n in a.micro:
            med = {v.name: statistics.median(times[(v.name, n)]) for v in vs}
            modes = {v.name: v.mode[n] for v in vs}
            rows.append((E, n, med, modes))
            print(f"  E {E} x{n}: " + ", ".join(f"{k} {t:.2f} ms ({modes[k]})"
                                                 for k, t in med.items()), flush=True)
        for v in vs:
            v.release()
        del vs
        torch.cuda.empty_cache()
    names = a.variants.split(",")
    print("\n| experts a rank | micro-batches | " + " | ".join(f"{n} ms" for n in names)
          + " | fp8 / bf16 speed-up | goal |")
    print("|---|---|" + "---|" * len(names) + "---|---|")
    for E, n, med, modes in rows:
        sp = med["bf16"] / med["fp8"] if "bf16" in med and "fp8" in med else float("nan")
        goal = GOALS.get(n)
        verdict = "" if goal is None else f">= {goal}: {'MET' if sp >= goal else 'NOT MET'}"
        tag = "" if all(m == "graph" for m in modes.values()) else " (some eager)"
        print(f"| {E} | {n} | " + " | ".join(f"{med[k]:.2f}" for k in names)
              + f" | {sp:.3f}{tag} | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
