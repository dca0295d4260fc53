"""FP8 grouped GEMM (libmoonep_gemm.so moonep_grouped_gemm_fp8) against the bf16 ones, forward.

    python benchmarks/bench_fp8_gemm.py [--tokens 2048,8192] [--rounds 5]     # one H200, < 2 min

Cases: expert shapes of the model zoo (benchmarks/gemm_zoo_cases.py FAMILIES; a weight is
[O, I]: gate_up O = F, I = D, down O = D, I = F) of DeepSeek-V3 (D 7168, F 2048) and
Qwen3-30B-A3B (D 2048, F 768) at epn = 8 (G = 16 groups: 8 home experts + 8 slots), s tokens per
rank with top-8 routing (s*8 rows of group data, as the zoo's tokens per rank), M = those rows +
128 * G padding rows (the receive buffer's slack), two histograms of group sizes (multiples of
128 rows, the token padding):
  uniform  every one of the G groups the same size;
  skewed   one hot group with half of the rows, the rest Zipf(1.2) over the others, some empty.
Contenders (gemm_bench_common.time_interleaved: interleaved rounds, CUDA events, warm-up, k
back-to-back launches per sample behind a GPU spin, median):
  fp8      ours: e4m3 x (1 x 128 tiles) times e4m3 W (128 x 128 blocks), the C entry called
           through native.py with a preallocated output and workspace;
  bf16     ours: moonep_ops.ops.grouped_mm (the CUTLASS bf16 grouped GEMM, automatic config);
  scaled   torch._scaled_grouped_mm, rowwise scales (one per row of A, one per output column of
           each W_g), e4m3, bf16 out, use_fast_accum=False; 'n/a' with the error if unsupported;
  torch    torch._grouped_mm, bf16.
Quantisation is not timed (inputs are quantised beforehand).  Before timing, one shape's fp8
output is checked against the dequantise-then-fp32-matmul reference (per group max error <=
1e-2 * max |ref|); the run stops if it fails.  Output: one markdown table (device us per call,
fp8 TFLOP/s, time ratios t_fp8 / t_other: below 1 means fp8 is faster) and the geometric means.
"""
from __future__ import annotations

import argparse
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
from moonep_ops.ops import quantize_fp8 as qf  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE = 128
EPN = 8
TOPK = 8
PAD = 128
TOL = 1e-2
FAMILIES = ("deepseek-v3", "qwen3-30b-a3b")


# ---- inputs -------------------------------------------------------------------------------

