"""A small MoE language model trained in FP8 and in bf16 from the same seed on the same data.

    python benchmarks/fp8_training.py [--steps 200] [--device cuda] [--tokens 2048]

Model: token embedding -> L blocks of (RMSNorm -> MoonEPMoE, residual) -> RMSNorm -> LM head, one
rank (R = 1 Buffer), bf16 parameters, AdamW.  Only the routed experts change with --precision:
"bf16" (moonep::moe_experts) or "fp8" (docs/fp8.md: e4m3 rows per 1x128, weights per 128x128
blocks cached between updates, fp32 accumulation, dgrad and wgrad in FP8; --bf16-wgrad: the
wgrads in bf16, the recipe before the FP8 wgrad).  Data: sequences of a fixed random
order-1 Markov chain over V tokens (a learnable structure, so the loss falls well below log V),
the same batches for both runs.  Prints the loss curve of both runs and the relative difference
of the mean loss over the last 10 steps; exits 1 when it exceeds --tolerance (default 1 %).
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch import nn

from moonep_ops import Buffer, MoonEPMoE


class Block(nn.Module):
    def __init__(self, buf: Buffer, hidden: int, precision: str, fp8_wgrad: bool = True):
        super().__init__()
        self.norm = nn.RMSNorm(buf.D, dtype=buf.dtype, device=buf.device)
        fp8 = precision == "fp8"
        self.moe = MoonEPMoE.for_buffer(buf, hidden, precision=precision,
                                        fp8_wgrad=fp8 and fp8_wgrad, fp8_weight_cache=fp8)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class TinyMoELM(nn.Module):
    def __init__(self, buf: Buffer, vocab: int, hidden: int, layers: int, precision: str,
                 fp8_wgrad: bool = True):
        super().__init__()
        dt, dev = buf.dtype, buf.device
        self.emb = nn.Embedding(vocab, buf.D, dtype=dt, device=dev)
        self.blocks = nn.ModuleList(Block(buf, hidden, precision, fp8_wgrad)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(buf.D, dtype=dt, device=dev)
        self.head = nn.Linear(buf.D, vocab, bias=False, dtype=dt, device=dev)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x)).float()


def markov_batches(vocab: int, tokens: int, steps: int, device, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    # each token has 4 likely successors: entropy ~ log 4 nats, far below log V
    nxt = torch.randint(vocab, (vocab, 4), generator=g)
    out = []
    for _ in range(steps):
        ids = torch.empty(tokens + 1, dtype=torch.long)
        ids[0] = torch.randint(vocab, (1,), generator=g)
        choice = torch.randint(4, (tokens,), generator=g)
        for t in range(tokens):
            ids[t + 1] = nxt[ids[t], choice[t]]
        out.append((ids[:-1].to(device), ids[1:].to(device)))
    return out


def train(precision: str, a, batches, device) -> list[float]:
    torch.manual_seed(a.seed)
    buf = Buffer(a.tokens, a.dim, a.topk, a.experts, token_padding=a.token_padding,
                 dtype=torch.bfloat16, device=device)
    model = TinyMoELM(buf, a.vocab, a.hidden, a.layers, precision, not a.bf16_wgrad)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    losses = []
    for ids, tgt in batches:
        loss = nn.functional.cross_entropy(model(ids), tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    buf.destroy()
    return losses


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--token-padding", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--bf16-wgrad", action="store_true",
                    help="fp8 run with the wgrads in bf16 (MoEArgs(fp8_wgrad=False))")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    batches = markov_batches(a.vocab, a.tokens, a.steps, dev)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}; "
          f"D {a.dim} F {a.hidden} E {a.experts} K {a.topk} layers {a.layers} V {a.vocab}, "
          f"{a.tokens} tokens/step, {a.steps} steps, AdamW lr {a.lr}; log V = {math.log(a.vocab):.3f}; "
          f"fp8 wgrad {'bf16' if a.bf16_wgrad else 'FP8'}")
    runs = {}
    for p in ("bf16", "fp8"):
        t0 = time.time()
        runs[p] = train(p, a, batches, dev)
        print(f"  {p}: {time.time() - t0:.1f} s")
    print("\n| step | bf16 loss | fp8 loss | fp8 / bf16 - 1 |")
    print("|---|---|---|---|")
    marks = sorted({1, *range(max(a.steps // 8, 1), a.steps + 1, max(a.steps // 8, 1)), a.steps})
    for s in marks:
        b, f = runs["bf16"][s - 1], runs["fp8"][s - 1]
        print(f"| {s} | {b:.4f} | {f:.4f} | {f / b - 1:+.4f} |")
    n = min(10, a.steps)
    mb = sum(runs["bf16"][-n:]) / n
    mf = sum(runs["fp8"][-n:]) / n
    rel = abs(mf / mb - 1)
    ok = rel <= a.tolerance and all(math.isfinite(x) for r in runs.values() for x in r)
    print(f"\nmean loss of the last {n} steps: bf16 {mb:.4f}, fp8 {mf:.4f}, relative difference "
          f"{rel:.4f} ({'PASS' if ok else 'FAIL'} at {a.tolerance:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
