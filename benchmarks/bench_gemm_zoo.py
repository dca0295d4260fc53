"""Model-zoo benchmark of the MoE grouped GEMM: ours vs torch._grouped_mm vs dense torch.mm.

    python benchmarks/bench_gemm_zoo.py --out DIR          # one H200, ~4-6 min
    python benchmarks/bench_gemm_zoo.py --estimate         # case count and time estimate (CPU)
    python benchmarks/bench_gemm_zoo.py --dry-run --out D  # CPU, reference backend, tiny sizes
    python benchmarks/bench_gemm_zoo.py --report-from DIR/gemm_zoo.json   # tables again (CPU)
    python benchmarks/bench_gemm_zoo.py --env-ab MOONEP_GEMM_PDL=0 --tokens 2048 --no-calib
        # A/B of a library switch: "ours" with the variable set, interleaved with the rest

What it measures (benchmarks/gemm_zoo_cases.py defines the zoo): the expert GEMMs of Qwen3-30B-A3B,
Qwen3-235B-A22B, DeepSeek-V3, Kimi-K2, Mixtral-8x22B and gpt-oss-120b at EP 8 / 16 / 64 where E
allows (G = 2*E/EP groups), 2048 and 8192 tokens per rank, with one rank's group sizes as the
project's planner (moonep_ops.plan_all_ranks, token_padding 128) gives them for balanced, Zipf
(maxvio 1 / 10 / 20), hot-expert and adversarial routings, the receive buffer's M rows as the
Buffer allocates them (nvs_s).  Both weight shapes (gate/up [F, D], down [D, F]; gate and up are
the same GEMM) and three directions: fwd, dgrad, wgrad_lp (bf16 out, the autograd path; measured
through grouped_mm_wgrad(out_dtype=bf16), which writes every group like torch does).

Contenders of one case, interleaved round robin in rounds (gemm_bench_common.time_interleaved:
CUDA events, a warm-up call each, k back-to-back launches per sample behind a GPU spin so that
small cases measure device time, median over rounds):
  ours      moonep_ops.grouped_mm / _dgrad / _wgrad, automatic config (device selector);
  <config>  every compiled config of the kind forced (``config=``): the calibration data, and
            the oracle (the best of them) that the selector is judged against;
  torch     torch._grouped_mm, the weights concatenated beforehand (not timed);
  dense     torch.mm with the same FLOPs (all the group rows as one GEMM).
Also: the dense bf16 ceiling and the copy bandwidth (for the roofline bound), GPU clocks
(nvidia-smi queries) through the run, and a fixed-cost probe (a near-empty call of each kind).

Output (--out, default $OUT or .): gemm_zoo.json (every measurement, the group sizes, shapes,
clocks, versions; ~1 MB; rewritten after every weight group so a run cut short keeps what it
measured) and gemm_zoo.md (targets, per-(family, EP) table, every case).  The summary printed last:
ours/torch per direction (all, skewed, min, cases < 0.98), ours/dense at >= 32k rows per rank,
ours/oracle (all and held out), the selector's cost.  Commit the JSON as
benchmarks/calibration/zoo_<date>.json; benchmarks/fit_gemm_cost_model.py fits on it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gemm_bench_common as common  # noqa: E402
import gemm_zoo_cases as zoo  # noqa: E402

SCHEMA = "moonep-gemm-zoo/1"
KINDS = ("fwd", "dgrad", "wgrad_lp")
ROWS_32K = 32768

# Dry run: tiny shapes (D, F, E, K), three (family, EP) pairs, few tokens, three histograms.
DRY_FAMILIES = {"toy-a": (256, 128, 16, 4), "toy-b": (192, 256, 8, 2)}
DRY_PAIRS = (("toy-a", 2), ("toy-a", 4), ("toy-b", 4))
DRY_TOKENS = (64,)
DRY_HISTS = ("balanced", "zipf_mv10", "adversarial")
DRY_HELD_OUT = {("toy-b", 4)}
# Dry run's stand-in for the calibration set: true counts (no token padding), one shape each.
DRY_CALIB = ((("calib", 128, 192), [5, 0, 17, 130], False), (("calib", 192, 128), [64, 1, 0, 33], True))


# ------------------------------------------------------------------------------------------
# cases
# ------------------------------------------------------------------------------------------

def dry_hists() -> list[dict]:
    out = []
    for fam, ep in DRY_PAIRS:
        D, F, E, K = DRY_FAMILIES[fam]
        for s in DRY_TOKENS:
            for name, kind, target in zoo.hist_specs(E, K):
                if name in DRY_HISTS:
                    out.append(zoo.build_hist(fam, ep, s, name, kind, target, spec=(D, F, E, K),
                                              held_out=(fam, ep) in DRY_HELD_OUT))
    for (proj, O, I), counts, held in DRY_CALIB:
        out.append(dict(id=f"calib/{O}x{I}/dry/G{len(counts)}", family="calib", ep=None, s=None,
                        hist="dry", G=len(counts), epn=len(counts) // 2, M=sum(counts) + 3,
                        counts=counts, held_out=held, shapes=[[proj, O, I]], K=None, D=None,
                        F=None))
    return out


def load_hists(path: str | None, filters: dict, calib: bool = True) -> list[dict]:
    """The zoo's histogram cases from the committed case file (else built now: minutes), then
    the calibration-set cases of that file (``calib``)."""
    p = Path(path) if path else zoo.CASES_PATH
    wanted = list(zoo.zoo_specs(**filters))
    have = {}
    if p.exists():
        have = {h["id"]: h for h in zoo.load(p)}
    out, missing = [], []
    for fam, ep, s, name, kind, target in wanted:
        h = have.get(zoo.hist_id(fam, ep, s, name))
        (out if h is not None else missing).append(h if h is not None else
                                                   (fam, ep, s, name, kind, target))
    if missing:
        print(f"{len(missing)} histogram cases not in {p}: planning them now", flush=True)
        for spec in missing:
            out.append(zoo.build_hist(*spec))
    if calib and p.exists():
        out += zoo.load(p, calib=True)
    return out


def projections_of(h: dict) -> list[tuple[str, int, int]]:
    if h.get("shapes"):                                  # calibration-set case: its own shape
        return [(p, int(O), int(I)) for p, O, I in h["shapes"]]
    D, F = h["D"], h["F"]
    out = [("gate_up", F, D)]
    if D != F:
        out.append(("down", D, F))
    return out


def measurement_plan(hists: list[dict], kinds) -> list[tuple]:
    """(hist, proj, O, I, kind) in measuring order: grouped by (family, ep, proj) so that one
    weight set serves every s, histogram and direction."""
    items = []
    groups = {}
    for h in hists:
        for proj, O, I in projections_of(h):
            groups.setdefault(weight_key(h, proj, O, I), []).append(h)
    for key, hs in groups.items():
        proj, O, I = key[2:5]
        for h in sorted(hs, key=lambda h: (h["s"] or 0, list(zoo.HISTS).index(h["hist"])
                                           if h["hist"] in zoo.HISTS else 0)):
            for kind in kinds:
                items.append((h, proj, O, I, kind))
    return items


def weight_key(h: dict, proj: str, O: int, I: int) -> tuple:
    """Cases with the same key share one weight set (zoo: per family, EP and projection)."""
    return (h["family"], h["ep"], proj, O, I, h["epn"])


def estimate(items, cm, tuning, rounds: int, warmup: int = 1, target_us: float = 250.0,
             per_case_s: float = 0.03) -> float:
    """Device seconds the measurement would take: every contender's predicted time (cost model;
    torch ~ the c128x256 prediction, dense at 85 % of the dense peak) times its runs, plus a
    per-case overhead (tensors, events, host)."""
    total = 0.0
    peak = float(tuning.PEAK_TFLOPS)
    for h, proj, O, I, kind in items:
        pred = cm.predict(h["counts"], O, I, kind)
        est = dict(pred)
        est["ours"] = min(pred.values()) + 3.0
        if kind in ("fwd", "dgrad"):          # the zero-tail default, measured beside
            tail = (h["M"] - sum(h["counts"])) * (O if kind == "fwd" else I) * 2
            est["ours_zt"] = est["ours"] + tail / 4.5e6
        est["torch"] = pred.get("c128x256", min(pred.values()))
        est["dense"] = common.flops(h["counts"], O, I) / (0.85 * peak * 1e6) + 5.0
        k = max(1, min(8, math.ceil(target_us / max(min(est.values()), 1.0))))
        # + one more call of ours: the device-choice readback
        total += (sum(est.values()) * (warmup + rounds * k) + est["ours"]) * 1e-6 + per_case_s
    return total


# ------------------------------------------------------------------------------------------
# measuring
# ------------------------------------------------------------------------------------------

def _rnd(shape, gen, device):
    return (torch.randn(*shape, generator=gen, device=device) * 0.5).to(torch.bfloat16)


class WeightGroup:
    """Tensors of one (family, ep, projection): the weights and, per s, the receive buffer's rows."""

    def __init__(self, epn: int, O: int, I: int, device: str, seed: int):
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.O, self.I, self.epn = O, I, epn
        self.wl = _rnd((epn, O, I), self.gen, device)
        self.ws = _rnd((epn, O, I), self.gen, device)
        self.wcat = torch.cat([self.wl, self.ws])            # torch's [G, O, I] (not timed)
        self.rows = {}

    def buffers(self, M: int):
        if M not in self.rows:
            self.rows.clear()
            self.rows[M] = (_rnd((M, self.I), self.gen, self.device),
                            _rnd((M, self.O), self.gen, self.device))
        return self.rows[M]


