"""Where a grouped-GEMM call's time goes: ours (prep kernel + one fused GEMM kernel) against
torch._grouped_mm, from the profiler's kernel records and from CUDA-graph replays.

    python diagnostics/gemm_call_anatomy.py [--calls 20]

Cases: the zoo's fixed-cost probe (one 128-row group of G = 16, O = I = 256, fwd) and 2048-token
zoo calls where ours trailed torch in the last zoo run (benchmarks/data/gemm_zoo_cases.json).
Contenders: ours automatic (PDL on and off; fwd / dgrad under torch's contract, zero_tail=False,
and "ours_zt" with the op's default zero tail), ours with the device's pick forced (no model),
ours with torch's own config forced (the "torch" family: the same kernel as torch's), torch.

Per contender and case:
  eager     device time per call, k back-to-back calls behind a GPU spin (gemm_bench_common)
  graph     the same calls captured in one CUDA graph and replayed (no host launch path)
  period    profiler, eager: start of one call's first kernel to the next call's (median; the
            host's enqueue time per call when that is longer than the device's, as for our op's
            Python path: then only the eager and graph columns compare device times)
  kernels   profiler: each kernel of one call, "name duration grid" (median), and the gap between
            the end of the first and the start of the second (negative: the second started
            early, as a programmatic dependent launch does)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_gemm_zoo as zoo_bench  # noqa: E402
import gemm_bench_common as common  # noqa: E402

CASES = [  # (hist id, proj, kind); None: the fixed-cost probe
    (None, None, "fwd"),
    ("qwen3-30b-a3b/ep16/s2048/balanced", "down", "fwd"),
    ("qwen3-30b-a3b/ep16/s2048/balanced", "gate_up", "dgrad"),
    ("gpt-oss-120b/ep16/s2048/zipf_mv1", "gate_up", "fwd"),
    ("qwen3-30b-a3b/ep64/s2048/balanced", "down", "wgrad_lp"),
]


def contenders(kind, counts, M, O, I, seed):
    """The zoo benchmark's own calls of ours and torch (bench_gemm_zoo.contenders), a subset."""
    mods = common.gemm_modules()
    cm = mods.cost_model
    wg = zoo_bench.WeightGroup(len(counts) // 2, O, I, "cuda", seed=seed)
    zoo, _ = zoo_bench.contenders(mods, wg, kind, counts, M)
    pick = cm.select(counts, O, I, kind, rows=M)
    tcfg = cm.torch_config(kind, M, len(counts), O, I)
    fns = {"ours": zoo["ours"], "ours_nopdl": common.with_env(zoo["ours"], MOONEP_GEMM_PDL="0"),
           f"forced[{pick}]": zoo[pick]}
    if "ours_zt" in zoo:              # fwd / dgrad: the zero-tail default beside torch's contract
        fns["ours_zt"] = zoo["ours_zt"]
    if tcfg:
        fns[f"forced[{tcfg}]"] = zoo[tcfg]
    fns["torch"] = zoo["torch"]
    return fns


def graph_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(ts)


def profile_calls(fn, calls: int):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e6))            # ~1 ms spin: the calls queue behind it
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    grids = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") == "kernel" and "grid" in ev.get("args", {}):
            grids.setdefault(ev["name"], tuple(ev["args"]["grid"]))
    ks = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA
                 and "sleep" not in e.name.lower() and "memset" not in e.name.lower()),
                key=lambda t: t[0])
    per = len(ks) // calls if calls else 0
    if per == 0 or len(ks) % calls:
        return dict(per_call=len(ks) / max(calls, 1), note="kernel count not a multiple of calls")
    groups = [ks[i * per:(i + 1) * per] for i in range(calls)]
    period = statistics.median(groups[i + 1][0][0] - groups[i][0][0] for i in range(calls - 1))
    durs = [statistics.median(g[j][1] - g[j][0] for g in groups) for j in range(per)]
    gap = statistics.median(g[1][0] - g[0][1] for g in groups) if per >= 2 else None
    names = [groups[0][j][2] for j in range(per)]
    return dict(period=period, durs=durs, gap=gap, names=names,
                grids=[grids.get(n) for n in names])


def short(name: str) -> str:
    for key in ("prep_kernel", "fused_grouped_gemm", "prepare_grouped_gemm"):
        if key in name:
            return key
    return name[:28]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    hists = {h["id"]: h for h in json.loads((ROOT / "benchmarks" / "data" /
                                             "gemm_zoo_cases.json").read_text())["hists"]}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per call")
    print("| case | contender | eager | graph | period | kernels (us) | gap |")
    print("|---|---|---|---|---|---|---|")
    for hid, proj, kind in CASES:
        if hid is None:
            counts, M, O, I, label = [128] + [0] * 15, 256, 256, 256, "probe G16 fwd"
        else:
            h = hists[hid]
            D, F = h["D"], h["F"]
            O, I = (F, D) if proj == "gate_up" else (D, F)
            counts, M, label = h["counts"], h["M"], f"{hid} {proj} {kind}"
        fns = contenders(kind, counts, M, O, I, seed=5)
        eager = common.time_interleaved(fns, rounds=7)
        eager.pop("_meta")
        for n, fn in fns.items():
            g = graph_us(fn, a.calls)
            p = profile_calls(fn, a.calls)
            ks = " + ".join(f"{short(nm)} {d:.1f} grid {gr}" for nm, d, gr in
                            zip(p.get("names", []), p.get("durs", []), p.get("grids", [])))
            gap = "" if p.get("gap") is None else f"{p['gap']:.1f}"
            print(f"| {label} | {n} | {eager[n]['us']:.1f} | {g:.1f} | "
                  f"{p.get('period', float('nan')):.1f} | {ks or p.get('note', '')} | {gap} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
