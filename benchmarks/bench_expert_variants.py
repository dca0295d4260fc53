"""The MoE layer step with gpt-oss's experts (expert biases, the clamped SwiGLU) against the same
step with plain SwiGLU experts and no biases, interleaved in one run (the target: within
3 %).

    python benchmarks/bench_expert_variants.py [--shapes gpt-oss-120b-ep8,gpt-oss-20b-ep4]
                                               [--precisions bf16,fp8] [--rounds 5] [--steps 6]
                                               [--profile] [--out FILE] [--tiny]

One training step = forward, loss = sum(fp32(out) * gy), backward, SGD on every parameter
(moonep_ops.testing.train_step.sgd_step), fresh tokens every step, eager.  Both layers are bf16,
bound at R = 1 to one Buffer (on CUDA: token padding 128), with the same sizes, router (gpt-oss's:
a bias, softmax over the top-k logits) and weights; they differ only in MoEArgs.expert_bias and
activation.  A shape's E is the experts one rank holds at that EP degree (gpt-oss-120b: 128
experts at EP 8 -> 16), so the step is one rank's share.  The two are timed in alternating rounds
(benchmarks/bench_layer_r1.py's ``interleaved``), median over the rounds; the table gives
ms per step and the ratio variant / plain (target <= 1.03).

--profile: then, per shape and precision, where the time goes: GPU time per kernel group
(grouped GEMMs, SwiGLU / gated GLU, route weights, bias grads, data plane, planner, fills and
copies, the rest) of each layer's eager step, averaged over --steps steps (torch.profiler), the
difference variant - plain per group, and the variant's top kernels.  On CPU the same table
counts the top-level torch ops of a step by the moonep:: range they run in (op counts; the times
mean nothing there).

On CPU (the CI smoke test: --tiny) the numbers mean nothing.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_layer_r1 import _sync, interleaved, time_steps  # noqa: E402

from moonep_ops import Buffer, MoonEPMoE  # noqa: E402
from moonep_ops.testing.train_step import sgd_step  # noqa: E402

# name: (tokens, D, F, E per rank, K)
SHAPES = {
    "gpt-oss-120b-ep8": (8192, 2880, 2880, 16, 4),
    "gpt-oss-20b-ep4": (8192, 2880, 2880, 8, 4),
}
TINY = {"tiny": (64, 32, 32, 8, 2)}
TARGET = 1.03
LR = 1e-6
GPT_OSS = dict(expert_bias=True, activation="swiglu_clamped", swiglu_alpha=1.702,
               swiglu_limit=7.0)
# --profile's kernel groups: a kernel belongs to the first group one of whose names is part of its
# own (CUDA: the kernel's name; CPU: "<innermost moonep:: range> <torch op>").
GROUPS = (
    ("grouped GEMMs", ("grouped_gemm", "enable_3x_kernel", "prep_kernel", "moonep::grouped_mm")),
    ("SwiGLU / gated GLU", ("glu_kernel", "moonep::swiglu")),
    ("route weights (+ down bias)", ("scale_rows",)),
    ("bias grads (group sums)", ("group_sums", "bias_grads")),
    ("data plane", ("dispatch", "combine", "push_weights", "reduce_grad", "zero_slots",
                    "barrier_kernel", "publish", "prefetch_weight")),
    ("planner", ("plan",)),
    ("fills and copies (zero grads, cats)", ("memset", "fillfunctor", "memcpy", "catarray",
                                            "zeros", "fill_", "aten::cat", "copy_")),
)
OTHER = "other (router, loss, casts, SGD)"


def build(T, D, F, E, K, dev, tp, precision):
    """(plain, variant): one Buffer, the same router and weights (the variant's biases zero)."""
    buf = Buffer(T, D, K, E, token_padding=tp, dtype=torch.bfloat16, device=dev)
    router = dict(topk_before_score=True, gate_bias=True, router_dtype=None,
                  precision=precision)
    torch.manual_seed(0)
    plain = MoonEPMoE.for_buffer(buf, F, **router)
    variant = MoonEPMoE.for_buffer(buf, F, **router, **GPT_OSS)
    variant.load_state_dict(plain.state_dict(), strict=False)
    return plain, variant


def _cpu_key(ev) -> str:
    ctx = ev.cpu_parent
    while ctx is not None and not ctx.name.startswith("moonep::"):
        ctx = ctx.cpu_parent
    return f"{ctx.name if ctx is not None else '-'} {ev.name}"


def kernel_times(fn, steps: int, dev) -> dict[str, tuple[float, float]]:
    """{kernel: (launches per step, us per step)} over ``steps`` calls of ``fn(i)``, from
    torch.profiler: on CUDA every kernel by name (GPU time); on CPU every torch op not called
    by another, as "<innermost moonep:: range> <op>" (CPU time)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = dev.type == "cuda"
    _sync(dev)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as p:
        for i in range(steps):
            fn(i)
        _sync(dev)
    rows = collections.defaultdict(lambda: [0, 0.0])
    for ev in p.events():
        if cuda and ev.device_type == torch.autograd.DeviceType.CUDA:
            key, us = ev.name[:90], ev.device_time
        elif not cuda and ev.name.startswith("aten::") and not (
                ev.cpu_parent is not None and ev.cpu_parent.name.startswith("aten::")):
            key, us = _cpu_key(ev), ev.cpu_time_total
        else:
            continue
        rows[key][0] += 1
        rows[key][1] += us
    return {k: (c / steps, us / steps) for k, (c, us) in rows.items()}


def kernel_groups(kernels: dict) -> dict[str, tuple[float, float]]:
    """kernel_times summed by GROUPS: {group: (launches, us)}, every group listed, OTHER last."""
    out = {g: [0.0, 0.0] for g, _ in GROUPS} | {OTHER: [0.0, 0.0]}
    for k, (c, us) in kernels.items():
        low = k.lower()
        g = next((g for g, names in GROUPS if any(n in low for n in names)), OTHER)
        out[g][0] += c
        out[g][1] += us
    return {g: (c, us) for g, (c, us) in out.items()}


def profile_table(fns: dict, steps: int, dev) -> tuple[dict, list[str]]:
    """({layer: {"groups", "kernels"}}, printed lines): kernel_times of each layer's step
    (fns: {"plain": fn, "variant": fn}), grouped, the difference variant - plain per group, and
    the variant's top kernels."""
    res = {n: {"kernels": kernel_times(f, steps, dev)} for n, f in fns.items()}
    for r in res.values():
        r["groups"] = kernel_groups(r["kernels"])
    unit = "GPU us" if dev.type == "cuda" else "CPU us"
    gp, gv = res["plain"]["groups"], res["variant"]["groups"]
    lines = [f"  {'group (per step)':<46} {'plain ' + unit:>13} {'n':>5} "
             f"{'variant ' + unit:>15} {'n':>5} {'diff us':>9}"]
    for g in gp:
        (cp, up), (cv, uv) = gp[g], gv[g]
        lines.append(f"  {g:<46} {up:>13.1f} {cp:>5.0f} {uv:>15.1f} {cv:>5.0f} {uv - up:>9.1f}")
    tot = [sum(v[i] for v in d.values()) for d in (gp, gv) for i in (0, 1)]
    lines.append(f"  {'total':<46} {tot[1]:>13.1f} {tot[0]:>5.0f} {tot[3]:>15.1f} {tot[2]:>5.0f} "
                 f"{tot[3] - tot[1]:>9.1f}")
    lines.append("  variant's top kernels: us per step, launches per step")
    top = sorted(res["variant"]["kernels"].items(), key=lambda kv: -kv[1][1])[:20]
    lines += [f"    {us:9.1f}  x{c:4.1f}  {k}" for k, (c, us) in top]
    return res, lines


def run_shape(name, T, D, F, E, K, dev, precision, rounds, steps, tp, profile=False) -> dict:
    plain, variant = build(T, D, F, E, K, dev, tp, precision)
    g = torch.Generator(device=dev).manual_seed(1)
    batches = [(torch.randn(T, D, device=dev, generator=g).bfloat16(),
                torch.randn(T, D, device=dev, generator=g)) for _ in range(4)]
    steps_of = {n: sgd_step(m, list(m.parameters()), LR)
                for n, m in (("plain", plain), ("variant", variant))}
    fns = {n: (lambda s: lambda i: s(*batches[i % 4]))(s) for n, s in steps_of.items()}
    for f in fns.values():                      # warm-up: allocator, libraries, autotuning
        for i in range(3):
            f(i)
    ms = interleaved(fns, rounds, lambda f: time_steps(f, steps, dev))
    res = dict(shape=name, precision=precision, T=T, D=D, F=F, E=E, K=K,
               ms={n: statistics.median(v) for n, v in ms.items()})
    res["ratio"] = res["ms"]["variant"] / res["ms"]["plain"]
    if profile:
        res["profile"], res["profile_lines"] = profile_table(fns, steps, dev)
    plain.buffer.check_errors()
    plain.buffer.destroy()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--precisions", default="bf16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--profile", action="store_true",
                   help="also GPU time per kernel group of each layer's step (see the docstring)")
    p.add_argument("--out", default=None)
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: one tiny shape")
    a = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = TINY if a.tiny else {n: SHAPES[n] for n in a.shapes.split(",")}
    tp = 128 if dev.type == "cuda" else 1
    rows = []
    print(f"{'shape':<20} {'prec':<5} {'plain ms':>9} {'variant ms':>11} {'ratio':>6}")
    for name, (T, D, F, E, K) in shapes.items():
        for prec in a.precisions.split(","):
            r = run_shape(name, T, D, F, E, K, dev, prec, a.rounds, a.steps, tp, a.profile)
            rows.append(r)
            print(f"{name:<20} {prec:<5} {r['ms']['plain']:>9.3f} {r['ms']['variant']:>11.3f} "
                  f"{r['ratio']:>6.3f}", flush=True)
            print("\n".join(r.pop("profile_lines", [])), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(device=str(dev), target=TARGET, rows=rows),
                                          indent=1))
    return 0 if dev.type != "cuda" or all(r["ratio"] <= TARGET for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