def histogram(kind: str, rows: int, G: int) -> list[int]:
    """G group sizes, multiples of PAD, summing to rows (rounded down to PAD)."""
    units = rows // PAD
    if kind == "uniform":
        c = [units // G] * G
        for i in range(units - sum(c)):
            c[i] += 1
    else:
        hot = units // 2
        w = 1.0 / np.arange(1, G) ** 1.2
        rest = np.floor(w / w.sum() * (units - hot)).astype(int)
        rest[np.arange(G - 1) % 5 == 4] = 0          # a few empty groups
        c = [int(x) for x in rest]
        c.insert(3, hot + (units - hot - int(rest.sum())))
    return [x * PAD for x in c]


def quant_rows(x):
    """1 x 128 tiles (the library's reference quantiser, on x's device)."""
    return qf.quantize_rows(x.float())


def quant_blocks(w):
    """128 x 128 blocks (the library's reference quantiser)."""
    return qf.quantize_blocks(w.float())


def quant_rowwise(t):
    """Per last-dim row scale (torch._scaled_grouped_mm's rowwise recipe): (q, scale[...])."""
    s = (t.float().abs().amax(-1) / FP8_MAX).clamp_min(2.0 ** -126)
    return (t.float() / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s.contiguous()


class Fp8Call:
    """The C entry with preallocated output and workspace (what the op does minus allocation)."""

    def __init__(self, aq, as_, blq, bls, bsq, bss, cu):
        self.lib = native.require_gemm_fp8()
        self.t = (aq, as_, blq, bls, bsq, bss, cu)
        self.epn, self.n, self.k = blq.shape
        self.M = aq.shape[0]
        self.sms = torch.cuda.get_device_properties(aq.device).multi_processor_count
        self.nbytes = self.lib.gemm_fp8_workspace_bytes(2 * self.epn, self.sms)
        self.ws = torch.empty(self.nbytes, dtype=torch.uint8, device=aq.device)
        self.out = torch.empty(self.M, self.n, dtype=torch.bfloat16, device=aq.device)
        self.ptrs = [t.data_ptr() for t in (aq, as_, blq, bls, bsq, bss)] + \
                    [self.out.data_ptr(), cu.data_ptr()]

    def __call__(self):
        rc = self.lib.grouped_gemm_fp8(*self.ptrs, 2 * self.epn, self.epn, self.M, self.n, self.k,
                                       self.ws.data_ptr(), self.nbytes, self.sms,
                                       torch.cuda.current_stream().cuda_stream)
        native.gemm_check(rc, "moonep_grouped_gemm_fp8")
        return self.out


def make_case(n, k, counts, gen):
    G = len(counts)
    M = sum(counts) + PAD * G
    dev = "cuda"
    x = torch.randn(M, k, device=dev, generator=gen).to(torch.bfloat16)
    wl = (torch.randn(EPN, n, k, device=dev, generator=gen) * k ** -0.5).to(torch.bfloat16)
    ws = (torch.randn(EPN, n, k, device=dev, generator=gen) * k ** -0.5).to(torch.bfloat16)
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=dev)
    return x, wl, ws, cu


def spot_check(call: Fp8Call, counts) -> float:
    """Max over groups of max|out - ref| / max|ref| (ref: dequantise, fp32 matmul, bf16)."""
    aq, as_, blq, bls, bsq, bss, cu = call.t
    out = call().clone()
    torch.cuda.synchronize()
    a = aq.float() * as_.repeat_interleave(TILE, 1)[:, :call.k]

    def deq(q, s):
        return q.float() * s.repeat_interleave(TILE, 1).repeat_interleave(TILE, 2)[:, :call.n,
                                                                                  :call.k]
    wl, ws = deq(blq, bls), deq(bsq, bss)
    worst, start = 0.0, 0
    for g, c in enumerate(counts):
        if c:
            w = wl[g] if g < EPN else ws[g - EPN]
            ref = (a[start:start + c] @ w.t()).to(torch.bfloat16).float()
            err = (out[start:start + c].float() - ref).abs().max().item()
            worst = max(worst, err / max(ref.abs().max().item(), 1e-30))
        start += c
    tail = out[start:]
    if not bool((tail.float() == 0).all()):
        raise SystemExit("spot check FAILED: padding rows not zero")
    return worst


# ---- main ---------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="2048,8192", help="tokens per rank (comma list)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--families", default=",".join(FAMILIES))
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
    G = 2 * EPN
    tokens = [int(t) for t in args.tokens.split(",") if t]
    shapes = []
    for fam in args.families.split(","):
        D, F, _, _ = zoo.FAMILIES[fam]
        for proj, O, I in zoo.projections(fam):
            shapes.append((fam, proj, O, I))

    # correctness first: the first shape, skewed, the smallest token count
    fam, proj, n, k = shapes[0]
    counts = histogram("skewed", min(tokens) * TOPK, G)
    x, wl, ws, cu = make_case(n, k, counts, gen)
    call = Fp8Call(*quant_rows(x), *quant_blocks(wl), *quant_blocks(ws), cu)
    worst = spot_check(call, counts)
    ok = worst <= TOL
    print(f"spot check {fam} {proj} n={n} k={k} M={x.shape[0]} skewed: max group error "
          f"{worst:.2e} of max|ref| (tolerance {TOL}): {'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        return 1
    del x, wl, ws, call
    torch.cuda.empty_cache()

    rows_out = []
    for fam, proj, n, k in shapes:
        for s in tokens:
            for hist in ("uniform", "skewed"):
                counts = histogram(hist, s * TOPK, G)
                x, wl, ws, cu = make_case(n, k, counts, gen)
                fp8 = Fp8Call(*quant_rows(x), *quant_blocks(wl), *quant_blocks(ws), cu)
                wcat = torch.cat([wl, ws])                        # [G, n, k]
                wt = wcat.transpose(-2, -1)                       # [G, k, n], column-major
                fns = {"fp8": fp8,
                       "bf16": lambda: mo.grouped_mm(x, wl, ws, cu),
                       "torch": lambda: torch._grouped_mm(x, wt, offs=cu)}
                scaled_err = None
                try:
                    aq_r, as_r = quant_rowwise(x)
                    wq_r, ws_r = quant_rowwise(wcat)              # [G, n, k], scale [G, n]
                    wq_t = wq_r.transpose(-2, -1)                 # [G, k, n], column-major

                    def scaled():
                        return torch._scaled_grouped_mm(aq_r, wq_t, as_r, ws_r, offs=cu,
                                                        out_dtype=torch.bfloat16,
                                                        use_fast_accum=False)
                    scaled()
                    torch.cuda.synchronize()
                    fns["scaled"] = scaled
                except Exception as e:  # noqa: BLE001  (unsupported build / device / shape)
                    scaled_err = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                t = common.time_interleaved(fns, rounds=args.rounds)
                flop = 2.0 * sum(counts) * n * k
                rows_out.append(dict(fam=fam, proj=proj, n=n, k=k, s=s, hist=hist,
                                     M=x.shape[0], t={c: t[c]["us"] for c in fns},
                                     tf=flop / (t["fp8"]["us"] * 1e-6) / 1e12, err=scaled_err))
                print(f"  {fam} {proj} s={s} {hist}: "
                      + ", ".join(f"{c} {t[c]['us']:.1f} us" for c in fns)
                      + (f"  (scaled: {scaled_err})" if scaled_err else ""), flush=True)
                del x, wl, ws, cu, fp8, wcat, wt, fns
                torch.cuda.empty_cache()

    print()
    print(f"FP8 grouped GEMM, forward, epn = {EPN} (G = {G}), {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}; device us per call (median of {args.rounds} rounds); "
          "ratio = t_fp8 / t_other (< 1: fp8 faster)")
    print()
    print("| family | proj | O x I | s | hist | M | fp8 us | fp8 TF/s | bf16 ours us | "
          "scaled_gmm us | torch bf16 us | fp8/bf16-ours | fp8/scaled_gmm | fp8/torch-bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    r_b, r_s, r_t = [], [], []
    for r in rows_out:
        t = r["t"]
        sc = t.get("scaled")
        rb, rt = t["fp8"] / t["bf16"], t["fp8"] / t["torch"]
        rs = t["fp8"] / sc if sc else None
        r_b.append(rb)
        r_t.append(rt)
        if rs:
            r_s.append(rs)
        print(f"| {r['fam']} | {r['proj']} | {r['n']} x {r['k']} | {r['s']} | {r['hist']} | "
              f"{r['M']} | {t['fp8']:.1f} | {r['tf']:.0f} | {t['bf16']:.1f} | "
              f"{f'{sc:.1f}' if sc else 'n/a'} | {t['torch']:.1f} | {rb:.3f} | "
              f"{f'{rs:.3f}' if rs else 'n/a'} | {rt:.3f} |")
    print(f"| gmean | | | | | | | | | | | {common.gmean(r_b):.3f} | "
          f"{common.gmean(r_s):.3f} | {common.gmean(r_t):.3f} |")
    errs = {r["err"] for r in rows_out if r["err"]}
    for e in errs:
        print(f"\ntorch._scaled_grouped_mm n/a: {e}")
    print(f"\n({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
