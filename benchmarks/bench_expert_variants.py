"""The MoE layer step with gpt-oss's experts (expert biases, the clamped SwiGLU) against the same
step with plain SwiGLU experts and no biases, interleaved in one run (the target: within
3 %).

    python benchmarks/bench_expert_variants.py [--shapes gpt-oss-120b-ep8,gpt-oss-20b-ep4]
                                               [--precisions bf16,fp8] [--rounds 5] [--steps 6]
                                               [--out FILE] [--tiny]

One training step = forward, loss = sum(fp32(out) * gy), backward, SGD on every parameter
(moonep_ops.testing.train_step.sgd_step), fresh tokens every step, eager.  Both layers are bf16,
bound at R = 1 to one Buffer (on CUDA: token padding 128), with the same sizes, router (gpt-oss's:
a bias, softmax over the top-k logits) and weights; they differ only in MoEArgs.expert_bias and
activation.  A shape's E is the experts one rank holds at that EP degree (gpt-oss-120b: 128
experts at EP 8 -> 16), so the step is one rank's share.  The two are timed in alternating rounds
(benchmarks/bench_layer_r1.py's ``interleaved``), median over the rounds; the table gives
ms per step and the ratio variant / plain (target <= 1.03).

On CPU (the CI smoke test: --tiny) the numbers mean nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_layer_r1 import interleaved, time_steps  # noqa: E402

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


def run_shape(name, T, D, F, E, K, dev, precision, rounds, steps, tp) -> dict:
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
    plain.buffer.check_errors()
    plain.buffer.destroy()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--precisions", default="bf16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
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
            r = run_shape(name, T, D, F, E, K, dev, prec, a.rounds, a.steps, tp)
            rows.append(r)
            print(f"{name:<20} {prec:<5} {r['ms']['plain']:>9.3f} {r['ms']['variant']:>11.3f} "
                  f"{r['ratio']:>6.3f}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(device=str(dev), target=TARGET, rows=rows),
                                          indent=1))
    return 0 if dev.type != "cuda" or all(r["ratio"] <= TARGET for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