PDL_AB = False      # --pdl-ab: also time "ours_pdl" / "ours_nopdl" (MOONEP_GEMM_PDL=1 / 0)
ENV_AB = None       # --env-ab NAME=VALUE: also time "ours_env", ours with that variable set


def _with_pdl(fn, value: str):
    return common.with_env(fn, MOONEP_GEMM_PDL=value)


def contenders(mods, wg: WeightGroup, kind: str, counts, M: int) -> dict:
    import moonep_ops as mo
    cm = mods.cost_model
    x, dy = wg.buffers(M)
    wl, ws, wcat = wg.wl, wg.ws, wg.wcat
    epn = wg.epn
    dev = wg.device
    cu = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=dev)
    rows = int(sum(counts))
    fns = {}
    names = [c.name for c in cm.CONFIGS[kind]]
    # fwd / dgrad run under torch._grouped_mm's contract (rows past cu[-1] undefined,
    # zero_tail=False: what the MoE layer calls); "ours_zt" is the op's default, which zeroes
    # them (the price of that contract, in series with the GEMM)
    for n in names + ["ours"] + (["ours_zt"] if kind in ("fwd", "dgrad") else []):
        cfg = None if n in ("ours", "ours_zt") else n
        zt = n == "ours_zt"
        if kind == "fwd":
            fns[n] = (lambda cfg=cfg, zt=zt: mo.grouped_mm(x, wl, ws, cu, config=cfg,
                                                           zero_tail=zt))
        elif kind == "dgrad":
            fns[n] = (lambda cfg=cfg, zt=zt: mo.grouped_mm_dgrad(dy, wl, ws, cu, config=cfg,
                                                                 zero_tail=zt))
        else:
            fns[n] = (lambda cfg=cfg: mo.grouped_mm_wgrad(dy, x, cu, epn, config=cfg,
                                                          out_dtype=torch.bfloat16))
    if PDL_AB:
        fns["ours_pdl"] = _with_pdl(fns["ours"], "1")
        fns["ours_nopdl"] = _with_pdl(fns["ours"], "0")
    if ENV_AB:
        fns["ours_env"] = common.with_env(fns["ours"], **{ENV_AB[0]: ENV_AB[1]})
    if kind == "fwd":
        wt = wcat.transpose(-2, -1)
        fns["torch"] = lambda: torch._grouped_mm(x, wt, offs=cu)
    elif kind == "dgrad":
        fns["torch"] = lambda: torch._grouped_mm(dy, wcat, offs=cu)
    else:
        fns["torch"] = lambda: torch._grouped_mm(dy.t(), x, offs=cu)
    if rows > 0:
        xr, dyr, w0 = x[:rows], dy[:rows], wl[0]
        if kind == "fwd":
            w0t = w0.t()
            fns["dense"] = lambda: torch.mm(xr, w0t)
        elif kind == "dgrad":
            fns["dense"] = lambda: torch.mm(dyr, w0)
        else:
            dyt = dyr.t()
            fns["dense"] = lambda: torch.mm(dyt, xr)
    return fns, cu


