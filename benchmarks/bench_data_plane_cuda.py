"""CUDA data plane on one GPU: dispatch/combine bandwidth vs a device copy, and eager vs
CUDA-graph MoE training steps.

    python benchmarks/bench_data_plane_cuda.py [--only bw,graph]

bw:    R = 1 (and virtual R = 4 sharing the same GPU: each rank's time includes waiting for
       the others, so the copy baseline moves all R ranks' bytes) symmetric-memory backend, bf16,
       K = 8, H = 7168, E = 256, Zipf(1.0) routing.  dispatch_with_plan (stage + send + pull), combine (stage + pull + fp32 sum) and
       a fresh dispatch (histogram exchange + device planning + scatter), each timed with CUDA
       events over 20 launches, against ``dst.copy_(src)`` of the bytes the rank receives
       (nvs_s rows of H bf16).  Ratio = copy time / op time ("fraction of a device copy").
graph: MoonEPMoE forward + backward at s in {128, 1024, 8192} (D=2048, F=1024, K=8, R = 1,
       E=16 experts: the per-rank expert count of e.g. E=384 over R=24) and E=64: eager vs one
       torch.cuda.graph replay of the same step (fresh routing copied in).
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")   # virtual ranks: see VirtualGroup
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
import torch  # noqa: E402

from moonep_ops import Buffer, MoonEPMoE  # noqa: E402
from moonep_ops.testing.virtual_ranks import VirtualGroup, run_threads  # noqa: E402


def _time(fn, iters=20, warm=3):
    """Mean us per call on the current stream (virtual ranks: each thread times its own)."""
    st = torch.cuda.current_stream()
    for _ in range(warm):
        fn()
    st.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(st)
    for _ in range(iters):
        fn()
    e.record(st)
    e.synchronize()
    return s.elapsed_time(e) / iters * 1e3


def bandwidth(R=1, S=8192, H=7168, K=8, E=256, tp=128, combine="auto"):
    """Per rank (one thread and stream each, moonep_ops/testing/virtual_ranks.py): op times; max over ranks."""
    vg = VirtualGroup(R)
    dev = vg.device
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.0      # Zipf-skewed routing

    def rank_fn(r):
        g = torch.Generator(device=dev).manual_seed(r)
        buf = Buffer(S, H, K, E, token_padding=tp, dtype=torch.bfloat16, device=dev,
                     backend=vg.backend(r, combine=combine))
        x = torch.randn(S, H, device=dev, generator=g).bfloat16()
        w = torch.rand(S, K, device=dev, generator=g)
        t = torch.multinomial(p.to(dev).expand(S, E), K, generator=g).int()
        h, _, _, plan = buf.dispatch(x, t, w)
        res = dict(rows=plan.nvs_s,
                   fresh=_time(lambda: buf.dispatch(x, t, w)),
                   disp=_time(lambda: buf.dispatch(x, route_weights_sK=w, plan=plan)),
                   comb=_time(lambda: buf.combine(plan, h)))
        buf.check_errors()
        return res

    per_rank = run_threads(R, rank_fn, timeout_s=300)
    rows = per_rank[0]["rows"]
    src = torch.empty(rows * R, H, dtype=torch.bfloat16, device=dev)   # every rank's bytes
    dst = torch.empty_like(src)
    t_copy = _time(lambda: dst.copy_(src))
    out = {k: max(pr[k] for pr in per_rank) for k in ("fresh", "disp", "comb")}
    return dict(R=R, rows=rows, MB=R * rows * H * 2 / 1e6, copy=t_copy, mode=combine, **out)


def step_graph(s, D=2048, F=1024, E=16, K=8):
    buf = Buffer(s, D, K, E, token_padding=128, dtype=torch.bfloat16, device="cuda",
                 backend="symm")
    torch.manual_seed(0)
    layer = MoonEPMoE.for_buffer(buf, F)
    for p in layer.router.parameters():
        p.requires_grad_(False)
    params = [layer.w1, layer.w3, layer.w2]
    x_s = torch.zeros(s, D, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    gy_s = torch.zeros(s, D, dtype=torch.bfloat16, device="cuda")

    def step():
        out = layer(x_s)
        return torch.autograd.grad(out, [x_s] + params, gy_s)

    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(s, D, device="cuda", generator=g).bfloat16(),
                torch.randn(s, D, device="cuda", generator=g).bfloat16()) for _ in range(4)]
    it = [0]

    def load():
        x, gy = batches[it[0] % 4]
        it[0] += 1
        with torch.no_grad():
            x_s.copy_(x)
            gy_s.copy_(gy)

    def eager():
        load()
        step()

    t_eager = _time(eager, iters=20)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay():
        load()
        graph.replay()

    t_graph = _time(replay, iters=20)
    buf.check_errors()
    return dict(s=s, eager=t_eager, graph=t_graph)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="bw,graph")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if "bw" in a.only:
        print("\n| R (virtual) | combine mode | rows/rank | MB per op | copy us | dispatch us "
              "(frac) | combine us (frac) | dispatch+combine frac | fresh dispatch us |")
        print("|---|---|---|---|---|---|---|---|---|")
        for R, S, mode in ((1, 8192, "direct"), (1, 8192, "stage"), (4, 2048, "stage")):
            r = bandwidth(R=R, S=S, combine=mode)
            both = 2 * r['copy'] / (r['disp'] + r['comb'])
            print(f"| {r['R']} | {mode} | {r['rows']} | {r['MB']:.0f} | {r['copy']:.0f} | "
                  f"{r['disp']:.0f} ({r['copy'] / r['disp']:.2f}) | {r['comb']:.0f} "
                  f"({r['copy'] / r['comb']:.2f}) | {both:.2f} | {r['fresh']:.0f} |", flush=True)
            torch.cuda.empty_cache()
    if "graph" in a.only:
        print("\n| s | eager ms/step | CUDA graph ms/step | speed-up |")
        print("|---|---|---|---|")
        for E in (16, 64):
            for s in (128, 1024, 8192):
                r = step_graph(s, E=E)
                print(f"| {s} (E={E}) | {r['eager'] / 1e3:.3f} | {r['graph'] / 1e3:.3f} | "
                      f"{r['eager'] / r['graph']:.2f}x |", flush=True)
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
