"""Grouped-GEMM benchmark: skew sweep x shapes x {fwd, dgrad, wgrad} on one GPU.

    python benchmarks/bench_grouped_gemm.py [--out DIR] [--quick]

For each case it times (CUDA events, no L2 flush).  The contenders of one case are timed
interleaved, round-robin over several rounds, median per contender: the H200 throttles its clock
under sustained GEMM load, and timing contenders one after the other made the later ones look up
to 20 % slower than the same kernel timed first.
  ours      moonep CUTLASS kernels, config chosen on the device by the cost model (the default
            path: prep/selector kernel + every candidate launched, losers exit at once);
  host-sel  the config the Python model picks, forced (what a caller with host counts gets);
  each compiled config forced (the oracle is the best of them for the case);
  torch     torch._grouped_mm (weights pre-concatenated, not timed; its wgrad writes bf16, so it
            is like-for-like with wgrad_lp; ours "wgrad" is the fp32 read-modify-write op);
  dense     torch.mm with the same FLOPs (all routed rows as one GEMM).
Prints one table per kind and the targets of docs/grouped_gemm.md (met / not met), writes
bench_grouped_gemm.json and bench_grouped_gemm.md under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moonep_ops.gemm import cost_model as gemm_cost_model, tuning as gemm_tuning  # noqa: E402
from moonep_ops.ops import grouped_mm as gg  # noqa: E402

import gemm_bench_common as common  # noqa: E402
from gemm_bench_common import gmean  # noqa: E402

KINDS = ("fwd", "dgrad", "wgrad_lp", "wgrad")
SKEWS = ("balanced", "zipf0.8", "zipf1.5", "hot20x", "tiny")
SKEWED = ("zipf0.8", "zipf1.5", "hot20x", "tiny")   # "skew >= 0.8" in the targets


# ------------------------------------------------------------------------------------------
# histograms
# ------------------------------------------------------------------------------------------

def _normalise(w, total, rng):
    c = np.floor(np.asarray(w, dtype=np.float64) / np.sum(w) * total).astype(np.int64)
    rest = total - int(c.sum())
    c[rng.choice(len(c), size=rest, replace=True)] += 1 if rest else 0
    while c.sum() < total:                  # duplicates in choice: top up deterministically
        c[int(np.argmax(w))] += total - int(c.sum())
    return c


def histogram(skew: str, G: int, total: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if skew == "balanced":
        w = np.ones(G)
    elif skew.startswith("zipf"):
        w = 1.0 / np.arange(1, G + 1) ** float(skew[4:])
        rng.shuffle(w)
    elif skew.startswith("hot") and skew.endswith("x"):   # hot<F>x: one expert at F x the rest
        w = np.ones(G)
        w[rng.integers(G)] = float(skew[3:-1])
    elif skew == "tiny":
        # most groups under 128 rows: 3/4 of the groups get 16-127 rows, the rest share the remainder
        n_tiny = (3 * G) // 4
        tiny = rng.integers(16, 128, size=n_tiny)
        big = _normalise(rng.uniform(0.5, 1.5, G - n_tiny), total - int(tiny.sum()), rng)
        c = np.concatenate([tiny, big])
        rng.shuffle(c)
        return c
    elif skew.startswith("lognormal"):
        w = rng.lognormal(0.0, float(skew[9:]), G)
    elif skew.startswith("uniform"):          # every group exactly this many rows
        return np.full(G, int(skew[7:]), dtype=np.int64)
    else:
        raise ValueError(skew)
    return _normalise(w, total, rng)


# ------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------

def time_interleaved(fns: dict, rounds: int = 5, iters: int = 3, warmup: int = 2) -> dict:
    """Median µs per callable; callables alternate (rotating order) within every round."""
    names = list(fns)
    for n in names:
        for _ in range(warmup):
            fns[n]()
    torch.cuda.synchronize()
    samples = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        evs = []
        for n in order:
            for _ in range(iters):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fns[n]()
                e.record()
                evs.append((n, s, e))
        torch.cuda.synchronize()
        for n, s, e in evs:
            samples[n].append(s.elapsed_time(e) * 1e3)
    return {n: statistics.median(v) for n, v in samples.items()}


class Case:
    """Tensors of one (kind, counts, N, K) problem, and callables for every contender."""

    def __init__(self, kind, counts, N, K, seed=0):
        self.kind, self.counts, self.N, self.K = kind, np.asarray(counts), N, K
        G = len(counts)
        self.epn = G // 2
        self.M = int(self.counts.sum())
        gen = torch.Generator(device="cuda").manual_seed(seed)
        rnd = lambda *s: (torch.randn(*s, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
        self.cu = torch.tensor(np.cumsum(counts), dtype=torch.int32, device="cuda")
        M, epn = max(self.M, 1), self.epn
        if kind == "fwd":
            self.a, self.out_shape = rnd(M, K), (M, N)
        else:
            self.a, self.out_shape = rnd(M, N), (M, K)      # dy
        self.wl, self.ws = rnd(epn, N, K), rnd(epn, N, K)
        if kind in ("wgrad", "wgrad_lp"):
            self.x = rnd(M, K)
            dt = torch.float32 if kind == "wgrad" else torch.bfloat16
            self.gl = torch.zeros(epn, N, K, device="cuda", dtype=dt)
            self.gs = torch.zeros_like(self.gl)
        else:
            self.out = torch.empty(self.out_shape, dtype=torch.bfloat16, device="cuda")
        self.workspace = None

    def ours(self, config: int, raster: int = 0):
        k, N, K, M, epn = self.kind, self.N, self.K, self.M, self.epn

        def run():
            if k in ("wgrad", "wgrad_lp"):
                self.workspace = gg._launch(k, config, self.a, self.x, None, self.gl, self.gs,
                                            self.cu, epn, M, N, K, raster=raster,
                                            workspace=self.workspace)
            else:
                self.workspace = gg._launch(k, config, self.a, self.wl, self.ws, self.out, None,
                                            self.cu, epn, M, N, K, raster=raster,
                                            workspace=self.workspace)
        return run

    def torch_grouped(self):
        w = torch.cat([self.wl, self.ws])
        if self.kind == "fwd":
            wt = w.transpose(-2, -1)
            return lambda: torch._grouped_mm(self.a, wt, offs=self.cu)
        if self.kind == "dgrad":
            return lambda: torch._grouped_mm(self.a, w, offs=self.cu)
        return lambda: torch._grouped_mm(self.a.t(), self.x, offs=self.cu)

    def dense(self):
        N, K, M = self.N, self.K, max(self.M, 1)
        w = self.wl[0]
        if self.kind == "fwd":
            return lambda: torch.mm(self.a, w.t())
        if self.kind == "dgrad":
            return lambda: torch.mm(self.a, w)
        return lambda: torch.mm(self.a.t(), self.x)

    def chosen_on_device(self) -> int:
        self.ours(-1)()
        return int(self.workspace[:4].view(torch.int32).item())

    def free(self):
        for name in ("a", "wl", "ws", "x", "gl", "gs", "out", "workspace"):
            if hasattr(self, name):
                setattr(self, name, None)


def tflops(counts, N, K, us):
    return gemm_cost_model.flops(counts, N, K) / (us * 1e-6) / 1e12


def roofline_us(kind, counts, N, K, dense_us) -> float:
    """The case's bound: dense torch.mm with the same FLOPs, or its compulsory bytes at the
    device-copy bandwidth, whichever is slower.  ours / dense >= 0.95 is out of reach where the
    bytes bound dominates (the fp32 read-modify-write of wgrad)."""
    return common.roofline_us(kind, counts, N, K, dense_us, gemm_tuning.HBM_TBPS)


# ------------------------------------------------------------------------------------------
# sweep
# ------------------------------------------------------------------------------------------

def sweep_cases(quick: bool):
    shapes = [(7168, 2048), (4096, 1536)]
    groups = [(64, 32768), (96, 65536)]
    projs = ["up", "down"]
    skews = SKEWS
    if quick:
        shapes, groups, projs, skews = shapes[:1], groups[:1], ["up"], ("balanced", "zipf1.5")
    for H, Hp in shapes:
        for G, total in groups:
            for proj in projs:
                N, K = (2 * Hp, H) if proj == "up" else (H, Hp)
                for skew in skews:
                    yield dict(H=H, Hp=Hp, G=G, rows=total, proj=proj, N=N, K=K, skew=skew)


def run_sweep(iters: int, quick: bool, kinds=KINDS):
    rows = []
    for spec in sweep_cases(quick):
        counts = histogram(spec["skew"], spec["G"], spec["rows"], seed=spec["G"])
        for kind in kinds:
            case = Case(kind, counts, spec["N"], spec["K"])
            r = dict(spec, kind=kind, flops=gemm_cost_model.flops(counts, spec["N"], spec["K"]))
            cfgs = gemm_cost_model.CONFIGS[kind]
            fns = {c.name: case.ours(i) for i, c in enumerate(cfgs)}
            fns.update(ours=case.ours(-1), torch=case.torch_grouped(), dense=case.dense())
            t = time_interleaved(fns, rounds=iters)
            r["configs_us"] = {c.name: t[c.name] for c in cfgs}
            r["ours_us"], r["torch_us"], r["dense_us"] = t["ours"], t["torch"], t["dense"]
            r["bound_us"] = roofline_us(kind, counts, spec["N"], spec["K"], t["dense"])
            r["device_choice"] = cfgs[case.chosen_on_device()].name
            r["model_choice"] = gemm_cost_model.select(counts, spec["N"], spec["K"], kind)
            r["predicted_us"] = gemm_cost_model.predict(counts, spec["N"], spec["K"], kind)
            r["tflops"] = {k: tflops(counts, spec["N"], spec["K"], v) for k, v in
                           [("ours", r["ours_us"]), ("torch", r["torch_us"]),
                            ("dense", r["dense_us"]),
                            ("oracle", min(r["configs_us"].values())),
                            ("host_sel", r["configs_us"][r["model_choice"]])]}
            rows.append(r)
            case.free()
            print(f"{spec['proj']:4} H={spec['H']} G={spec['G']} {spec['skew']:8} {kind:5} "
                  f"ours {r['tflops']['ours']:5.0f}  torch {r['tflops']['torch']:5.0f}  "
                  f"dense {r['tflops']['dense']:5.0f}  oracle {r['tflops']['oracle']:5.0f}  "
                  f"[{r['device_choice']}]", flush=True)
        torch.cuda.empty_cache()
    return rows


def run_raster_study(iters: int, quick: bool):
    """Would raster order along N (a run-time scheduler argument) be worth fused branches?
    Every config with raster 0 (along M, the default) and 1, interleaved, per sweep case."""
    rows = []
    for spec in sweep_cases(quick):
        counts = histogram(spec["skew"], spec["G"], spec["rows"], seed=spec["G"])
        for kind in KINDS:
            case = Case(kind, counts, spec["N"], spec["K"])
            cfgs = gemm_cost_model.CONFIGS[kind]
            fns = {f"{c.name}/r{r}": case.ours(i, r) for i, c in enumerate(cfgs) for r in (0, 1)}
            t = time_interleaved(fns, rounds=iters)
            best0 = min(v for k, v in t.items() if k.endswith("/r0"))
            best = min(t.values())
            rows.append(dict(spec, kind=kind, us=t, best_r0=best0, best_any=best,
                             gain=best0 / best))
            case.free()
            print(f"raster {spec['proj']:4} H={spec['H']} G={spec['G']} {spec['skew']:8} "
                  f"{kind:8} best r0 {best0:8.1f} us, best any {best:8.1f} us "
                  f"({min(t, key=t.get)}), gain {best0 / best:.3f}", flush=True)
        torch.cuda.empty_cache()
    by_kind = {k: gmean([r["gain"] for r in rows if r["kind"] == k]) for k in KINDS}
    print("raster study: oracle gain from adding raster-N variants (gm per kind): " +
          ", ".join(f"{k} {v:.3f}" for k, v in by_kind.items()), flush=True)
    return dict(rows=rows, gm_gain=by_kind)


STREAM_CASES = ((128, 1), (96, 64), (96, 128), (96, 160), (64, 190))   # (G, rows per group)


def run_streaming(iters: int):
    """Weight streaming of groups under ~190 rows (fwd, N=2048 K=7168): TB/s of weight bytes,
    with the case's roofline (compulsory bytes at copy bandwidth, or dense torch.mm with the same
    FLOPs).  Past ~160 rows per group the FLOPs bound, not the bytes, sets the ceiling."""
    out = []
    for G, m in STREAM_CASES:
        N, K = 2048, 7168
        counts = np.full(G, m)
        case = Case("fwd", counts, N, K)
        cfgs = gemm_cost_model.CONFIGS["fwd"]
        fns = {c.name: case.ours(i) for i, c in enumerate(cfgs)}
        fns.update(ours=case.ours(-1), torch=case.torch_grouped(), dense=case.dense())
        t = time_interleaved(fns, rounds=iters)
        per_cfg = {c.name: t[c.name] for c in cfgs}
        ours, tor = t["ours"], t["torch"]
        wbytes = G * N * K * 2
        bound = roofline_us("fwd", counts, N, K, t["dense"])
        r = dict(G=G, rows_per_group=m, N=N, K=K, ours_us=ours, torch_us=tor, configs_us=per_cfg,
                 dense_us=t["dense"], bound_us=bound,
                 ours_tbps=wbytes / ours / 1e6, torch_tbps=wbytes / tor / 1e6,
                 best_tbps=wbytes / min(per_cfg.values()) / 1e6, bound_tbps=wbytes / bound / 1e6,
                 device_choice=cfgs[case.chosen_on_device()].name)
        out.append(r)
        case.free()
        print(f"stream G={G} rows/group={m}: ours {r['ours_tbps']:.2f} TB/s (best config "
              f"{r['best_tbps']:.2f}, bound {r['bound_tbps']:.2f}), torch {r['torch_tbps']:.2f}",
              flush=True)
    return out


def prep_kernel_us(fn, reps: int = 20) -> float:
    """Median device time of the prep (selector) kernel over `reps` calls, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    ts = [e.time_range.elapsed_us() for e in prof.events() if "prep_kernel" in e.name]
    return statistics.median(ts) if ts else float("nan")