def device_pick(mods, wg: WeightGroup, kind: str, cu, M: int):
    """The config the device selector ran (workspace word 0), through the ops module's internal
    launcher where it has one; None otherwise (the host model's pick is recorded either way)."""
    launch = getattr(mods.ops, "_launch", None)
    if launch is None or wg.device != "cuda":
        return None
    try:
        x, dy = wg.buffers(M)
        O, I, epn = wg.O, wg.I, wg.epn
        if kind == "fwd":
            d = torch.empty(M, O, dtype=torch.bfloat16, device="cuda")
            w = launch(kind, -1, x, wg.wl, wg.ws, d, None, cu, epn, M, O, I)
        elif kind == "dgrad":
            d = torch.empty(M, I, dtype=torch.bfloat16, device="cuda")
            w = launch(kind, -1, dy, wg.wl, wg.ws, d, None, cu, epn, M, O, I)
        else:
            gl = torch.empty(epn, O, I, dtype=torch.bfloat16, device="cuda")
            gs = torch.empty_like(gl)
            w = launch(kind, -1, dy, x, None, gl, gs, cu, epn, M, O, I)
        idx = int(w[:4].view(torch.int32).item())
        return mods.cost_model.CONFIGS[kind][idx].name
    except Exception as e:        # internal API moved: keep measuring
        return f"n/a ({type(e).__name__})"


def _r(v, nd=3):
    return None if v is None else round(float(v), nd)


def measure_case(mods, wg, h, proj, O, I, kind, rounds, device) -> dict:
    cm = mods.cost_model
    counts = h["counts"]
    M = h["M"]
    fns, cu = contenders(mods, wg, kind, counts, M)
    t = common.time_interleaved(fns, rounds=rounds, device=device)
    meta = t.pop("_meta")
    pick = cm.select(counts, O, I, kind, rows=M)
    if hasattr(cm, "call_candidates"):          # the never-lose rule's family and its configs
        family, cands = cm.call_candidates(kind, M, len(counts), O, I)
    else:
        family, cands = None, cm.candidates(kind, M, len(counts))
    rec = dict(hist=h["id"], proj=proj, kind=kind, O=O, I=I, M=M, rows=int(sum(counts)),
               us={n: _r(v["us"]) for n, v in t.items()},
               spread={n: _r(v["spread"], 4) for n, v in t.items()},
               k=meta["k"], rounds=meta["rounds"], sleep_us=_r(meta["sleep_us"], 1),
               cpu_us=meta["cpu_us"], pick=pick, family=family, candidates=list(cands),
               device_pick=device_pick(mods, wg, kind, cu, M))
    return rec


