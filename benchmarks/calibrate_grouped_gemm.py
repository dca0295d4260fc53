"""Fit the grouped-GEMM cost model's constants on the GPU and rewrite moonep_ops/gemm_tuning.py.

    python benchmarks/calibrate_grouped_gemm.py [--write PATH] [--out DIR]

Measures every compiled config (forced) of every kind on a calibration set that is disjoint
from the benchmark's histograms (uniform, log-normal and tiny-group histograms over several
shapes), measures the dense bf16 ceiling and the device-copy bandwidth, then fits per config
(eta, bw_frac, tau_sw_us, tau0_us, tau_epi_us) by minimising the mean squared log error of the model
(gemm_cost_model) with Nelder-Mead.  Writes the new gemm_tuning.py to --write (default: the
package's file) and a JSON of the measurements and fit errors to --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_grouped_gemm import Case, histogram, time_interleaved, time_us  # noqa: E402
from moonep_ops import gemm_cost_model, gemm_tuning  # noqa: E402

TUNING_PATH = Path(__file__).resolve().parent.parent / "moonep_ops" / "gemm_tuning.py"


def calibration_set():
    # (skew, G, total rows, N, K); none of these histograms is in the benchmark sweep
    cases = []
    for N, K in ((4096, 7168), (7168, 2048), (3072, 4096), (4096, 1536)):
        cases += [("uniform1024", 32, None, N, K), ("lognormal0.5", 64, 24576, N, K),
                  ("lognormal2.0", 48, 40960, N, K), ("uniform129", 64, None, N, K),
                  ("uniform40", 96, None, N, K)]
    cases += [("uniform1", 128, None, 2048, 7168), ("uniform96", 96, None, 2048, 7168),
              ("uniform190", 64, None, 2048, 7168), ("lognormal1.0", 128, 16384, 2048, 7168)]
    return cases


def measure_dense_and_copy():
    a = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
    t = time_us(lambda: torch.mm(a, b), iters=20, warmup=5)
    peak = 2 * 8192**3 / (t * 1e-6) / 1e12
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_us(lambda: dst.copy_(src), iters=20, warmup=5)
    hbm = 2 * src.numel() / (t * 1e-6) / 1e12
    del a, b, src, dst
    torch.cuda.empty_cache()
    return peak, hbm


def measure(iters):
    data = {k: [] for k in gemm_cost_model.KINDS}
    for skew, G, total, N, K in calibration_set():
        counts = histogram(skew, G, total or 0, seed=123 + G)
        for kind in gemm_cost_model.KINDS:
            case = Case(kind, counts, N, K, seed=5)
            us = time_interleaved({c.name: case.ours(i) for i, c in
                                   enumerate(gemm_cost_model.CONFIGS[kind])}, rounds=iters)
            case.free()
            data[kind].append(dict(skew=skew, G=G, N=N, K=K, counts=counts.tolist(), us=us))
            print(f"{kind:5} {skew:13} G={G} N={N} K={K}: " +
                  " ".join(f"{n} {v:.0f}" for n, v in us.items()), flush=True)
        torch.cuda.empty_cache()
    return data


def fit(data, peak, hbm):
    from scipy.optimize import minimize

    gemm_tuning.PEAK_TFLOPS, gemm_tuning.HBM_TBPS = peak, hbm
    result, errors = {}, {}
    for kind, cases in data.items():
        result[kind] = {}
        for cfg in gemm_cost_model.CONFIGS[kind]:
            seed = gemm_tuning.EFFICIENCY[kind][cfg.name]

            def unpack(z):
                # eta, bw_frac in (0, 1.2]; tau_sw, tau0, tau_epi >= 0 (log-parametrised)
                return (min(1.2, math.exp(z[0])), min(1.2, math.exp(z[1])),
                        math.exp(z[2]), math.exp(z[3]), math.exp(z[4]))

            def loss(z):
                gemm_tuning.EFFICIENCY[kind][cfg.name] = unpack(z)
                err = 0.0
                for c in cases:
                    p = gemm_cost_model.predict(c["counts"], c["N"], c["K"], kind,
                                                configs=(cfg.name,))[cfg.name]
                    err += math.log(p / c["us"][cfg.name]) ** 2
                return err / len(cases)

            z0 = [math.log(seed[0]), math.log(seed[1]), math.log(max(seed[2], 1e-3)),
                  math.log(max(seed[3], 1e-2)), math.log(max(seed[4], 0.3))]
            res = minimize(loss, z0, method="Nelder-Mead",
                           options=dict(maxiter=1200, xatol=1e-3, fatol=1e-7))
            best = unpack(res.x)
            gemm_tuning.EFFICIENCY[kind][cfg.name] = best
            result[kind][cfg.name] = tuple(round(v, 4) for v in best)
            errors[f"{kind}/{cfg.name}"] = math.sqrt(res.fun)
            print(f"fit {kind}/{cfg.name}: eta={best[0]:.3f} bw_frac={best[1]:.3f} "
                  f"tau_sw={best[2]:.2f}us tau0={best[3]:.1f}us tau_epi={best[4]:.2f}us  "
                  f"rms log err {math.sqrt(res.fun):.3f}", flush=True)
    return result, errors


def selection_quality(data):
    """How close the model's pick is to the best measured config on the calibration set."""
    out = {}
    for kind, cases in data.items():
        ratios = []
        for c in cases:
            pick = gemm_cost_model.select(c["counts"], c["N"], c["K"], kind)
            ratios.append(min(c["us"].values()) / c["us"][pick])
        out[kind] = dict(gmean=float(np.exp(np.mean(np.log(ratios)))), min=float(min(ratios)))
    return out


