"""FP8 weight gradient (libmoonep_gemm.so moonep_grouped_gemm_fp8_wgrad) against our bf16 wgrad
on the model zoo's shapes and group sizes, and its error against bf16 per shape.

    python benchmarks/bench_fp8_wgrad.py [--out DIR] [--tokens 2048,8192] [--rounds 3]
                                         [--families a,b] [--limit N] [--time-limit-s 150]

Cases: every histogram of benchmarks/data/gemm_zoo_cases.json with both weight shapes (the
wgrad of gate_up: dW [F, D] = dg^T h; of down: dW [D, F] = dy^T a; gemm_zoo_cases.py), the
planner's group sizes (token_padding 128).  Contenders (gemm_bench_common.time_interleaved:
interleaved rounds, CUDA events, median):
  fp8          ours, the config chosen on the device, launched as the op launches it (PDL as
               grouped_mm_fp8_wgrad._pdl_flag; the C entry with preallocated outputs and
               workspace: the op minus allocation), quantisation not timed;
  fp8_<cfg>    each config forced (the oracle, and the measurements a refit of
               moonep_ops/gemm/tuning_fp8_wgrad.py needs);
  fp8_q        fp8 plus the token-major quantisation of both operands from bf16
               (moonep::quantize_fp8_tokens twice: what the wgrad costs when nothing is fused);
  bf16         ours: moonep::grouped_mm_wgrad_into (the CUTLASS wgrad_lp kernels, automatic),
               what the bf16 layer's backward runs.
Before timing, the first skewed case of each shape class is checked against the
dequantise-then-fp32-matmul reference for every config (per group max error <= 1e-2 max |ref|);
the run stops if one fails.  Error per shape: relative Frobenius error of the FP8 dW against the
fp64 dW of the bf16 operands, with our bf16 wgrad's own error beside it, on the balanced case of
every (family, projection).  Prints markdown tables (gm of t_bf16 / t_fp8 over all / skewed /
held out / per token count; the model's pick against the oracle; the error per shape) and
writes DIR/fp8_wgrad_zoo.json.  Goal: FP8 wgrad >= 1.5x our bf16 wgrad (gm over the zoo).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gemm_bench_common as common  # noqa: E402
import gemm_zoo_cases as zoo  # noqa: E402

from moonep_ops import native  # noqa: E402
from moonep_ops.gemm import fp8_wgrad_cost as wc  # noqa: E402
from moonep_ops.ops import grouped_mm_fp8_wgrad as gw  # noqa: E402
from moonep_ops.ops import quantize_fp8_tokens as qt  # noqa: E402

TOL = 1e-2
PDL = 2


class WgradCall:
    """The C entry with preallocated outputs and workspace (the op minus allocation)."""

    def __init__(self, q, cu, epn, O, I, config=-1, keep_empty_slots=True):
        self.lib = native.require_gemm_fp8_wgrad()
        self.q, self.cu = q, cu
        dev = q[0].device
        self.gl = torch.empty(epn, O, I, dtype=torch.bfloat16, device=dev)
        self.gs = torch.empty_like(self.gl)
        self.epn, self.O, self.I, self.config = epn, O, I, config
        self.Nb = q[1].shape[0]
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.nbytes = self.lib.gemm_fp8_wgrad_workspace_bytes(2 * epn, self.sms)
        self.ws = torch.empty(self.nbytes, dtype=torch.uint8, device=dev)
        self.flags = gw._pdl_flag() | (1 if keep_empty_slots else 0)
        self.table = gw._tuning_table()
        self.ptrs = [t.data_ptr() for t in q] + [self.gl.data_ptr(), self.gs.data_ptr(),
                                                 cu.data_ptr()]

    def __call__(self):
        rc = self.lib.grouped_gemm_fp8_wgrad(*self.ptrs, 2 * self.epn, self.epn, self.Nb, self.O,
                                             self.I, self.config, self.table, self.flags,
                                             self.ws.data_ptr(), self.nbytes, self.sms,
                                             torch.cuda.current_stream().cuda_stream)
        native.gemm_check(rc, "moonep_grouped_gemm_fp8_wgrad")
        return self.gl

    def chosen(self) -> int:
        return int(self.ws[:4].view(torch.int32).item())


def make(c, gen):
    """dy [M, O], x [M, I] bf16 (unit variance), cu [G] on the GPU."""
    dev = "cuda"
    dy = torch.randn(c["M"], c["O"], device=dev, generator=gen).to(torch.bfloat16)
    x = torch.randn(c["M"], c["I"], device=dev, generator=gen).to(torch.bfloat16)
    cu = torch.tensor(np.cumsum(c["counts"]), dtype=torch.int32, device=dev)
    return dy, x, cu


def spot_check(call: WgradCall, counts) -> float:
    call.gl.fill_(float("nan"))
    call.gs.fill_(float("nan"))
    call()
    torch.cuda.synchronize()
    rl, rs = gw.reference_fp8_wgrad(*(t for t in call.q), call.cu, call.epn)
    worst = 0.0
    for g, m in enumerate(counts):
        if not m:
            continue
        got = (call.gl[g] if g < call.epn else call.gs[g - call.epn]).float()
        ref = (rl[g] if g < call.epn else rs[g - call.epn]).float()
        worst = max(worst, (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30))
    return worst


def error_vs_exact(dy, x, cu, counts, epn, q):
    """(rel error of the FP8 dW, of our bf16 wgrad) against fp64 dW of the bf16 operands, over
    the non-empty groups (Frobenius norms summed over groups)."""
    gl, gs = gw.grouped_mm_fp8_wgrad(*q, cu, epn)
    bl = torch.empty_like(gl)
    bs = torch.empty_like(gs)
    torch.ops.moonep.grouped_mm_wgrad_into(dy, x, cu, bl, bs)
    num8 = numb = den = 0.0
    s = 0
    for g, m in enumerate(counts):
        if m:
            ref = dy[s:s + m].double().t() @ x[s:s + m].double()
            f8 = (gl[g] if g < epn else gs[g - epn]).double()
            b16 = (bl[g] if g < epn else bs[g - epn]).double()
            num8 += float((f8 - ref).norm() ** 2)
            numb += float((b16 - ref).norm() ** 2)
            den += float(ref.norm() ** 2)
        s += m
    return (num8 / den) ** 0.5, (numb / den) ** 0.5


def cases(args) -> list[dict]:
    fams = set(args.families.split(",")) if args.families else None
    toks = {int(t) for t in args.tokens.split(",")} if args.tokens else None
    out = []
    for h in zoo.load():
        if (fams and h["family"] not in fams) or (toks and h["s"] not in toks):
            continue
        for proj, O, I in zoo.projections(h["family"]):
            out.append(dict(h, proj=proj, O=O, I=I))
    return out[:args.limit] if args.limit else out


def summary(rows, errs, meta) -> str:
    def gm(sub, num, den):
        return common.gmean([r["us"][den] / r["us"][num] for r in sub if r["us"].get(num)])

    out = [f"\nFP8 wgrad vs our bf16 wgrad, {meta['device']}, torch {meta['torch']}, commit "
           f"{meta['commit']}, {meta['date']}; time ratios t_bf16 / t_x (> 1: x faster)\n",
           "| cases | n | fp8 / bf16 | fp8 incl. token quantisation / bf16 | "
           + " | ".join(f"{n} forced / bf16" for n in wc.NAMES) + " | pick / oracle gm (min) |",
           "|---|---|---|---|" + "---|" * len(wc.NAMES) + "---|"]

    def line(label, sub):
        if not sub:
            return
        po = [min(r["us"][f"fp8_{n}"] for n in wc.NAMES) / r["us"]["fp8"] for r in sub]
        forced = " | ".join(f"{gm(sub, f'fp8_{n}', 'bf16'):.3f}" for n in wc.NAMES)
        out.append(f"| {label} | {len(sub)} | {gm(sub, 'fp8', 'bf16'):.3f} | "
                   f"{gm(sub, 'fp8_q', 'bf16'):.3f} | {forced} | "
                   f"{common.gmean(po):.3f} ({min(po):.3f}) |")

    line("all", rows)
    line("skewed", [r for r in rows if r["hist"] != "balanced"])
    line("held out", [r for r in rows if r["held_out"]])
    for s in sorted({r["s"] for r in rows}):
        line(f"s = {s}", [r for r in rows if r["s"] == s])
    agree = sum(r["chosen"] == r["host_pick"] for r in rows)
    err = [abs(r["pred"][n] / r["us"][f"fp8_{n}"] - 1) for r in rows for n in wc.NAMES]
    out.append(f"\ndevice pick = host mirror's in {agree} of {len(rows)} cases; cost model "
               f"(seeded, {'fitted' if meta['calibrated'] else 'not fitted'}) |pred/meas - 1| "
               f"median {np.median(err):.3f}, p90 {np.quantile(err, 0.9):.3f}")
    g = gm(rows, "fp8", "bf16")
    out.append(f"goal FP8 wgrad >= 1.5x our bf16 wgrad (gm): {g:.3f} "
               f"{'MET' if g >= 1.5 else 'NOT MET'}")
    out += ["\nRelative error of the wgrad against the fp64 dW of the bf16 operands (balanced "
            "routing, Frobenius over the non-empty groups):\n",
            "| family | proj | O x I | tokens/rank | FP8 wgrad | our bf16 wgrad |", "|---|---|---|---|---|---|"]
    for e in errs:
        out.append(f"| {e['family']} | {e['proj']} | {e['O']} x {e['I']} | {e['s']} | "
                   f"{e['fp8']:.4f} | {e['bf16']:.5f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default="")
    ap.add_argument("--families", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--time-limit-s", type=float, default=150.0,
                    help="stop timing new cases after this long (the summary covers those done)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_wgrad: needs CUDA")
        return 2
    if native.gemm_fp8_wgrad() is None:
        print(f"bench_fp8_wgrad: the FP8 wgrad GEMM is not available: "
              f"{native.gemm_fp8_wgrad_unavailable()}")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(4321)
    todo = cases(args)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    from moonep_ops.gemm import tuning_fp8_wgrad

    # correctness first: every config on a skewed case of each projection kind
    checked = set()
    for c in todo:
        if c["hist"] == "balanced" or c["proj"] in checked:
            continue
        checked.add(c["proj"])
        dy, x, cu = make(c, gen)
        q = (*qt.quantize_fp8_tokens(dy, cu), *qt.quantize_fp8_tokens(x, cu))
        for ci in range(-1, len(wc.NAMES)):
            worst = spot_check(WgradCall(q, cu, c["epn"], c["O"], c["I"], ci), c["counts"])
            name = "auto" if ci < 0 else wc.NAMES[ci]
            ok = worst <= TOL
            print(f"spot check {c['id']} {c['proj']} [{name}]: max group error {worst:.2e} of "
                  f"max|ref| (tolerance {TOL}): {'ok' if ok else 'FAILED'}", flush=True)
            if not ok:
                return 1
        del dy, x, cu, q
        torch.cuda.empty_cache()

    rows, errs, seen_err = [], [], set()
    for i, c in enumerate(todo):
        if time.time() - t0 > args.time_limit_s:
            print(f"time limit: {i} of {len(todo)} cases timed", flush=True)
            break
        dy, x, cu = make(c, gen)
        q = (*qt.quantize_fp8_tokens(dy, cu), *qt.quantize_fp8_tokens(x, cu))
        O, I, epn = c["O"], c["I"], c["epn"]
        auto = WgradCall(q, cu, epn, O, I)
        fns = {"fp8": auto}
        for ci, name in enumerate(wc.NAMES):
            fns[f"fp8_{name}"] = WgradCall(q, cu, epn, O, I, ci)

        def fp8_q(dy=dy, x=x, cu=cu, auto=auto):
            qt.quantize_fp8_tokens(dy, cu)
            qt.quantize_fp8_tokens(x, cu)
            return auto()

        bl = torch.empty(epn, O, I, dtype=torch.bfloat16, device="cuda")
        bs = torch.empty_like(bl)
        fns["fp8_q"] = fp8_q
        fns["bf16"] = lambda dy=dy, x=x, cu=cu, bl=bl, bs=bs: \
            torch.ops.moonep.grouped_mm_wgrad_into(dy, x, cu, bl, bs)
        res = common.time_interleaved(fns, rounds=args.rounds)
        auto()
        chosen = wc.NAMES[auto.chosen()]
        row = dict(id=c["id"], family=c["family"], ep=c["ep"], s=c["s"], hist=c["hist"],
                   held_out=c["held_out"], proj=c["proj"], O=O, I=I, epn=epn,
                   counts=c["counts"], us={k: v["us"] for k, v in res.items() if k != "_meta"},
                   chosen=chosen, host_pick=wc.select(c["counts"], O, I, sms),
                   pred=wc.predict(c["counts"], O, I, sms))
        rows.append(row)
        key = (c["family"], c["proj"], c["s"])
        if c["hist"] == "balanced" and key not in seen_err:
            seen_err.add(key)
            e8, e16 = error_vs_exact(dy, x, cu, c["counts"], epn, q)
            errs.append(dict(family=c["family"], proj=c["proj"], O=O, I=I, s=c["s"], fp8=e8,
                             bf16=e16))
        print(f"{i + 1}/{len(todo)} {c['id']} {c['proj']}: fp8 {row['us']['fp8']:.1f} us "
              f"[{chosen}], bf16 {row['us']['bf16']:.1f} us, "
              f"{row['us']['bf16'] / row['us']['fp8']:.2f}x", flush=True)
        del dy, x, cu, q, fns, auto, bl, bs
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                torch=torch.__version__, commit=common.git_commit(), sm_count=sms,
                rounds=args.rounds, configs=list(wc.NAMES), tuning=wc.tuning_table(),
                calibrated=tuning_fp8_wgrad.CALIBRATED,
                library_md5=common.file_md5(common.gemm_library_path()),
                seconds=round(time.time() - t0))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8_wgrad_zoo.json").write_text(
            json.dumps(dict(meta=meta, cases=rows, errors=errs)))
    if rows:
        print(summary(rows, errs, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