def fixed_cost_probe(mods, device: str, rounds: int = 5) -> dict:
    """Near-empty calls (G = 16 and 64, one 128-row group, O = I = 256): what a call costs
    besides its tiles (prep kernel, launch, tails) for ours (auto and forced) and torch."""
    cm = mods.cost_model
    out = {}
    for G in (16, 64):
        counts = [128] + [0] * (G - 1)
        wg = WeightGroup(G // 2, 256, 256, device, seed=7)
        for kind in KINDS:
            fns, cu = contenders(mods, wg, kind, counts, 128 * 2)
            pick = cm.select(counts, 256, 256, kind, rows=256)
            keep = {n: fns[n] for n in ("ours", pick, "torch") if n in fns}
            t = common.time_interleaved(keep, rounds=rounds, k=20 if device == "cuda" else 1,
                                        device=device)
            t.pop("_meta")
            out[f"G{G}_{kind}"] = dict(pick=pick, **{("forced" if n == pick else n): _r(v["us"])
                                                     for n, v in t.items()})
        del wg
    return out


def run(args, hists, mods, device: str, out_dir: Path, meta: dict) -> dict:
    items = measurement_plan(hists, args.kinds)
    if args.max_cases:
        items = items[:args.max_cases]
    doc = dict(schema=SCHEMA, complete=False, meta=meta,
               configs={k: [dict(name=c.name, BM=c.BM, BN=c.BN, BK=c.BK, CM=c.CM, CN=c.CN,
                                 pingpong=c.pingpong, swap=getattr(c, "swap", False),
                                 max_mean_rows=getattr(c, "max_mean_rows", 0),
                                 min_mean_rows=getattr(c, "min_mean_rows", 0),
                                 family=getattr(c, "family", "moonep"))
                             for c in mods.cost_model.CONFIGS[k]] for k in args.kinds},
               hists=hists, cases=[], probes={}, clocks=[])
    t0 = time.time()
    deadline = t0 + args.time_limit_s
    clk = common.gpu_clocks() if device == "cuda" else None
    if clk:
        doc["clocks"].append(clk)
    last_clock = time.time()
    wg, wkey = None, None
    done = 0
    cut = False
    with torch.no_grad():
        for h, proj, O, I, kind in items:
            key = weight_key(h, proj, O, I)
            if key != wkey:
                if wg is not None:
                    _write(doc, out_dir)
                    wg = None
                    if device == "cuda":
                        torch.cuda.empty_cache()
                if time.time() > deadline:
                    cut = True
                    break
                wg, wkey = WeightGroup(h["epn"], O, I, device, seed=zoo._seed(*key)), key
            rec = measure_case(mods, wg, h, proj, O, I, kind, args.rounds, device)
            doc["cases"].append(rec)
            done += 1
            if device == "cuda" and time.time() - last_clock > 20:
                clk = common.gpu_clocks()
                if clk:
                    doc["clocks"].append(clk)
                last_clock = time.time()
            if args.verbose:
                u = rec["us"]
                orc = min(u[c.name] for c in mods.cost_model.CONFIGS[kind])
                print(f"[{time.time() - t0:5.0f} s] {h['id']:40} {proj:7} {kind:8} ours "
                      f"{u['ours']:9.1f} torch {u['torch']:9.1f} oracle {orc:9.1f} "
                      f"[{rec['pick']}] k={rec['k']}", flush=True)
        wg = None
    doc["probes"]["fixed_cost"] = fixed_cost_probe(mods, device, rounds=max(3, args.rounds))
    if device == "cuda":
        clk = common.gpu_clocks()
        if clk:
            doc["clocks"].append(clk)
    doc["complete"] = not cut and done == len(items)
    doc["meta"]["measure_s"] = round(time.time() - t0, 1)
    doc["meta"]["cases_planned"] = len(items)
    doc["meta"]["cases_done"] = done
    _write(doc, out_dir)
    return doc


def _write(doc: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "gemm_zoo.json.tmp"
    tmp.write_text(json.dumps(doc, separators=(",", ":")))
    tmp.replace(out_dir / "gemm_zoo.json")


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------

def case_metrics(doc: dict) -> list[dict]:
    """Per case: the ratios of the report (time ratios, > 1 = ours faster)."""
    hists = {h["id"]: h for h in doc["hists"]}
    names = {k: [c["name"] for c in v] for k, v in doc["configs"].items()}
    hbm = doc["meta"].get("hbm_tbps") or doc["meta"].get("tuning_hbm_tbps") or 4.2
    out = []
    for c in doc["cases"]:
        h = hists[c["hist"]]
        u = c["us"]
        cfg_us = {n: u[n] for n in names[c["kind"]] if u.get(n)}
        if not cfg_us or not u.get("ours") or not u.get("torch"):
            continue
        oracle = min(cfg_us.values())
        m = dict(case=c, hist=h, oracle=oracle, oracle_cfg=min(cfg_us, key=cfg_us.get),
                 vs_torch=u["torch"] / u["ours"], oracle_vs_torch=u["torch"] / oracle,
                 vs_oracle=oracle / u["ours"],
                 pick_vs_oracle=oracle / cfg_us[c["pick"]] if c.get("pick") in cfg_us else None,
                 best_of_both=min(oracle, u["torch"]), zoo=h["family"] != "calib",
                 rows_per_rank=(h["s"] * h["K"]) if h.get("s") else None,
                 skewed=h["hist"] in zoo.SKEWED)
        if u.get("dense"):
            m["vs_dense"] = u["dense"] / u["ours"]
            m["bound_us"] = common.roofline_us(c["kind"], h["counts"], c["O"], c["I"], u["dense"],
                                               hbm)
            m["vs_bound"] = m["bound_us"] / u["ours"]
        out.append(m)
    return out


def _fmt(x, nd=3):
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def targets(ms: list[dict], kinds) -> list[tuple[str, bool, str]]:
    rows = []
    for kind in kinds:
        km = [m for m in ms if m["case"]["kind"] == kind]
        if not km:
            continue
        vt = [m["vs_torch"] for m in km]
        below = sum(v < 0.98 for v in vt)
        rows.append((f"{kind}: every zoo case >= 0.98x torch", min(vt) >= 0.98,
                     f"min {min(vt):.3f}, {below} of {len(vt)} below 0.98; gm {common.gmean(vt):.3f}; "
                     f"oracle of our configs: min {min(m['oracle_vs_torch'] for m in km):.3f}"))
        sk = [m["vs_torch"] for m in km if m["skewed"]]
        if sk:
            rows.append((f"{kind}: gm over skewed cases >= 1.10x torch", common.gmean(sk) >= 1.10,
                         f"gm {common.gmean(sk):.3f} over {len(sk)} cases (oracle "
                         f"{common.gmean([m['oracle_vs_torch'] for m in km if m['skewed']]):.3f})"))
        big = [m["vs_dense"] for m in km if (m["rows_per_rank"] or 0) >= ROWS_32K and "vs_dense" in m]
        if big:
            rows.append((f"{kind}: ours/dense gm >= 0.85 at >= 32k rows per rank",
                         common.gmean(big) >= 0.85, f"gm {common.gmean(big):.3f}, "
                         f"min {min(big):.3f} over {len(big)} cases"))
        ho = [m["vs_oracle"] for m in km if m["hist"]["held_out"]]
        if ho:
            hp = [m["pick_vs_oracle"] for m in km if m["hist"]["held_out"] and m["pick_vs_oracle"]]
            rows.append((f"{kind}: selector within 3 % of the oracle on held-out shapes",
                         common.gmean(ho) >= 0.97,
                         f"ours/oracle gm {common.gmean(ho):.3f} (min {min(ho):.3f}) over "
                         f"{len(ho)} held-out cases; host pick forced {common.gmean(hp):.3f}; all "
                         f"cases {common.gmean([m['vs_oracle'] for m in km]):.3f}"))
        u_ = [m["case"]["us"] for m in km]
        pd = [(u.get("ours_nopdl", u["ours"]) / u["ours_pdl"], u["torch"] / u["ours_pdl"])
              for u in u_ if u.get("ours_pdl")]
        if pd:                                    # --pdl-ab: the same run, PDL on
            rows.append((f"{kind}: A/B, GEMM launched as a PDL dependent of the prep kernel",
                         common.gmean([a for a, _ in pd]) > 1.0,
                         f"ours_pdl/ours_nopdl gm {common.gmean([a for a, _ in pd]):.3f} (min "
                         f"{min(a for a, _ in pd):.3f}); ours_pdl/torch gm "
                         f"{common.gmean([b for _, b in pd]):.3f}, min {min(b for _, b in pd):.3f}, "
                         f"{sum(b < 0.98 for _, b in pd)} of {len(pd)} below 0.98"))
        ea = [(u["ours"] / u["ours_env"], u["torch"] / u["ours"], u["torch"] / u["ours_env"])
              for u in u_ if u.get("ours_env")]
        if ea:                                    # --env-ab: ours with one variable set
            rows.append((f"{kind}: A/B, ours with the --env-ab variable (ours_env) vs without",
                         common.gmean([a for a, _, _ in ea]) > 1.0,
                         f"ours/ours_env gm {common.gmean([a for a, _, _ in ea]):.3f} (min "
                         f"{min(a for a, _, _ in ea):.3f}, max {max(a for a, _, _ in ea):.3f}); "
                         f"vs torch: ours gm {common.gmean([b for _, b, _ in ea]):.3f}, "
                         f"{sum(b < 0.98 for _, b, _ in ea)} of {len(ea)} below 0.98; ours_env gm "
                         f"{common.gmean([c for _, _, c in ea]):.3f}, "
                         f"{sum(c < 0.98 for _, _, c in ea)} below 0.98"))
    # the zero-tail default (ours_zt) against ours (tail undefined, torch's contract)
    zt = [(m["case"]["us"]["ours_zt"] - m["case"]["us"]["ours"],
           (m["case"]["M"] - m["case"]["rows"]) * (m["case"]["O"] if m["case"]["kind"] == "fwd"
                                                   else m["case"]["I"]) * 2e-6)
          for m in ms if m["case"]["us"].get("ours_zt")]
    if zt:
        mb = [b for _, b in zt]
        slope = (sum(a * b for a, b in zt) / sum(b * b for b in mb)) if any(mb) else 0.0
        rows.append(("zero_tail=True (the op's default) over zero_tail=False, fwd + dgrad",
                     None, f"median +{statistics.median(a for a, _ in zt):.2f} us over {len(zt)} "
                     f"cases, {slope:.3f} us per MB of tail (least squares through 0; median "
                     f"tail {statistics.median(mb):.1f} MB)"))
    # selector cost: ours (auto) minus the same config forced, per case
    d = [m["case"]["us"]["ours"] - m["case"]["us"][m["case"]["pick"]] for m in ms
         if m["case"].get("pick") in m["case"]["us"]]
    if d:
        rows.append(("selector cost <= 5 us (auto - forced pick, median over cases)",
                     statistics.median(d) <= 5.0,
                     f"median {statistics.median(d):.2f} us, 10-90 % "
                     f"{np.percentile(d, 10):.2f} .. {np.percentile(d, 90):.2f} us"))
    return rows


def report(doc: dict) -> tuple[str, str]:
    """(markdown of everything, the short summary printed last)."""
    kinds = [k for k in KINDS if k in doc["configs"]] + [k for k in doc["configs"] if k not in KINDS]
    every = case_metrics(doc)
    ms = [m for m in every if m["zoo"]]            # targets and tables: the zoo only
    cal = [m for m in every if not m["zoo"]]
    meta = doc["meta"]
    L = [f"# Grouped GEMM model zoo ({meta.get('date')})", "",
         f"{meta.get('device')}, torch {meta.get('torch')}, library md5 {meta.get('lib_md5')}, "
         f"tuning: {meta.get('tuning_source')}; dense {_fmt(meta.get('peak_tflops'), 0)} TF/s, "
         f"copy {_fmt(meta.get('hbm_tbps'), 2)} TB/s; {len(ms)} zoo cases + {len(cal)} of the "
         f"calibration set "
         f"({'complete' if doc.get('complete') else 'INCOMPLETE'}), measuring "
         f"{meta.get('measure_s')} s.", ""]
    S = []
    S.append("| kind | ours/torch gm | skewed gm | min | < 0.98 | oracle/torch gm (min) | "
             "ours/dense gm >= 32k rows | ours/oracle gm (held out) | pick/oracle gm (min) |")
    S.append("|---|---|---|---|---|---|---|---|---|")
    for kind in kinds:
        km = [m for m in ms if m["case"]["kind"] == kind]
        if not km:
            continue
        vt = [m["vs_torch"] for m in km]
        sk = [m["vs_torch"] for m in km if m["skewed"]]
        big = [m["vs_dense"] for m in km if (m["rows_per_rank"] or 0) >= ROWS_32K and "vs_dense" in m]
        ho = [m["vs_oracle"] for m in km if m["hist"]["held_out"]]
        pk = [m["pick_vs_oracle"] for m in km if m["pick_vs_oracle"]]
        ot = [m["oracle_vs_torch"] for m in km]
        S.append(f"| {kind} | {_fmt(common.gmean(vt))} | {_fmt(common.gmean(sk))} | "
                 f"{_fmt(min(vt))} | {sum(v < 0.98 for v in vt)}/{len(vt)} | "
                 f"{_fmt(common.gmean(ot))} ({_fmt(min(ot))}) | {_fmt(common.gmean(big))} | "
                 f"{_fmt(common.gmean([m['vs_oracle'] for m in km]))} "
                 f"({_fmt(common.gmean(ho))}) | {_fmt(common.gmean(pk))} "
                 f"({_fmt(min(pk) if pk else None)}) |")
    if cal:
        for kind in kinds:
            km = [m for m in cal if m["case"]["kind"] == kind]
            if km:
                pk = [m["pick_vs_oracle"] for m in km if m["pick_vs_oracle"]]
                S.append(f"| {kind} (calibration set) | "
                         f"{_fmt(common.gmean([m['vs_torch'] for m in km]))} | - | "
                         f"{_fmt(min(m['vs_torch'] for m in km))} | - | "
                         f"{_fmt(common.gmean([m['oracle_vs_torch'] for m in km]))} | - | "
                         f"{_fmt(common.gmean([m['vs_oracle'] for m in km]))} | "
                         f"{_fmt(common.gmean(pk))} |")
    T = ["| target | met | numbers |", "|---|---|---|"]
    for name, ok, detail in targets(ms, kinds):
        T.append(f"| {name} | {'info' if ok is None else 'MET' if ok else 'not met'} | {detail} |")
    L += ["## Summary (time ratios, > 1: ours faster)", ""] + S + ["", "## Targets", ""] + T
    # per (family, EP): ours/torch gm and min per kind
    L += ["", "## Per family and EP degree: ours/torch gm (min); ours/oracle gm", ""]
    hdr = "| family | EP | G | held out | " + " | ".join(kinds) + " |"
    L += [hdr, "|" + "---|" * (4 + len(kinds))]
    fams = []
    for m in ms:
        key = (m["hist"]["family"], m["hist"]["ep"])
        if key not in fams:
            fams.append(key)
    for fam, ep in fams:
        fm = [m for m in ms if (m["hist"]["family"], m["hist"]["ep"]) == (fam, ep)]
        cells = []
        for kind in kinds:
            km = [m for m in fm if m["case"]["kind"] == kind]
            if not km:
                cells.append("-")
                continue
            vt = [m["vs_torch"] for m in km]
            cells.append(f"{common.gmean(vt):.2f} ({min(vt):.2f}); "
                         f"{common.gmean([m['vs_oracle'] for m in km]):.2f}")
        L.append(f"| {fam} | {ep} | {fm[0]['hist']['G']} | {'yes' if fm[0]['hist']['held_out'] else ''}"
                 f" | " + " | ".join(cells) + " |")
    # fixed cost probe
    fc = doc.get("probes", {}).get("fixed_cost")
    if fc:
        L += ["", "## Fixed cost of a near-empty call (us; one 128-row group, O = I = 256)", "",
              "| case | ours (auto) | forced pick | torch |", "|---|---|---|---|"]
        for k, v in fc.items():
            L.append(f"| {k} | {_fmt(v.get('ours'), 1)} | {_fmt(v.get('forced'), 1)} "
                     f"[{v.get('pick')}] | {_fmt(v.get('torch'), 1)} |")
    # every case
    L += ["", "## Every case (us; TF/s of ours)", "",
          "| hist | proj | kind | O | I | G | ours | torch | dense | oracle (cfg) | pick | "
          "ours/torch | ours/oracle | ours/bound | TF/s |", "|" + "---|" * 15]
    for m in every:
        c, h = m["case"], m["hist"]
        tf = common.flops(h["counts"], c["O"], c["I"]) / (c["us"]["ours"] * 1e6)
        L.append(f"| {h['id']} | {c['proj']} | {c['kind']} | {c['O']} | {c['I']} | {h['G']} | "
                 f"{c['us']['ours']:.1f} | {c['us']['torch']:.1f} | "
                 f"{_fmt(c['us'].get('dense'), 1)} | {m['oracle']:.1f} ({m['oracle_cfg']}) | "
                 f"{c.get('pick')} | {m['vs_torch']:.3f} | {m['vs_oracle']:.3f} | "
                 f"{_fmt(m.get('vs_bound'))} | {tf:.0f} |")
    summary = "\n".join(["## Summary (time ratios, > 1: ours faster)", ""] + S
                        + ["", "## Targets", ""] + T)
    return "\n".join(L) + "\n", summary


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------

def environment(mods, device: str, args) -> dict:
    lib = common.gemm_library_path()
    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                torch=torch.__version__, cuda=torch.version.cuda, python=sys.version.split()[0],
                device=(torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"),
                sm_count=(torch.cuda.get_device_properties(0).multi_processor_count
                          if device == "cuda" else None),
                git=common.git_commit(), lib=str(lib) if lib else None, lib_md5=common.file_md5(lib),
                env_ab=args.env_ab,
                backend=None, tuning_source=getattr(mods.tuning, "CALIBRATION_SOURCE", None),
                tuning_file=getattr(mods.tuning, "__file__", None),
                tuning_peak_tflops=float(mods.tuning.PEAK_TFLOPS),
                tuning_hbm_tbps=float(mods.tuning.HBM_TBPS),
                args={k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
                timing=dict(method="gemm_bench_common.time_interleaved", rounds=args.rounds,
                            warmup=1, target_us=250.0, l2_flush=False),
                token_padding=zoo.TOKEN_PADDING, kinds=list(args.kinds),
                held_out=sorted([list(x) for x in (DRY_HELD_OUT if args.dry_run else zoo.HELD_OUT)]))
    probe = torch.zeros(8, 8, dtype=torch.bfloat16, device=device)
    meta["backend"] = mods.ops.backend_for(probe, 8, 8)
    return meta


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=0,
                    help="interleaved rounds per case (0: the most that fit --budget-s, 3..7)")
    ap.add_argument("--budget-s", type=float, default=270.0,
                    help="device seconds the zoo may take by the estimate (sets --rounds)")
    ap.add_argument("--time-limit-s", type=float, default=450.0,
                    help="stop starting new weight groups after this many seconds of measuring")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--families", default="", help="comma-separated subset of the zoo families")
    ap.add_argument("--eps", default="", help="comma-separated subset of EP degrees")
    ap.add_argument("--tokens", default="", help="comma-separated subset of tokens per rank")
    ap.add_argument("--hists", default="", help="comma-separated subset of histograms")
    ap.add_argument("--cases", default=None,
                    help="case file (default benchmarks/data/gemm_zoo_cases.json)")
    ap.add_argument("--max-cases", type=int, default=0)
    ap.add_argument("--no-calib", action="store_true",
                    help="skip the calibration-set cases of the case file (measured after the zoo)")
    ap.add_argument("--estimate", action="store_true", help="print case count and time estimate")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, reference backend, tiny shapes: checks the script end to end")
    ap.add_argument("--report-from", default=None, help="rebuild the report from a gemm_zoo.json")
    ap.add_argument("--verbose", action="store_true", help="one line per case")
    ap.add_argument("--pdl-ab", action="store_true",
                    help="also time ours with the GEMM launched as a programmatic dependent of "
                         "the prep kernel and after it (MOONEP_GEMM_PDL=1 / 0), interleaved with "
                         "the rest")
    ap.add_argument("--env-ab", default=None, metavar="NAME=VALUE",
                    help="also time ours with the environment variable NAME=VALUE (a switch of "
                         "the library, e.g. MOONEP_GEMM_PDL=0), interleaved with the rest")
    args = ap.parse_args(argv)
    global PDL_AB, ENV_AB
    PDL_AB = args.pdl_ab
    if args.env_ab:
        if "=" not in args.env_ab:
            ap.error("--env-ab takes NAME=VALUE")
        ENV_AB = tuple(args.env_ab.split("=", 1))
    args.kinds = tuple(k for k in args.kinds.split(",") if k)

    if args.report_from:
        doc = json.loads(Path(args.report_from).read_text())
        md, summary = report(doc)
        print(md)
        return 0

    mods = common.gemm_modules()
    bad = set(args.kinds) - set(mods.cost_model.KINDS)
    if bad:
        ap.error(f"unknown kinds {sorted(bad)}")
    filters = dict(families=set(filter(None, args.families.split(","))) or None,
                   eps={int(e) for e in args.eps.split(",") if e} or None,
                   tokens={int(t) for t in args.tokens.split(",") if t} or None,
                   hists=set(filter(None, args.hists.split(","))) or None)
    t_start = time.time()
    if args.dry_run:
        device = "cpu"
        hists = dry_hists()
        args.rounds = args.rounds or 2
    else:
        device = "cuda"
        hists = load_hists(args.cases, filters, calib=not args.no_calib)
    items = measurement_plan(hists, args.kinds)
    if args.max_cases:
        items = items[:args.max_cases]
    n_hist = len({h["id"] for h, *_ in items if h["family"] != "calib"})
    n_cal = len({h["id"] for h, *_ in items if h["family"] == "calib"})
    n_cal_items = sum(1 for h, *_ in items if h["family"] == "calib")
    if not args.rounds:
        args.rounds = 3
        for r in range(7, 2, -1):
            if estimate(items, mods.cost_model, mods.tuning, r) <= args.budget_s:
                args.rounds = r
                break
    est = estimate(items, mods.cost_model, mods.tuning, args.rounds)
    n_held = sum(1 for h, *_ in items if h["held_out"])
    print(f"zoo: {n_hist} histogram cases + {n_cal} of the calibration set; "
          f"{len(items) - n_cal_items} + {n_cal_items} GEMM cases ({n_held} held out) x "
          f"{args.rounds} rounds; estimated {est:.0f} s of device time "
          f"(kinds {', '.join(args.kinds)})", flush=True)
    if args.estimate:
        per = {}
        for h, proj, O, I, kind in items:
            per.setdefault(h["family"], []).append((h, proj, O, I, kind))
        for fam, its in per.items():
            e = estimate(its, mods.cost_model, mods.tuning, args.rounds)
            print(f"  {fam:18} {len(its):4} cases  ~{e:5.0f} s")
        return 0
    if device == "cuda":
        assert torch.cuda.is_available(), "needs a GPU (or --dry-run)"
        torch.backends.cuda.matmul.allow_tf32 = False
    meta = environment(mods, device, args)
    if device == "cuda":
        peak, hbm = common.measure_ceilings()
        meta["peak_tflops"], meta["hbm_tbps"] = round(peak, 1), round(hbm, 3)
        print(f"dense bf16 8192^3: {peak:.0f} TF/s, device copy: {hbm:.2f} TB/s; backend "
              f"{meta['backend']}", flush=True)
    else:
        meta["peak_tflops"], meta["hbm_tbps"] = None, None
    meta["estimate_s"] = round(est, 1)
    out_dir = Path(args.out)
    doc = run(args, hists, mods, device, out_dir, meta)
    doc["meta"]["wall_s"] = round(time.time() - t_start, 1)
    _write(doc, out_dir)
    md, summary = report(doc)
    (out_dir / "gemm_zoo.md").write_text(md)
    size = (out_dir / "gemm_zoo.json").stat().st_size
    print(summary)
    print(f"\n{len(doc['cases'])} of {doc['meta']['cases_planned']} cases "
          f"({'complete' if doc['complete'] else 'INCOMPLETE'}); measuring "
          f"{doc['meta']['measure_s']} s, wall {doc['meta']['wall_s']} s; wrote "
          f"{out_dir / 'gemm_zoo.json'} ({size / 1e6:.2f} MB) and gemm_zoo.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