def write_tuning(path: Path, result, peak, hbm, source):
    lines = [
        '"""Fitted constants of the grouped-GEMM cost model (moonep_ops.gemm_cost_model).',
        "",
        "THIS FILE IS REWRITTEN by ``benchmarks/calibrate_grouped_gemm.py``; edit by hand only to seed it.",
        "",
        "PEAK_TFLOPS / HBM_TBPS: the measured dense bf16 ceiling and device-copy bandwidth of the H200.",
        "EFFICIENCY[kind][config] = (eta, bw_frac, tau_sw_us, tau0_us, tau_epi_us):",
        "  eta        fraction of PEAK_TFLOPS one tile's MMA mainloop reaches with this config;",
        "  bw_frac    fraction of HBM_TBPS reached by rounds bound by first-touch HBM bytes;",
        "  tau_sw_us  extra time of a round in which some CTA starts a new group (descriptor update);",
        "  tau0_us    launch + prologue + tail of one GEMM;",
        "  tau_epi_us epilogue time one tile adds to its mainloop (not overlapped: cooperative kernels).",
        '"""',
        "",
        "CALIBRATED = True",
        f"CALIBRATION_SOURCE = {source!r}",
        "",
        f"PEAK_TFLOPS = {peak:.1f}",
        f"HBM_TBPS = {hbm:.3f}",
        "NUM_SMS = 132",
        "",
        "EFFICIENCY = {",
    ]
    for kind, cfgs in result.items():
        lines.append(f'    "{kind}": {{')
        for name, vals in cfgs.items():
            lines.append(f'        "{name}": {tuple(float(v) for v in vals)!r},')
        lines.append("    },")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", default=str(TUNING_PATH))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--iters", type=int, default=4, help="interleaved rounds (3 runs each)")
    args = ap.parse_args(argv)
    t0 = time.time()
    peak, hbm = measure_dense_and_copy()
    print(f"dense bf16 8192^3: {peak:.0f} TF/s, device copy: {hbm:.2f} TB/s", flush=True)
    data = measure(args.iters)
    result, errors = fit(data, peak, hbm)
    quality = selection_quality(data)
    print("model pick vs best measured on the calibration set:", quality)
    source = (f"benchmarks/calibrate_grouped_gemm.py on {torch.cuda.get_device_name()}, "
              f"torch {torch.__version__}, {datetime.date.today().isoformat()}")
    write_tuning(Path(args.write), result, peak, hbm, source)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration_grouped_gemm.json").write_text(json.dumps(
        dict(peak_tflops=peak, hbm_tbps=hbm, fit=result, rms_log_err=errors,
             selection_quality=quality, data=data), indent=1))
    print(f"wrote {args.write}; calibration took {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