def run_selector_cost(iters: int):
    """Cost of automatic selection: the prep kernel's device time with the model (auto) and
    without (forced config), from the profiler; end to end auto minus forced (one fused GEMM
    launch either way); host model time."""
    out = {}
    for label, (kind, G, m, N, K) in {"tiny_fwd": ("fwd", 64, 1, 512, 512),
                                      "tiny_fwd_2cand": ("fwd", 64, 300, 512, 512),
                                      "moe_fwd": ("fwd", 64, 512, 4096, 7168),
                                      "g96x64_fwd": ("fwd", 96, 64, 2048, 7168),
                                      "moe_wgrad_lp": ("wgrad_lp", 64, 512, 4096, 7168),
                                      "g256_fwd": ("fwd", 256, 128, 2048, 2048),
                                      "g256_wgrad_lp": ("wgrad_lp", 256, 128, 2048, 2048)}.items():
        counts = np.full(G, m)
        case = Case(kind, counts, N, K)
        chosen = case.chosen_on_device()
        t = time_interleaved(dict(forced=case.ours(chosen), auto=case.ours(-1)), rounds=2 * iters,
                             iters=5)
        forced, auto = t["forced"], t["auto"]
        prep_auto, prep_forced = prep_kernel_us(case.ours(-1)), prep_kernel_us(case.ours(chosen))
        case.ours(-1)()      # SM cycles of the choice itself, written by the prep kernel
        model_cycles = int(case.workspace[8:16].view(torch.int64).item())
        case.free()
        out[label] = dict(kind=kind, G=G, rows=m, N=N, K=K, forced_us=forced, auto_us=auto,
                          overhead_us=auto - forced, prep_auto_us=prep_auto,
                          prep_forced_us=prep_forced, model_us=prep_auto - prep_forced,
                          model_cycles=model_cycles, model_us_at_1980mhz=model_cycles / 1980.0,
                          candidates=bin(gg.candidate_mask(kind, G * m, G)).count("1"))
    counts = histogram("zipf1.5", 64, 32768)
    t0 = time.perf_counter()
    for _ in range(100):
        gemm_cost_model.select(counts, 4096, 7168, "fwd")
    out["python_select_us"] = (time.perf_counter() - t0) / 100 * 1e6
    print("selector:", json.dumps(out), flush=True)
    return out


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------

