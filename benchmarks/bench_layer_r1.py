"""The MoE layer step at R = 1 against a torchtitan-style layer: eager, compiled, CUDA graphs.

    python benchmarks/bench_layer_r1.py [--shapes small,qwen3-30b-a3b,mixtral-like,deepseek-v3-ep8]
                                        [--modes eager,compiled,captured] [--rounds 5] [--steps 6]
                                        [--no-hf] [--out DIR] [--tiny]

One training step = forward, loss = sum(fp32(out) * gy), backward, SGD on every parameter
(moonep_ops.testing.train_step.sgd_step), fresh tokens (so fresh routing) every step.  Both layers
are bf16, have the same sizes, one shared SwiGLU expert of width F, a bf16 softmax top-k router
without renormalisation, and the same weights (``TitanStyleMoE.copy_from``): they route every
token identically, and the benchmark checks that their outputs agree before timing them.

  ours   MoonEPMoE bound at R = 1 (Buffer on the GPU: the CUDA symmetric-memory backend,
         token_padding 128), the layer a one-GPU user runs;
  titan  benchmarks/titan_style_layer.py (argsort permutation, torch._grouped_mm, index_add_).

Modes (each a ratio titan / ours of ms per step: > 1 means ours is faster):
  eager     the step as Python runs it; also the host time of one step (the call's duration,
            after a sync, with the GPU idle at its start);
  compiled  torch.compile(step, fullgraph=True), default mode (inductor, no CUDA graphs);
  captured  the eager step captured in a torch.cuda.CUDAGraph and replayed (GPU time only).
  profile   (on request) GPU time per kernel of each layer's eager step (torch.profiler).
The two layers are timed in alternating rounds (titan first in even rounds, ours first in odd
ones), so clock and thermal drift fall on both; the table gives the median over the rounds.

Targets: eager >= 0.9, captured >= 1.0, compiled >= 1.0 on each shape.

The transformers part (skipped with --no-hf or without transformers): the tiny Qwen3-MoE of
tests/test_integrations_hf.py converted with hf.convert_model, its eager training step's host
time, and the host time of its one converted MoE block (forward + backward) per layer.

On CPU (the CI smoke test: --tiny) only the eager mode runs; the numbers mean nothing there.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from titan_style_layer import TitanStyleMoE  # noqa: E402

from moonep_ops import Buffer, MoonEPMoE  # noqa: E402
try:
    from moonep_ops.testing.train_step import enable_backward_tracing, sgd_step
except ImportError:      # a package from before moonep_ops/testing/: the host stage's baseline
    from moonep_ops.nn.train_step import enable_backward_tracing, sgd_step

# name: (tokens, D, F, E, K): the four shapes of the targets
SHAPES = {
    "small": (2048, 2048, 1024, 16, 4),
    "qwen3-30b-a3b": (4096, 2048, 768, 128, 8),
    "mixtral-like": (4096, 4096, 3584, 8, 2),
    "deepseek-v3-ep8": (4096, 7168, 2048, 32, 8),
}
TINY = {"tiny": (64, 32, 24, 8, 2)}
TARGETS = {"eager": 0.9, "compiled": 1.0, "captured": 1.0}
LR = 1e-6


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_steps(fn, n: int, dev) -> float:
    """ms per call of ``fn(i)`` over n calls back to back (CUDA events on the current stream:
    host-bound gaps count; on CPU the wall time)."""
    _sync(dev)
    if dev.type == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n):
            fn(i)
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / n
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) * 1e3 / n


def host_ms(fn, n: int, dev) -> float:
    """Median ms the call of ``fn(i)`` takes on the host, the GPU idle when it starts."""
    ts = []
    for i in range(n):
        _sync(dev)
        t0 = time.perf_counter()
        fn(i)
        ts.append((time.perf_counter() - t0) * 1e3)
    _sync(dev)
    return statistics.median(ts)


def interleaved(fns: dict, rounds: int, measure) -> dict:
    """{name: [value per round]}: every round measures each fn once, the order alternating."""
    names = list(fns)
    out = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            out[n].append(measure(fns[n]))
    return out


# ---------------------------------------------------------------------------------------------
# the two layers
# ---------------------------------------------------------------------------------------------

def build(T, D, F, E, K, dev, tp):
    """(ours, titan): same weights, same routing."""
    buf = Buffer(T, D, K, E, token_padding=tp, dtype=torch.bfloat16, device=dev)
    torch.manual_seed(0)
    ours = MoonEPMoE.for_buffer(buf, F, num_shared_experts=1, score_func="softmax",
                                route_norm=False, router_dtype=None)
    titan = TitanStyleMoE(D, F, E, K, shared_hidden_dim=F, dtype=torch.bfloat16,
                          device=dev).copy_from(ours)
    return ours, titan


def check_same(ours, titan, x, gy=None) -> float:
    """Max |ours - titan| over the forward of x, raising when it exceeds a few bf16 ulps of the
    output's scale (the layers would not be computing the same thing); with ``gy``, the
    backward of sum(out * gy) too: the grads of x, the experts, the gate and the shared expert
    within 2 % (relative Frobenius norm; bf16 sums in other orders differ by far less, a wrong
    backward by O(1)).  The grads are cleared afterwards."""
    xs = {n: x.detach().clone().requires_grad_(gy is not None) for n in ("ours", "titan")}
    with torch.set_grad_enabled(gy is not None):
        outs = {"ours": ours(xs["ours"]), "titan": titan(xs["titan"])}
    a, b = outs["ours"].detach().float(), outs["titan"].detach().float()
    diff, scale = float((a - b).abs().max()), float(b.abs().max())
    if not diff <= 8 * 2 ** -8 * max(scale, 1e-30):
        raise AssertionError(f"ours and titan disagree: max |diff| {diff:.3g} at scale "
                             f"{scale:.3g}")
    if gy is None:
        return diff
    for n in outs:
        (outs[n].float() * gy).sum().backward()
    pairs = [("x", xs["ours"].grad, xs["titan"].grad), ("gate", ours.router.gate.weight.grad,
                                                         titan.gate.weight.grad)]
    pairs += [(n, getattr(ours, n).grad, getattr(titan, n).grad) for n in ("w1", "w3", "w2")]
    pairs += [(f"shared.{n}", getattr(ours.shared, n).weight.grad, titan.shared[n].weight.grad)
              for n in ("w1", "w3", "w2")]
    for name, ga, gb in pairs:
        rel = float((ga.float() - gb.float()).norm() / gb.float().norm().clamp_min(1e-30))
        if not rel <= 2e-2:
            raise AssertionError(f"ours and titan disagree on the grad of {name}: relative "
                                 f"difference {rel:.3g}")
    for m in (ours, titan):
        for p in m.parameters():
            p.grad = None
    return diff


def capture(step, x_s, gy_s, dev):
    """A CUDA graph of ``step(x_s, gy_s)`` (warmed up on a side stream, as torch documents)."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(3):
            step(x_s, gy_s)
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(x_s, gy_s)
    return g


