"""FP8 grouped GEMM (libmoonep_gemm.so moonep_grouped_gemm_fp8) against the bf16 ones, forward,
on the model zoo's shapes and group sizes.

    python benchmarks/bench_fp8_gemm.py [--out DIR] [--tokens 2048,8192] [--rounds 5]
                                        [--families a,b] [--limit N]          # one H200, ~3 min

Cases: every histogram of benchmarks/data/gemm_zoo_cases.json (the expert shapes of Qwen3-30B,
Qwen3-235B, DeepSeek-V3, Kimi-K2, Mixtral-8x22B and gpt-oss-120b at EP 8 / 16 / 64, 2048 and
8192 tokens per rank, one rank's group sizes as the planner gives them for balanced, Zipf, hot
and adversarial routings; gemm_zoo_cases.py) with both weight shapes (gate_up O = F, I = D;
down O = D, I = F), plus small batches of 128 and 512 tokens per rank (small_hists; --no-small
leaves them out).  Contenders (gemm_bench_common.time_interleaved: interleaved rounds, CUDA
events, warm-up, k back-to-back launches per sample behind a GPU spin, median):
  fp8          ours, the config chosen on the device, launched as the op launches it (PDL as
               grouped_mm_fp8._pdl_flag: on unless MOONEP_GEMM_PDL=0; the C entry through
               native.py with a preallocated output and workspace: what the op does minus
               allocation);
  fp8_<cfg>    ours with each config forced (the fit's measurements and the oracle);
  fp8_nopdl    ours, the GEMM launched after the prep kernel instead of as its PDL dependent
               (the forced configs launch as the op does);
  bf16         ours: moonep_ops.ops.grouped_mm (the CUTLASS bf16 grouped GEMM, automatic);
  scaled       torch._scaled_grouped_mm, rowwise scales (one per row of A, one per output
               column of each W_g), e4m3, bf16 out, use_fast_accum=False ('n/a' if unsupported);
  torch        torch._grouped_mm, bf16.
Quantisation is not timed.  Before timing, the first case's output of every config is checked
against the dequantise-then-fp32-matmul reference (per group max error <= 1e-2 * max |ref|,
padding rows zero); the run stops if one fails.  Writes DIR/fp8_zoo.json (every case's
timings: the input of benchmarks/fit_fp8_cost_model.py) and prints one markdown table of
geometric means, overall / skewed / held out (the zoo's HELD_OUT family and EP pairs).
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
from moonep_ops.gemm import fp8_cost  # noqa: E402
from moonep_ops.ops import grouped_mm_fp8 as g8  # noqa: E402
from moonep_ops.ops import quantize_fp8 as qf  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE = 128
TOL = 1e-2
PDL = 2                     # moonep_gemm.h MOONEP_GEMM_PDL


def quant_rowwise(t):
    """Per last-dim row scale (torch._scaled_grouped_mm's rowwise recipe): (q, scale[...])."""
    s = (t.float().abs().amax(-1) / FP8_MAX).clamp_min(2.0 ** -126)
    return (t.float() / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s.contiguous()


class Fp8Call:
    """The C entry with preallocated output and workspace (what the op does minus allocation)."""

    def __init__(self, aq, as_, blq, bls, bsq, bss, cu, config: int = -1, pdl: bool | None = None):
        self.lib = native.require_gemm_fp8()
        self.t = (aq, as_, blq, bls, bsq, bss, cu)
        self.epn, self.n, self.k = blq.shape
        self.M = aq.shape[0]
        self.config = config
        self.flags = g8._pdl_flag() if pdl is None else (PDL if pdl else 0)
        self.sms = torch.cuda.get_device_properties(aq.device).multi_processor_count
        self.nbytes = self.lib.gemm_fp8_workspace_bytes(2 * self.epn, self.sms)
        self.ws = torch.empty(self.nbytes, dtype=torch.uint8, device=aq.device)
        self.out = torch.empty(self.M, self.n, dtype=torch.bfloat16, device=aq.device)
        self.ptrs = [t.data_ptr() for t in (aq, as_, blq, bls, bsq, bss)] + \
                    [self.out.data_ptr(), cu.data_ptr()]
        self.table = g8._tuning_table()

    def __call__(self):
        rc = self.lib.grouped_gemm_fp8(*self.ptrs, 2 * self.epn, self.epn, self.M, self.n, self.k,
                                       self.config, self.table, self.flags, self.ws.data_ptr(),
                                       self.nbytes, self.sms,
                                       torch.cuda.current_stream().cuda_stream)
        native.gemm_check(rc, "moonep_grouped_gemm_fp8")
        return self.out

    def chosen(self) -> int:
        """The config the last call ran (the workspace's first word, written on the device)."""
        return int(self.ws[:4].view(torch.int32).item())


def make_case(n, k, M, epn, cu, gen):
    dev = "cuda"
    x = torch.randn(M, k, device=dev, generator=gen).to(torch.bfloat16)
    wl = (torch.randn(epn, n, k, device=dev, generator=gen) * k ** -0.5).to(torch.bfloat16)
    ws = (torch.randn(epn, n, k, device=dev, generator=gen) * k ** -0.5).to(torch.bfloat16)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
    return x, wl, ws, cu_t


def spot_check(call: Fp8Call, counts) -> float:
    """Max over groups of max|out - ref| / max|ref| (ref: dequantise, fp32 matmul, bf16)."""
    aq, as_, blq, bls, bsq, bss, cu = call.t
    call.out.fill_(float("nan"))
    out = call().clone()
    torch.cuda.synchronize()
    a = qf.dequantize_rows(aq, as_)
    wl, ws = qf.dequantize_blocks(blq, bls), qf.dequantize_blocks(bsq, bss)
    worst, start = 0.0, 0
    for g, c in enumerate(counts):
        if c:
            w = wl[g] if g < call.epn else ws[g - call.epn]
            ref = (a[start:start + c] @ w.t()).to(torch.bfloat16).float()
            err = (out[start:start + c].float() - ref).abs().max().item()
            worst = max(worst, err / max(ref.abs().max().item(), 1e-30))
        start += c
    if not bool((out[start:].float() == 0).all()):
        raise SystemExit("spot check FAILED: padding rows not zero")
    return worst


SMALL_TOKENS = (128, 512)


def small_hists() -> list[dict]:
    """Small batches the zoo file lacks (decode-like steps, 128 and 512 tokens per rank): per
    family and EP degree, s * K rows over the epn home groups evenly ('small_balanced') or half
    of them on one group and the rest even ('small_hot'); true counts, no token padding, slots
    empty, M = rows + 64."""
    out = []
    for fam, (D, F, E, K) in zoo.FAMILIES.items():
        for ep in zoo.ep_degrees(E):
            epn = E // ep
            for s in SMALL_TOKENS:
                rows = s * K
                for hist in ("small_balanced", "small_hot"):
                    c = [rows // epn] * epn
                    c[0] += rows - sum(c)
                    if hist == "small_hot":
                        rest = rows - rows // 2
                        c = [rest // epn] * epn
                        c[0] += rows // 2 + rest - sum(c)
                    counts = c + [0] * epn
                    out.append(dict(id=f"{fam}/ep{ep}/s{s}/{hist}", family=fam, ep=ep, s=s,
                                    hist=hist, held_out=zoo.is_held_out(fam, ep), epn=epn,
                                    G=2 * epn, M=rows + 64, counts=counts))
    return out


def cases(args) -> list[dict]:
    fams = set(args.families.split(",")) if args.families else None
    toks = {int(t) for t in args.tokens.split(",")} if args.tokens else None
    out = []
    for h in zoo.load() + (small_hists() if args.small else []):
        if (fams and h["family"] not in fams) or (toks and h["s"] not in toks):
            continue
        for proj, O, I in zoo.projections(h["family"]):
            out.append(dict(h, proj=proj, O=O, I=I))
    return out[:args.limit] if args.limit else out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for fp8_zoo.json")
    ap.add_argument("--tokens", default="", help="tokens per rank (comma list; default all)")
    ap.add_argument("--families", default="", help="zoo families (comma list; default all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--limit", type=int, default=0, help="first N cases only")
    ap.add_argument("--no-small", dest="small", action="store_false",
                    help="without the small-batch cases (128 and 512 tokens per rank)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_gemm: needs CUDA")
        return 2
    if native.gemm_fp8() is None:
        print(f"bench_fp8_gemm: the FP8 grouped GEMM is not available: "
              f"{native.gemm_fp8_unavailable()}")
        return 2
    import moonep_ops as mo
    torch.backends.cuda.matmul.allow_tf32 = False     # the spot check's fp32 reference
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(1234)
    todo = cases(args)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    # correctness first: every config on the first skewed case
    c0 = next(c for c in todo if c["hist"] not in ("balanced", "small_balanced"))
    x, wl, ws, cu = make_case(c0["O"], c0["I"], c0["M"], c0["epn"],
                              np.cumsum(c0["counts"]).tolist(), gen)
    q = (*qf.quantize_rows(x), *qf.quantize_blocks(wl), *qf.quantize_blocks(ws), cu)
    for ci in range(-1, len(fp8_cost.NAMES)):
        worst = spot_check(Fp8Call(*q, config=ci), c0["counts"])
        name = "auto" if ci < 0 else fp8_cost.NAMES[ci]
        ok = worst <= TOL
        print(f"spot check {c0['id']} {c0['proj']} [{name}]: max group error {worst:.2e} of "
              f"max|ref| (tolerance {TOL}): {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            return 1
    del x, wl, ws, cu, q
    torch.cuda.empty_cache()

    def meta():
        return dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                    torch=torch.__version__, commit=common.git_commit(), sm_count=sms,
                    rounds=args.rounds, configs=list(fp8_cost.NAMES),
                    library_md5=common.file_md5(common.gemm_library_path()),
                    tuning=fp8_cost.tuning_table(), seconds=round(time.time() - t0))

    def save():
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "fp8_zoo.json").write_text(json.dumps(dict(meta=meta(),
                                                                         cases=rows_out)))

    rows_out = []
    for i, c in enumerate(todo):
        n, k, counts = c["O"], c["I"], c["counts"]
        x, wl, ws, cu = make_case(n, k, c["M"], c["epn"], np.cumsum(counts).tolist(), gen)
        q = (*qf.quantize_rows(x), *qf.quantize_blocks(wl), *qf.quantize_blocks(ws), cu)
        auto = Fp8Call(*q)
        fns = {"fp8": auto, "fp8_nopdl": Fp8Call(*q, pdl=False)}
        for ci, name in enumerate(fp8_cost.NAMES):
            fns[f"fp8_{name}"] = Fp8Call(*q, config=ci)
        wcat = torch.cat([wl, ws])                        # [G, n, k]
        wt = wcat.transpose(-2, -1)                       # [G, k, n], column-major
        fns["bf16"] = lambda x=x, wl=wl, ws=ws, cu=cu: mo.grouped_mm(x, wl, ws, cu)
        fns["torch"] = lambda x=x, wt=wt, cu=cu: torch._grouped_mm(x, wt, offs=cu)
        scaled_err = None
        try:
            aq_r, as_r = quant_rowwise(x)
            wq_r, ws_r = quant_rowwise(wcat)              # [G, n, k], scale [G, n]
            wq_t = wq_r.transpose(-2, -1)

            def scaled(aq_r=aq_r, wq_t=wq_t, as_r=as_r, ws_r=ws_r, cu=cu):
                return torch._scaled_grouped_mm(aq_r, wq_t, as_r, ws_r, offs=cu,
                                                out_dtype=torch.bfloat16, use_fast_accum=False)
            scaled()
            torch.cuda.synchronize()
            fns["scaled"] = scaled
        except Exception as e:  # noqa: BLE001  (unsupported build / device / shape)
            scaled_err = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        t = common.time_interleaved(fns, rounds=args.rounds)
        auto()
        chosen = fp8_cost.NAMES[auto.chosen()]
        host = fp8_cost.select(counts, n, k, sms)
        row = dict(id=c["id"], family=c["family"], ep=c["ep"], s=c["s"], hist=c["hist"],
                   held_out=c["held_out"], proj=c["proj"], O=n, I=k, M=c["M"], G=c["G"],
                   counts=counts, us={name: t[name]["us"] for name in fns}, chosen=chosen,
                   host_pick=host, scaled_err=scaled_err)
        rows_out.append(row)
        print(f"[{i + 1}/{len(todo)}] {c['id']} {c['proj']}: "
              + ", ".join(f"{name} {t[name]['us']:.1f}" for name in fns)
              + f" us; chose {chosen}" + ("" if chosen == host else f" (host {host})")
              + (f"  (scaled: {scaled_err})" if scaled_err else ""), flush=True)
        del x, wl, ws, cu, q, fns, wcat, wt, auto
        torch.cuda.empty_cache()
        if i % 25 == 24:
            save()              # a run cut short by a time limit keeps what it measured

    save()
    print()
    print(summary(rows_out, meta()))
    return 0


def summary(rows: list[dict], meta: dict) -> str:
    """One markdown table of geometric-mean time ratios (> 1: fp8 faster)."""
    names = [f"fp8_{n}" for n in meta["configs"]]

    def ratios(sub, num, den):
        return common.gmean([r["us"][den] / r["us"][num] for r in sub
                             if num in r["us"] and den in r["us"]])

    def oracle(r):
        return min(r["us"][n] for n in names)

    def line(label, sub):
        if not sub:
            return None
        orc = common.gmean([oracle(r) / r["us"]["fp8"] for r in sub])
        mins = min(oracle(r) / r["us"]["fp8"] for r in sub)
        pdl = ratios(sub, "fp8", "fp8_nopdl")
        return (f"| {label} | {len(sub)} | {ratios(sub, 'fp8', 'bf16'):.3f} | "
                f"{ratios(sub, 'fp8', 'scaled'):.3f} | {ratios(sub, 'fp8', 'torch'):.3f} | "
                + " | ".join(f"{ratios(sub, n, 'bf16'):.3f}" for n in names)
                + f" | {orc:.3f} ({mins:.3f}) | {pdl:.3f} |")

    head = ("| cases | n | fp8 / bf16 ours | fp8 / scaled_gmm | fp8 / torch bf16 | "
            + " | ".join(f"{n} / bf16 ours" for n in names)
            + " | pick / oracle gm (min) | PDL on / off |")
    out = [f"FP8 grouped GEMM, forward; {meta['device']}, torch {meta['torch']}, "
           f"{meta['date']}, commit {meta['commit']}; time ratios t_other / t_fp8 (> 1: fp8 "
           f"faster), geometric means", "", head, "|" + "---|" * (head.count("|") - 1)]
    skewed = [r for r in rows if r["hist"] not in ("balanced", "small_balanced")]
    for label, sub in (("all", rows), ("skewed", skewed),
                       ("held out", [r for r in rows if r["held_out"]]),
                       ("held out, skewed", [r for r in skewed if r["held_out"]]),
                       ("s = 2048", [r for r in rows if r["s"] == 2048]),
                       ("s = 8192", [r for r in rows if r["s"] == 8192]),
                       ("s = 128, 512", [r for r in rows if r["s"] in SMALL_TOKENS])):
        ln = line(label, sub)
        if ln:
            out.append(ln)
    agree = sum(r["chosen"] == r["host_pick"] for r in rows)
    out.append(f"\ndevice pick = host mirror's pick in {agree} of {len(rows)} cases")
    errs = {r["scaled_err"] for r in rows if r["scaled_err"]}
    for e in errs:
        out.append(f"torch._scaled_grouped_mm n/a: {e}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
