"""Measure the grouped-GEMM calibration set on the GPU; fit the cost model from the measurements.

    python benchmarks/calibrate_grouped_gemm.py [--write PATH] [--out DIR] [--kinds fwd,wgrad]

Measures every compiled config (forced) of every kind on a calibration set that is disjoint
from the benchmark's histograms (uniform, log-normal and tiny-group histograms over several
shapes) and the dense bf16 ceiling and device-copy bandwidth, and writes them to
DIR/calibration_grouped_gemm.json.  Then fits with benchmarks/fit_gemm_cost_model.py (the one fit
of the project: deterministic, held-out check, never-lose margin) on that file and rewrites
--write (default: the fit's, the package's moonep_ops/gemm/tuning.json).  ``--measure-only`` stops after the
JSON; ``--from-json FILE`` fits an earlier file without the GPU.  For constants that others can
reproduce, commit the JSON under benchmarks/calibration/ and fit from the committed files
(fit_gemm_cost_model.py FILE...): CALIBRATION_SOURCES then names them.  The model zoo
(benchmarks/bench_gemm_zoo.py) is the broader measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_grouped_gemm import Case, histogram, time_interleaved  # noqa: E402
from gemm_bench_common import measure_ceilings  # noqa: E402
from moonep_ops.gemm import cost_model as gemm_cost_model  # noqa: E402


def calibration_set():
    # (skew, G, total rows, N, K); none of these histograms is in the benchmark sweep
    cases = []
    for N, K in ((4096, 7168), (7168, 2048), (3072, 4096), (4096, 1536)):
        cases += [("uniform1024", 32, None, N, K), ("lognormal0.5", 64, 24576, N, K),
                  ("lognormal2.0", 48, 40960, N, K), ("uniform129", 64, None, N, K),
                  ("uniform40", 96, None, N, K),
                  # power-law and one-hot-expert skews, other exponents / G than the benchmark's
                  ("zipf1.0", 80, 40960, N, K), ("hot10x", 48, 32768, N, K)]
    cases += [("uniform1", 128, None, 2048, 7168), ("uniform96", 96, None, 2048, 7168),
              ("uniform190", 64, None, 2048, 7168), ("lognormal1.0", 128, 16384, 2048, 7168)]
    return cases


def measure(iters, kinds=gemm_cost_model.KINDS):
    data = {k: [] for k in kinds}
    for skew, G, total, N, K in calibration_set():
        counts = histogram(skew, G, total or 0, seed=123 + G)
        for kind in kinds:
            case = Case(kind, counts, N, K, seed=5)
            us = time_interleaved({c.name: case.ours(i) for i, c in
                                   enumerate(gemm_cost_model.CONFIGS[kind])}, rounds=iters)
            case.free()
            data[kind].append(dict(skew=skew, G=G, N=N, K=K, counts=counts.tolist(), us=us))
            print(f"{kind:5} {skew:13} G={G} N={N} K={K}: " +
                  " ".join(f"{n} {v:.0f}" for n, v in us.items()), flush=True)
        torch.cuda.empty_cache()
    return data


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", default=None, help="constants file (default: the fit's)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--iters", type=int, default=4, help="interleaved rounds (3 runs each)")
    ap.add_argument("--measure-only", action="store_true",
                    help="measure and write the JSON, fit nothing (fit later with --from-json)")
    ap.add_argument("--from-json", default=None,
                    help="fit the measurements of an earlier calibration_grouped_gemm.json")
    ap.add_argument("--kinds", default=",".join(gemm_cost_model.KINDS),
                    help="measure and refit only these kinds (comma-separated); the others keep "
                         "their constants, and the file's dense peak and copy bandwidth are kept "
                         "so that their constants stay valid")
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if set(kinds) - set(gemm_cost_model.KINDS):
        raise SystemExit(f"--kinds: unknown kind in {args.kinds!r}")
    t0 = time.time()
    if args.from_json:
        src = Path(args.from_json)
    else:
        peak, hbm = measure_ceilings()
        print(f"dense bf16 8192^3: {peak:.0f} TF/s, device copy: {hbm:.2f} TB/s", flush=True)
        data = measure(args.iters, kinds)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        src = out / "calibration_grouped_gemm.json"
        src.write_text(json.dumps(dict(peak_tflops=peak, hbm_tbps=hbm, data=data), indent=1))
        print(f"measured in {time.time() - t0:.0f} s; wrote {src}", flush=True)
        if args.measure_only:
            return 0
    import fit_gemm_cost_model
    write = ["--write", args.write] if args.write else []
    return fit_gemm_cost_model.main([str(src), "--kinds", ",".join(kinds)] + write)


if __name__ == "__main__":
    sys.exit(main())