def run_shape(name, T, D, F, E, K, dev, modes, rounds, steps, tp, deadline=None) -> dict:
    res = dict(shape=name, T=T, D=D, F=F, E=E, K=K)
    ours, titan = build(T, D, F, E, K, dev, tp)
    g = torch.Generator(device=dev).manual_seed(1)
    batches = [(torch.randn(T, D, device=dev, generator=g).bfloat16(),
                torch.randn(T, D, device=dev, generator=g)) for _ in range(4)]
    try:
        res["max_diff"] = check_same(ours, titan, *batches[0])
    except AssertionError as e:          # reported (and the run fails), the timings still taken
        res["check_failed"] = str(e)
        res["max_diff"] = float("nan")
        print(f"  {name}: CHECK FAILED: {e}", flush=True)
        for m in (ours, titan):
            for p in m.parameters():
                p.grad = None
    steps_of = {"titan": sgd_step(titan, list(titan.parameters()), LR),
                "ours": sgd_step(ours, list(ours.parameters()), LR)}

    def on_batches(step):
        return lambda i: step(*batches[i % 4])

    def eager():
        fns = {n: on_batches(s) for n, s in steps_of.items()}
        for f in fns.values():                      # warm-up: allocator, cuBLAS, library loads
            for i in range(3):
                f(i)
        ms = interleaved(fns, rounds, lambda f: time_steps(f, steps, dev))
        hs = interleaved(fns, rounds, lambda f: host_ms(f, steps, dev))
        res["eager"] = {n: statistics.median(v) for n, v in ms.items()}
        res["eager_host"] = {n: statistics.median(v) for n, v in hs.items()}

    def captured():
        x_s = batches[0][0].clone()
        gy_s = batches[0][1].clone()
        graphs = {n: capture(s, x_s, gy_s, dev) for n, s in steps_of.items()}

        def replay_ms(graph):
            # GPU time of the replays only: the input copies are outside the timed events
            ts = []
            for i in range(steps):
                x, gy = batches[i % 4]
                x_s.copy_(x)
                gy_s.copy_(gy)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graph.replay()
                e.record()
                e.synchronize()
                ts.append(s.elapsed_time(e))
            return statistics.median(ts)

        ms = interleaved(graphs, rounds, replay_ms)
        res["captured"] = {n: statistics.median(v) for n, v in ms.items()}

    def compiled():
        enable_backward_tracing()
        torch._dynamo.reset()
        fns, t_compile = {}, {}
        try:
            for n, s in steps_of.items():
                cs = torch.compile(s, fullgraph=True)
                t0 = time.perf_counter()
                for i in range(3):
                    cs(*batches[i % 4])
                _sync(dev)
                t_compile[n] = time.perf_counter() - t0
                fns[n] = on_batches(cs)
            ms = interleaved(fns, rounds, lambda f: time_steps(f, steps, dev))
            res["compiled"] = {n: statistics.median(v) for n, v in ms.items()}
            res["compile_s"] = t_compile
        finally:
            torch._dynamo.reset()

    def profile():
        # GPU time per kernel name over `steps` eager steps of each layer (kernel times do not
        # depend on how the host issues them): where the captured gap lies
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof
        res["profile"] = {}
        for n, s in steps_of.items():
            for i in range(2):
                s(*batches[i % 4])
            _sync(dev)
            with prof(activities=[ProfilerActivity.CUDA]) as p:
                for i in range(steps):
                    s(*batches[i % 4])
                _sync(dev)
            rows, gemms = {}, []
            for ev in p.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    k = ev.name[:90]
                    c, us = rows.get(k, (0, 0.0))
                    rows[k] = (c + 1, us + ev.device_time)
                    if "grouped_gemm" in ev.name or "enable_3x_kernel" in ev.name:
                        gemms.append(round(ev.device_time, 1))
            tot = sum(us for _, us in rows.values())
            # the grouped GEMMs one by one, in launch order (the first step's), to find a slow call
            per = len(gemms) // max(steps, 1)
            res["profile"][n] = {"total_us_per_step": tot / steps, "gemm_us_in_order": gemms[:per],
                                 "kernels": {k: [c / steps, us / steps] for k, (c, us) in
                                             sorted(rows.items(), key=lambda kv: -kv[1][1])}}
            print(f"  {name} profile {n}: grouped GEMMs of one step, us in launch order: "
                  f"{gemms[:per]}", flush=True)
            print(f"  {name} profile {n}: {tot / steps:.0f} us GPU per step, "
                  f"{sum(c for c, _ in rows.values()) / steps:.0f} kernels", flush=True)
            for k, (c, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:25]:
                print(f"    {us / steps:9.1f} us  x{c / steps:4.1f}  {k}", flush=True)

    # Each mode on its own: a mode that fails is reported and the others still run.
    for mode, run in (("eager", eager), ("captured", captured), ("compiled", compiled),
                      ("profile", profile)):
        if mode not in modes or (mode in ("captured", "profile") and dev.type != "cuda"):
            continue
        if mode == "compiled" and deadline is not None and time.monotonic() > deadline:
            res["skipped"] = "compiled: past --time-limit-s"
            continue
        try:
            run()
        except Exception as e:                         # noqa: BLE001  (report, go on)
            traceback.print_exc()
            res.setdefault("mode_errors", {})[mode] = f"{type(e).__name__}: {e}"
            print(f"  {name} {mode}: FAILED ({type(e).__name__}: {e})", flush=True)
            for m in (ours, titan):
                for p in m.parameters():
                    p.grad = None
        finally:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
    ours.buffer.check_errors()
    ours.buffer.destroy()
    return res


