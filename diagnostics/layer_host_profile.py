"""Where the host time of one MoE layer step goes, ours against the torchtitan-style layer (R = 1).

    python diagnostics/layer_host_profile.py [--shape small] [--modes eager,compiled] [--steps 20]

Per layer and mode: ms per step back to back, host ms of an isolated step, a cProfile of the
steps (top functions by own time), and torch.profiler's CPU ops by self time with the number of
CUDA kernels a step launches.  The layers and step are those of benchmarks/bench_layer_r1.py.
Compiled, ours: also the host us per call of each moonep custom op's body as the compiled graph
calls it (a timer around each op's implementation; under dynamo, cProfile does not see the
frames the dispatcher enters, so it books them all to torch's backend_impl).
"""
import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import time
from collections import defaultdict

import torch
import torch._library.custom_ops as custom_ops

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))
import bench_layer_r1 as B  # noqa: E402
from moonep_ops.testing.train_step import enable_backward_tracing, sgd_step  # noqa: E402


def time_op_bodies():
    """Wrap every moonep custom op's implementations with a host timer: {op: [seconds]}."""
    spent = defaultdict(list)
    for name, opdef in custom_ops.OPDEFS.items():
        if not name.startswith("moonep::"):
            continue
        for dev, fn in list(opdef._backend_fns.items()):
            def timed(*a, _fn=fn, _n=name, **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    spent[_n].append(time.perf_counter() - t0)
            opdef._backend_fns[dev] = timed
    return spent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="small")
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    T, D, F, E, K = (B.SHAPES | B.TINY)[a.shape]
    ours, titan = B.build(T, D, F, E, K, dev, 128 if dev.type == "cuda" else 8)
    g = torch.Generator(device=dev).manual_seed(1)
    batches = [(torch.randn(T, D, device=dev, generator=g).bfloat16(),
                torch.randn(T, D, device=dev, generator=g)) for _ in range(4)]
    steps = {"titan": sgd_step(titan, list(titan.parameters()), B.LR),
             "ours": sgd_step(ours, list(ours.parameters()), B.LR)}
    enable_backward_tracing()
    for mode in a.modes.split(","):
        for name, s in steps.items():
            f = torch.compile(s, fullgraph=True) if mode == "compiled" else s
            for i in range(4):
                f(*batches[i % 4])
            B._sync(dev)
            ms = B.time_steps(lambda i: f(*batches[i % 4]), a.steps, dev)
            hms = B.host_ms(lambda i: f(*batches[i % 4]), a.steps, dev)
            print(f"\n######## {mode} {name}: {ms:.3f} ms/step back to back, host {hms:.3f} ms "
                  f"isolated", flush=True)
            pr = cProfile.Profile()
            B._sync(dev)
            pr.enable()
            for i in range(a.steps):
                f(*batches[i % 4])
            pr.disable()
            B._sync(dev)
            sio = io.StringIO()
            pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(a.top)
            print(f"--- cProfile {mode} {name} ({a.steps} steps), by own time", flush=True)
            print(sio.getvalue()[-12000:], flush=True)
            if mode == "compiled" and name == "ours":
                spent = time_op_bodies()
                B._sync(dev)
                t0 = time.perf_counter()
                for i in range(a.steps):
                    f(*batches[i % 4])
                wall = (time.perf_counter() - t0) / a.steps
                B._sync(dev)
                tot = sum(sum(v) for v in spent.values()) / a.steps
                print(f"--- op bodies, compiled ours: {tot * 1e6:.0f} us of {wall * 1e6:.0f} us "
                      "host a step", flush=True)
                for n, v in sorted(spent.items(), key=lambda kv: -sum(kv[1])):
                    print(f"  {n:40s} {len(v) / a.steps:4.1f} calls/step  "
                          f"{sum(v) / len(v) * 1e6:7.1f} us/call", flush=True)
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with profile(activities=acts) as p:
                for i in range(3):
                    f(*batches[i % 4])
                B._sync(dev)
            nk = sum(1 for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA)
            print(f"--- torch.profiler {mode} {name}: {nk / 3:.0f} CUDA kernels a step", flush=True)
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top,
                                         max_name_column_width=60), flush=True)
        torch._dynamo.reset()
    ours.buffer.destroy()


if __name__ == "__main__":
    main()