def report(rows, stream, sel, env=None) -> str:
    L = []
    env = env or (f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
                  f"tuning: {gemm_tuning.CALIBRATION_SOURCE}")
    L.append(f"# Grouped GEMM benchmark\n\n{env}\n")
    targets = []
    for kind in KINDS:
        kr = [r for r in rows if r["kind"] == kind]
        if not kr:
            continue
        names = [c.name for c in gemm_cost_model.CONFIGS[kind]]
        best_single = max(names, key=lambda n: gmean([r_["flops"] / r_["configs_us"][n]
                                                      for r_ in kr]))
        L.append(f"\n## {kind} (TF/s)\n")
        L.append("| proj | H | G | skew | ours | torch | dense | oracle | best single "
                 f"({best_single}) | ours/dense | ours/torch | ours/oracle | bound/dense | "
                 "ours/bound | pick |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in kr:
            t = r["tflops"]
            single = t["oracle"] * min(r["configs_us"].values()) / r["configs_us"][best_single]
            r["best_single_tflops"] = single
            if "bound_us" not in r:      # JSON of an older run
                counts = histogram(r["skew"], r["G"], r["rows"], seed=r["G"])
                r["bound_us"] = roofline_us(kind, counts, r["N"], r["K"], r["dense_us"])
            L.append(f"| {r['proj']} | {r['H']} | {r['G']} | {r['skew']} | {t['ours']:.0f} | "
                     f"{t['torch']:.0f} | {t['dense']:.0f} | {t['oracle']:.0f} | {single:.0f} | "
                     f"{t['ours'] / t['dense']:.3f} | {t['ours'] / t['torch']:.3f} | "
                     f"{t['ours'] / t['oracle']:.3f} | {r['dense_us'] / r['bound_us']:.3f} | "
                     f"{r['bound_us'] / r['ours_us']:.3f} | {r['device_choice']} |")
        vs_dense = [r["tflops"]["ours"] / r["tflops"]["dense"] for r in kr]
        vs_torch = [r["tflops"]["ours"] / r["tflops"]["torch"] for r in kr if r["skew"] in SKEWED]
        vs_oracle = [r["tflops"]["ours"] / r["tflops"]["oracle"] for r in kr]
        vs_single = [r["tflops"]["ours"] / r["best_single_tflops"] for r in kr]
        host_vs_oracle = [r["tflops"]["host_sel"] / r["tflops"]["oracle"] for r in kr]
        vs_bound = [r["bound_us"] / r["ours_us"] for r in kr]
        over = sum(r["dense_us"] / r["bound_us"] < 0.95 for r in kr)
        targets += [
            (f"{kind}: ours >= 0.95x dense at every skew", min(vs_dense) >= 0.95,
             f"min {min(vs_dense):.3f}, gmean {gmean(vs_dense):.3f}; of the roofline bound "
             f"(max of dense and compulsory bytes at copy bandwidth): min {min(vs_bound):.3f}, "
             f"gmean {gmean(vs_bound):.3f}; cases whose bound is below 0.95x dense: "
             f"{over} of {len(kr)}"),
            (f"{kind}: ours >= 1.15x torch._grouped_mm at skew >= 0.8", min(vs_torch) >= 1.15,
             f"min {min(vs_torch):.3f}, gmean {gmean(vs_torch):.3f}"),
            (f"{kind}: scheduler within 3% of oracle (gmean)", gmean(vs_oracle) >= 0.97,
             f"gmean {gmean(vs_oracle):.3f}, min {min(vs_oracle):.3f}; host-selected gmean "
             f"{gmean(host_vs_oracle):.3f}"),
            (f"{kind}: >= 1.05x best single config (gmean)", gmean(vs_single) >= 1.05,
             f"gmean {gmean(vs_single):.3f} vs {best_single}"),
        ]
    if stream:
        L.append("\n## Weight streaming, fwd, N=2048 K=7168 (TB/s of weight bytes)\n")
        L.append("| G | rows/group | ours | best config | torch | bound | ours/bound | pick |")
        L.append("|---|---|---|---|---|---|---|---|")
        for s in stream:
            bnd = s.get("bound_tbps", float("nan"))   # older JSON: no bound
            L.append(f"| {s['G']} | {s['rows_per_group']} | {s['ours_tbps']:.2f} | "
                     f"{s['best_tbps']:.2f} | {s['torch_tbps']:.2f} | {bnd:.2f} | "
                     f"{s['ours_tbps'] / bnd:.2f} | {s['device_choice']} |")
        worst = min(s["ours_tbps"] for s in stream)
        targets.append(("groups < ~190 rows stream weights >= 3.8 TB/s", worst >= 3.8,
                        f"min {worst:.2f} TB/s"))
    if sel:
        per = {k: v for k, v in sel.items() if isinstance(v, dict)}
        ov = max(v["prep_auto_us"] for v in per.values())
        detail = "; ".join(f"{k} ({v['candidates']} cand.) prep {v['prep_auto_us']:.1f} us "
                           f"(forced {v['prep_forced_us']:.1f}; choice {v['model_cycles']} SM "
                           f"cycles = {v['model_us_at_1980mhz']:.1f} us at 1980 MHz), "
                           "end to end auto - forced "
                           f"{v['overhead_us']:.1f} us" for k, v in per.items())
        targets.append(("selector cost <= 5 us (one small kernel)", ov <= 5.0,
                        f"{detail}; Python model {sel['python_select_us']:.0f} us/call"))
    L.append("\n## Targets\n")
    L.append("| target | met | numbers |")
    L.append("|---|---|---|")
    for name, ok, detail in targets:
        L.append(f"| {name} | {'MET' if ok else 'not met'} | {detail} |")
    return "\n".join(L) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--iters", type=int, default=7, help="interleaved rounds (3 runs each)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="sweep,stream,selector",
                    help="comma-separated parts: sweep, stream, selector, raster (study)")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="comma-separated GEMM kinds of the sweep (default: all four)")
    ap.add_argument("--report-from", default=None,
                    help="rebuild the markdown report from an earlier run's "
                         "bench_grouped_gemm.json (no GPU) and print it")
    args = ap.parse_args(argv)
    if args.report_from:
        old = json.loads(Path(args.report_from).read_text())
        print(report(old["rows"], old["stream"], old["selector"],
                     env=f"torch {old['torch']}, {old['device']}, tuning: {old['tuning']}"))
        return
    kinds = tuple(args.kinds.split(","))
    if not set(kinds) <= set(KINDS):
        ap.error(f"--kinds: unknown kind in {args.kinds!r} (kinds: {', '.join(KINDS)})")
    assert torch.cuda.is_available(), "needs a GPU"
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    parts = set(args.only.split(","))
    rows = run_sweep(args.iters, args.quick, kinds) if "sweep" in parts else []
    stream = run_streaming(args.iters) if "stream" in parts else []
    sel = run_selector_cost(args.iters) if "selector" in parts else {}
    raster = run_raster_study(args.iters, args.quick) if "raster" in parts else {}
    md = report(rows, stream, sel)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_grouped_gemm.json").write_text(json.dumps(
        dict(rows=rows, stream=stream, selector=sel, raster=raster, torch=torch.__version__,
             device=torch.cuda.get_device_name(), tuning=gemm_tuning.CALIBRATION_SOURCE),
        indent=1, default=float))
    (out / "bench_grouped_gemm.md").write_text(md)
    print(md)
    print(f"bench took {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