# ---------------------------------------------------------------------------------------------
# transformers: the tiny Qwen3-MoE of the tests, converted
# ---------------------------------------------------------------------------------------------

def hf_host(dev, reps: int) -> dict:
    """Host ms of the converted tiny Qwen3-MoE's eager training step and of its MoE blocks."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    import warnings
    warnings.filterwarnings("ignore")
    from test_integrations_hf import BATCH, SEQ, batch, tiny
    from moonep_ops.integrations import hf

    ref = tiny("qwen3_moe").to(device=dev, dtype=torch.bfloat16)
    model = copy.deepcopy(ref)
    hf.convert_model(model, capacity=BATCH * SEQ, token_padding=128 if dev.type == "cuda" else 8)
    blocks = hf.converted_blocks(model)
    ids = batch(0).to(dev)
    out = {"moe_layers": len(blocks), "tokens": BATCH * SEQ}

    def model_step(m):
        def f(i):
            m(ids, labels=ids).loss.backward()
        return f

    for m in (model, ref):
        for _ in range(2):
            model_step(m)(0)
    out["model_step_ms"] = {"converted": host_ms(model_step(model), reps, dev),
                            "hf_eager_experts": host_ms(model_step(ref), reps, dev)}
    blk = next(iter(blocks.values()))
    x = torch.randn(BATCH, SEQ, blk.moe.dim, device=dev, dtype=torch.bfloat16,
                    requires_grad=True)
    gy = torch.randn_like(x)

    def block_step(i):
        blk(x).backward(gy)

    for _ in range(2):
        block_step(0)
    out["block_fwd_bwd_ms"] = host_ms(block_step, reps, dev)
    with torch.no_grad():
        out["block_fwd_ms"] = host_ms(lambda i: blk(x), reps, dev)
    for b in {id(b.moe.buffer): b.moe.buffer for b in blocks.values()}.values():
        b.check_errors()
        b.destroy()
    return out


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

def report(results, modes) -> list[str]:
    lines, missed = [], []
    for mode in ("eager", "compiled", "captured"):
        rows = [r for r in results if mode in r]
        if not rows:
            continue
        lines += ["", f"### {mode}" + (" (GPU time of the replays)" if mode == "captured" else ""),
                  "", "| shape | T, D, F, E, K | titan ms | ours ms | titan / ours | target |"
                  + (" titan host ms | ours host ms |" if mode == "eager" else ""),
                  "|---|---|---|---|---|---|" + ("---|---|" if mode == "eager" else "")]
        for r in rows:
            t, o = r[mode]["titan"], r[mode]["ours"]
            ratio = t / o
            ok = ratio >= TARGETS[mode]
            if not ok:
                missed.append(f"{mode} {r['shape']}: {ratio:.2f} < {TARGETS[mode]}")
            row = (f"| {r['shape']} | {r['T']}, {r['D']}, {r['F']}, {r['E']}, {r['K']} | {t:.3f} | "
                   f"{o:.3f} | {ratio:.2f} | >= {TARGETS[mode]} {'met' if ok else 'MISSED'} |")
            if mode == "eager":
                h = r["eager_host"]
                row += f" {h['titan']:.3f} | {h['ours']:.3f} |"
            lines.append(row)
    lines += ["", "targets: " + ("all met" if not missed else "MISSED: " + "; ".join(missed))]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--modes", default="eager,compiled,captured")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="steps per timed round")
    ap.add_argument("--tiny", action="store_true",
                    help="one tiny shape, eager only unless --modes says otherwise (CPU smoke)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers model")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="write layer_r1.json and layer_r1.md there")
    ap.add_argument("--time-limit-s", type=float, default=300,
                    help="start no compilation after this many seconds (the other modes and "
                         "shapes still run)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    shapes = TINY if a.tiny else {n: SHAPES[n] for n in a.shapes.split(",") if n}
    modes = a.modes.split(",")
    if dev.type != "cuda":
        if not a.tiny:
            print("bench_layer_r1: no CUDA device; the timings need one (use --tiny for the "
                  "CPU smoke run)")
            return 1
        modes = [m for m in modes if m != "captured"]
        if not a.modes or a.modes == ap.get_default("modes"):
            modes = ["eager"]
    tp = 128 if dev.type == "cuda" else 8
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"bench_layer_r1: torch {torch.__version__}, {name}, modes {modes}, "
          f"{a.rounds} rounds x {a.steps} steps, bf16, one shared expert, R = 1")
    results, errors = [], []
    deadline = time.monotonic() + a.time_limit_s
    for n, (T, D, F, E, K) in shapes.items():
        t0 = time.perf_counter()
        try:
            r = run_shape(n, T, D, F, E, K, dev, modes, a.rounds, a.steps, tp, deadline)
        except Exception as e:                         # noqa: BLE001  (report, go on)
            traceback.print_exc()
            errors.append(f"{n}: {type(e).__name__}: {e}")
            print(f"  {n}: FAILED ({type(e).__name__}: {e})", flush=True)
            continue
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        results.append(r)
        if "check_failed" in r:
            errors.append(f"{n}: ours and titan disagree: {r['check_failed']}")
        for mode, err in r.get("mode_errors", {}).items():
            errors.append(f"{n} {mode}: {err}")
        parts = [f"{m} {r[m]['titan'] / r[m]['ours']:.2f}x" for m in modes
                 if m in r and m != "profile"]
        print(f"  {n}: {', '.join(parts)} (titan / ours; max |diff| {r['max_diff']:.2g}; "
              f"{time.perf_counter() - t0:.0f} s"
              + (f"; compile s {r['compile_s']['titan']:.0f} / {r['compile_s']['ours']:.0f}"
                 if "compile_s" in r else "") + (f"; {r['skipped']}" if "skipped" in r else "")
              + ")", flush=True)
    lines = report(results, modes)
    print("\n".join(lines))
    hf_res = None
    if not a.no_hf:
        try:
            hf_res = hf_host(dev, reps=2 if a.tiny else 20)
        except ImportError as e:
            print(f"\ntransformers part skipped: {e}")
        except Exception as e:                         # noqa: BLE001
            traceback.print_exc()
            errors.append(f"hf: {type(e).__name__}: {e}")
        if hf_res:
            m = hf_res["model_step_ms"]
            hf_lines = [
                "",
                "### converted tiny Qwen3-MoE (tests/test_integrations_hf.py), eager, host time",
                "", f"{hf_res['tokens']} tokens, {hf_res['moe_layers']} MoE layer(s)", "",
                "| what | host ms |", "|---|---|",
                f"| one MoE layer: forward + backward | {hf_res['block_fwd_bwd_ms']:.3f} |",
                f"| one MoE layer: forward (no grad) | {hf_res['block_fwd_ms']:.3f} |",
                f"| whole model step, converted | {m['converted']:.3f} |",
                f"| whole model step, unconverted (HF eager experts) | "
                f"{m['hf_eager_experts']:.3f} |"]
            print("\n".join(hf_lines))
            lines += hf_lines
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        doc = dict(device=name, torch=torch.__version__, modes=modes, rounds=a.rounds,
                   steps=a.steps, results=results, hf=hf_res, errors=errors,
                   package=os.path.dirname(sys.modules["moonep_ops"].__file__))
        (Path(a.out) / "layer_r1.json").write_text(json.dumps(doc, indent=1))
        (Path(a.out) / "layer_r1.md").write_text(
            f"bench_layer_r1: torch {torch.__version__}, {name}, package {doc['package']}\n"
            + "\n".join(lines) + "\n")
    if errors:
        print("ERRORS: " + "; ".join(errors))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
