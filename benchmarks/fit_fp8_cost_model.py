"""Fit the FP8 grouped GEMM's cost model on COMMITTED measurements, check it on held-out shapes,
write moonep_ops/gemm/tuning_fp8.json.  CPU only (numpy), deterministic.

    python benchmarks/fit_fp8_cost_model.py benchmarks/calibration/fp8_zoo_<date>.json \
        [--write PATH | --no-write]

Input: fp8_zoo.json files of benchmarks/bench_fp8_gemm.py (every device-choosable config
forced on every case; ``held_out`` per case: the zoo's split by model family and EP degree,
gemm_zoo_cases.HELD_OUT, chosen before any fit).  The model (moonep_ops/gemm/fp8_cost.py, the
device's rule) per candidate config c:

    t_c = fixed_c + max(rounds_c * (per_round_c + per_kblock_c * kblocks), bytes / MEM_BYTES_PER_US)

MEM_BYTES_PER_US is the device-copy bandwidth of the bf16 model (gemm/tuning.py HBM_TBPS: one
hardware constant in one place), not fitted.  Per config, (fixed, per_round, per_kblock) are a
non-negative least-squares fit of the relative error on the TRAINING cases whose compute term
exceeds the bytes term (two passes: the first decides which cases are bound by bytes).  The
report: prediction error on the held-out cases (median, p90 of |pred / meas - 1|) and pick
quality (oracle / pick among the candidates: gm and min), training and held out, before (the
constants in force) and after.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moonep_ops.gemm import fp8_cost, tuning, tuning_fp8  # noqa: E402

MEM = float(tuning.HBM_TBPS) * 1e6          # bytes per microsecond


def load(paths) -> tuple[list[dict], int]:
    rows, sms = [], None
    for p in paths:
        d = json.loads(Path(p).read_text())
        sms = sms or d["meta"]["sm_count"]
        for r in d["cases"]:
            if all(f"fp8_{n}" in r["us"] for n in fp8_cost.AUTO_NAMES):
                rows.append(r)
    return rows, int(sms)


def features(r, cfg, sms):
    counts = r["counts"]
    rounds = fp8_cost.rounds(counts, r["O"], cfg, sms)
    kblocks = -(-r["I"] // fp8_cost.TILE)
    rows = sum(counts)
    nonempty = sum(1 for c in counts if c > 0)
    t_mem = (nonempty * r["O"] * r["I"] + rows * r["I"] + 2.0 * rows * r["O"]) / MEM
    return np.array([1.0, rounds, rounds * kblocks]), t_mem


def nnls_rel(X, y):
    """min || (X b - y) / y || with b >= 0 (active-set by clipping, three columns)."""
    w = 1.0 / y
    free = [0, 1, 2]
    for _ in range(4):
        b = np.zeros(3)
        sol, *_ = np.linalg.lstsq(X[:, free] * w[:, None], np.ones_like(y), rcond=None)
        b[free] = sol
        neg = [j for j in free if b[j] < 0]
        if not neg:
            return b
        free = [j for j in free if j not in neg]
    return np.clip(b, 0, None)


def fit(rows, sms):
    consts = {}
    for cfg in fp8_cost.FP8_CONFIGS[:fp8_cost.AUTO_CONFIGS]:
        F = [features(r, cfg, sms) for r in rows]
        X = np.array([f[0] for f in F])
        tm = np.array([f[1] for f in F])
        y = np.array([r["us"][f"fp8_{cfg.name}"] for r in rows])
        keep = np.ones(len(y), bool)
        for _ in range(2):
            b = nnls_rel(X[keep], y[keep])
            keep = X @ np.r_[0.0, b[1:]] >= tm      # compute-bound under the current fit
            if keep.sum() < 8:
                keep[:] = True
        consts[cfg.name] = tuple(round(float(v), 5) for v in b)
    return consts


def report(rows, sms, consts):
    names = fp8_cost.AUTO_NAMES
    err = {n: [] for n in names}
    ratio = []
    for r in rows:
        pred = fp8_cost.predict(r["counts"], r["O"], r["I"], sms, consts, MEM)
        for n in names:
            err[n].append(abs(pred[n] / r["us"][f"fp8_{n}"] - 1))
        pick = fp8_cost.pick(pred)
        ratio.append(min(r["us"][f"fp8_{n}"] for n in names) / r["us"][f"fp8_{pick}"])
    gm = math.exp(sum(math.log(x) for x in ratio) / len(ratio)) if ratio else float("nan")
    return dict(n=len(rows), pick_oracle_gm=round(gm, 4),
                pick_oracle_min=round(min(ratio), 4) if ratio else None,
                below_097=sum(x < 0.97 for x in ratio),
                err={n: (round(float(np.median(e)), 4), round(float(np.percentile(e, 90)), 4))
                     for n, e in err.items()})


def write(path: Path, consts, sources):
    """The constants file, whole, under tuning_fp8.KEYS (the tie window is not fitted: kept)."""
    values = (True, sources, {n: tuple(v) for n, v in consts.items()}, MEM, tuning_fp8.TIE_TOL)
    path.write_text(tuning.dumps(dict(zip(tuning_fp8.KEYS, values))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--write", default=str(tuning.path("tuning_fp8.json")))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    rows, sms = load(args.files)
    train = [r for r in rows if not r["held_out"]]
    held = [r for r in rows if r["held_out"]]
    before = tuning_fp8.CONSTANTS
    consts = fit(train, sms)
    print(f"{len(train)} training cases, {len(held)} held out; sm_count {sms}")
    print("constants (fixed_us, per_round_us, per_kblock_us):")
    for n, v in consts.items():
        print(f"  {n}: {v}")
    print("| constants | cases | pick / oracle gm | min | < 0.97 | prediction error median / p90 |")
    print("|---|---|---|---|---|---|")
    for label, c in (("before", before), ("fitted", consts)):
        for sub_label, sub in (("training", train), ("held out", held)):
            rep = report(sub, sms, c)
            e = "; ".join(f"{n} {m:.3f} / {p:.3f}" for n, (m, p) in rep["err"].items())
            print(f"| {label} | {sub_label} ({rep['n']}) | {rep['pick_oracle_gm']:.4f} | "
                  f"{rep['pick_oracle_min']:.4f} | {rep['below_097']} | {e} |")
    if not args.no_write:
        src = (f"benchmarks/fit_fp8_cost_model.py on "
               f"{', '.join(str(Path(f)) for f in args.files)} ({len(train)} training cases, "
               f"{len(held)} held out)")
        write(Path(args.write), consts, src)
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
