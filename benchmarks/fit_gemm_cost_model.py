"""Fit the grouped-GEMM cost model's constants on COMMITTED measurements; check them on held-out
shapes; write the constants file.  CPU only (numpy + scipy), deterministic.

    python benchmarks/fit_gemm_cost_model.py moonep_ops/gemm/calibration/zoo_<date>.json \
        [--write PATH | --no-write] [--report-out FIT.json] [--kinds fwd,dgrad,wgrad_lp]

Input: a gemm_zoo.json of benchmarks/bench_gemm_zoo.py (schema moonep-gemm-zoo/1: every config
forced on every case, ``held_out`` per histogram case), or a calibration_grouped_gemm.json of
benchmarks/calibrate_grouped_gemm.py (the current format: {peak_tflops, hbm_tbps, data: {kind:
[{skew, G, N, K, counts, us}]}}; no held-out split there, so ``--holdout-every N`` holds out every
N-th case).  Several files may be given; their cases are pooled per kind.

What it does, per kind (the model is the library's: cost_model.predict, with the constants of
tuning.EFFICIENCY[kind][config] = (eta, bw_frac, tau_sw_us, tau0_us, tau_epi_us)):
  1. fits on the non-held-out cases, the two ways benchmarks/calibrate_grouped_gemm.py does
     (config by config, Nelder-Mead on the squared log error; jointly, Powell, with the pairwise
     log-ratio term that choosing needs) and keeps the fit whose picks are better on the
     TRAINING cases (gm of pick/oracle, then min).  The loss runs on a vectorised copy of the
     model (``FastModel``, equal to cost_model.predict to rounding; tests/test_bench_gemm_zoo.py
     checks it), ~1000x faster than calling predict per case;
  2. reports on the held-out cases with the library's own code (cost_model.predict, pick,
     candidates, tie_tolerance under the new constants): prediction error |pred/meas - 1| per
     config (median, 90th percentile) and pick quality (measured time of the oracle / of the
     pick: gm, min), next to the same numbers under the constants in force before the fit;
  3. fits a model of torch._grouped_mm's own kernels (its two sm90 configs, cluster 2x1, picked
     by its average-M rule; aten/src/ATen/native/cuda/GroupMM.cu) on the measured torch times,
     and evaluates two "never lose" rules offline: STATIC (shapes only: predict ours and torch
     on the call's balanced histogram, M/G rows per group) and COUNTS (the same on the real
     counts, as a device-side choice would); each reports where it would send a call to torch's
     kernel and what that gives against the oracle of {our configs, torch}.
Writes the tuning file (default: the package's tuning module; kinds not fitted keep their
constants; the dense peak and copy bandwidth of the file are kept unless every kind is refitted)
and a JSON report (--report-out).
"""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gemm_bench_common as common  # noqa: E402

SEED_CONSTANTS = (0.9, 1.0, 0.5, 10.0, 3.0)   # for a config the tuning file does not know yet


# ------------------------------------------------------------------------------------------
# input
# ------------------------------------------------------------------------------------------

def load_records(paths, holdout_every: int = 0) -> tuple[dict, dict]:
    """{kind: [record]} and meta.  A record: id, family, ep, hist, G, N (= O), K (= I), counts,
    rows (the buffer's M), us {config: us}, torch_us, held_out."""
    data, meta = {}, {"sources": []}
    for p in paths:
        doc = json.loads(Path(p).read_text())
        meta["sources"].append(Path(p).name)
        if doc.get("schema", "").startswith("moonep-gemm-zoo/"):
            hists = {h["id"]: h for h in doc["hists"]}
            names = {k: [c["name"] for c in v] for k, v in doc["configs"].items()}
            meta.setdefault("peak_tflops", doc["meta"].get("peak_tflops"))
            meta.setdefault("hbm_tbps", doc["meta"].get("hbm_tbps"))
            meta.setdefault("sm_count", doc["meta"].get("sm_count"))
            for c in doc["cases"]:
                h = hists[c["hist"]]
                us = {n: c["us"][n] for n in names[c["kind"]] if c["us"].get(n)}
                if not us:
                    continue
                data.setdefault(c["kind"], []).append(dict(
                    id=f"{c['hist']}/{c['proj']}", family=h["family"], ep=h["ep"],
                    hist=h["hist"], G=h["G"], N=c["O"], K=c["I"], counts=list(h["counts"]),
                    rows=c.get("M", h["M"]), us=us, torch_us=c["us"].get("torch"),
                    ours_us=c["us"].get("ours"), held_out=bool(h["held_out"])))
        else:                                            # calibrate_grouped_gemm.py format
            meta.setdefault("peak_tflops", doc.get("peak_tflops"))
            meta.setdefault("hbm_tbps", doc.get("hbm_tbps"))
            for kind, cases in doc["data"].items():
                for i, c in enumerate(cases):
                    data.setdefault(kind, []).append(dict(
                        id=f"{Path(p).stem}/{kind}/{i}", family=c.get("skew"), ep=None,
                        hist=c.get("skew"), G=c["G"], N=c["N"], K=c["K"], counts=list(c["counts"]),
                        rows=c.get("rows", int(sum(c["counts"]))), us=dict(c["us"]),
                        torch_us=c.get("torch_us"), ours_us=c.get("ours_us"),
                        held_out=bool(holdout_every) and i % holdout_every == holdout_every - 1))
    return data, meta


# ------------------------------------------------------------------------------------------
# the model, vectorised over cases (same formulas as cost_model._predict_rows / _predict_wgrad)
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Geom:
    name: str
    BM: int
    BN: int
    CM: int = 1
    CN: int = 1
    swap: bool = False


def _cdiv(a, b):
    return -(-a // b)


def rows_tiles(counts: np.ndarray, n_out: int, g: Geom) -> np.ndarray:
    """fwd/dgrad tiles per group; an M-cluster (CM > 1, torch's 2x1) rounds a group's M-tile
    count up to CM (CUTLASS's group scheduler), an N-cluster the N-tile count up to CN."""
    if g.swap:
        return _cdiv(_cdiv(counts, g.BN), g.CN) * g.CN * _cdiv(n_out, g.BM)
    return _cdiv(_cdiv(counts, g.BM), g.CM) * g.CM * (_cdiv(_cdiv(n_out, g.BN), g.CN) * g.CN)


def wgrad_tiles(N: int, K: int, g: Geom) -> int:
    return (_cdiv(_cdiv(N, g.BM), g.CM) * g.CM) * (_cdiv(_cdiv(K, g.BN), g.CN) * g.CN)


class FastModel:
    """Predicted µs of one config on many cases, for a vector of constants, without Python loops
    over cases: everything that does not depend on the constants is precomputed."""

    def __init__(self, kind: str, g: Geom, cases: list[dict], P: int, peak: float, hbm: float):
        self.kind, self.g, self.n = kind, g, len(cases)
        self.P, self.peak, self.hbm = P, peak, hbm
        if kind in ("fwd", "dgrad"):
            self._init_rows(cases)
        else:
            self._init_wgrad(cases)

    def _init_rows(self, cases):
        P, g = self.P, self.g
        A, rb, sw, idx, empty = [], [], [], [], []
        for i, c in enumerate(cases):
            counts = np.asarray(c["counts"], dtype=np.int64)
            n_out, k_red = (c["N"], c["K"]) if self.kind == "fwd" else (c["K"], c["N"])
            tiles = rows_tiles(counts, n_out, g)
            T = int(tiles.sum())
            A.append(2.0 * g.BM * g.BN * k_red / (self.peak * 1e6 / P))
            empty.append(T == 0)
            if T == 0:
                continue
            bytes_g = np.where(counts > 0, n_out * k_red * 2.0 + counts * (n_out + k_red) * 2.0, 0.0)
            ends = np.cumsum(tiles)
            starts = ends - tiles
            nz = tiles > 0
            xs = np.concatenate(([0.0], ends[nz].astype(np.float64)))
            ys = np.concatenate(([0.0], np.cumsum(bytes_g[nz])))
            R = _cdiv(T, P)
            bounds = np.minimum(np.arange(R + 1, dtype=np.float64) * P, T)
            rb.append(np.diff(np.interp(bounds, xs, ys)))
            s = np.zeros(R, dtype=bool)
            s[(starts[nz] // P).astype(np.int64)] = True
            sw.append(s)
            idx.append(np.full(R, i, dtype=np.int64))
        self.A = np.asarray(A)
        self.rb = np.concatenate(rb) if rb else np.zeros(0)
        self.sw = np.concatenate(sw).astype(np.float64) if sw else np.zeros(0)
        self.idx = np.concatenate(idx) if idx else np.zeros(0, dtype=np.int64)

    def _init_wgrad(self, cases):
        P, g = self.P, self.g
        ob = 8.0 if self.kind == "wgrad" else 2.0
        C, Mm, blocks, seg, nsw = [], [], [], [], []
        self.nonempty = np.zeros(self.n, dtype=bool)
        for i, c in enumerate(cases):
            counts = np.asarray(c["counts"], dtype=np.int64)
            order = np.sort(counts[counts > 0])[::-1]
            if order.size == 0:
                nsw.append(np.zeros(P))
                continue
            self.nonempty[i] = True
            N, K = c["N"], c["K"]
            t_w = wgrad_tiles(N, K, g)
            C.append(2.0 * g.BM * g.BN * order / (self.peak * 1e6 / P))
            Mm.append((order * (N + K) * 2.0 + N * K * ob) / t_w / (self.hbm * 1e6 / P))
            s_j = np.arange(order.size, dtype=np.int64)[:, None] * t_w
            p = np.arange(P, dtype=np.int64)[None, :]
            n = (s_j + t_w - 1 - p) // P - (s_j - 1 - p) // P
            blocks.append(n.astype(np.float64))
            seg.append(order.size)
            nsw.append((n > 0).sum(axis=0).astype(np.float64))
        self.C = np.concatenate(C) if C else np.zeros(0)
        self.Mm = np.concatenate(Mm) if Mm else np.zeros(0)
        self.Nmat = np.concatenate(blocks) if blocks else np.zeros((0, P))
        self.starts = np.concatenate(([0], np.cumsum(seg)[:-1])).astype(np.int64) if seg else None
        self.nsw = np.stack([x for x, ne in zip(nsw, self.nonempty) if ne]) if seg else None

    def predict(self, consts) -> np.ndarray:
        eta, bw_frac, tau_sw, tau0, tau_epi = (float(v) for v in consts)
        out = np.full(self.n, tau0, dtype=np.float64)
        if self.kind in ("fwd", "dgrad"):
            if self.idx.size:
                tau = self.A / eta + tau_epi
                t = np.maximum(tau[self.idx] + self.sw * tau_sw, self.rb / (self.hbm * 1e6 * bw_frac))
                out += np.bincount(self.idx, weights=t, minlength=self.n)
            return out
        if self.starts is None:
            return out
        cost = np.maximum(self.C / eta + tau_epi, self.Mm / bw_frac)
        per_cta = np.add.reduceat(cost[:, None] * self.Nmat, self.starts, axis=0) + self.nsw * tau_sw
        out[self.nonempty] += per_cta.max(axis=1)
        return out


# ------------------------------------------------------------------------------------------
# fitting
# ------------------------------------------------------------------------------------------

def _unpack(z):
    # eta in (0, 1.2], bw_frac in (0, 1] (no round streams faster than the device copy), the
    # times >= 0: the bounds of calibrate_grouped_gemm.py
    return (min(1.2, math.exp(z[0])), min(1.0, math.exp(z[1])), math.exp(z[2]), math.exp(z[3]),
            math.exp(z[4]))


def _pack(c):
    return [math.log(c[0]), math.log(c[1]), math.log(max(c[2], 1e-3)), math.log(max(c[3], 1e-2)),
            math.log(max(c[4], 0.3))]


def _fit_independent(models: dict, meas: dict, seed: dict) -> dict:
    from scipy.optimize import minimize
    out = {}
    for name, fm in models.items():
        y = np.log(meas[name])

        def loss(z):
            return float(np.mean((np.log(fm.predict(_unpack(z))) - y) ** 2))

        res = minimize(loss, _pack(seed[name]), method="Nelder-Mead",
                       options=dict(maxiter=3000, xatol=1e-4, fatol=1e-9))
        out[name] = _unpack(res.x)
    return out


def _fit_joint(models: dict, meas: dict, seed: dict, w_ratio: float = 3.0) -> dict:
    from scipy.optimize import minimize
    names = list(models)
    y = np.stack([np.log(meas[n]) for n in names])             # [configs, cases]

    def loss(z):
        d = np.stack([np.log(models[n].predict(_unpack(z[5 * i:5 * i + 5]))) for i, n in
                      enumerate(names)]) - y
        err = np.mean(d ** 2, axis=0)
        diff = d[:, None, :] - d[None, :, :]
        err = err + w_ratio * np.sum(np.triu(np.ones((len(names), len(names))), 1)[:, :, None]
                                     * diff ** 2, axis=(0, 1))
        return float(np.mean(err))

    z0 = [v for n in names for v in _pack(seed[n])]
    res = minimize(loss, z0, method="Powell", options=dict(maxiter=40000, xtol=1e-4, ftol=1e-9))
    return {n: _unpack(res.x[5 * i:5 * i + 5]) for i, n in enumerate(names)}


class Library:
    """The library's model (cost_model) evaluated under a given EFFICIENCY table."""

    def __init__(self, mods, peak, hbm, P):
        self.cm, self.tuning = mods.cost_model, mods.tuning
        self.peak, self.hbm, self.P = peak, hbm, P

    def predict(self, kind, c, consts: dict, configs) -> dict:
        t = self.tuning
        saved = (t.EFFICIENCY.get(kind), t.PEAK_TFLOPS, t.HBM_TBPS)
        try:
            t.EFFICIENCY[kind] = {**(saved[0] or {}), **consts}
            t.PEAK_TFLOPS, t.HBM_TBPS = self.peak, self.hbm
            return self.cm.predict(c["counts"], c["N"], c["K"], kind, sm_count=self.P,
                                   configs=configs)
        finally:
            t.EFFICIENCY[kind] = saved[0]
            t.PEAK_TFLOPS, t.HBM_TBPS = saved[1], saved[2]

    def pick(self, kind, c, consts: dict, measured) -> str:
        """The selector's rule: candidates from the buffer shape, the fastest predicted, near-
        ties within the shape's window to the least MMA work (cost_model.pick); only among the
        measured configs."""
        cm = self.cm
        cands = [n for n in cm.candidates(kind, c["rows"], len(c["counts"])) if n in measured]
        cands = cands or list(measured)
        pred = self.predict(kind, c, consts, cands)
        vol = {n: cm.mma_volume(c["counts"], c["N"], c["K"], kind, n) for n in pred}
        return cm.pick(pred, vol, kind, cm.tie_tolerance(kind, c["rows"], len(c["counts"])))


def evaluate(lib: Library, kind: str, cases: list[dict], consts: dict) -> dict:
    """Prediction error and pick quality of ``consts`` on ``cases`` (the library's code)."""
    names = [n for n in consts if all(n in c["us"] for c in cases)]
    rel, per_cfg, ratios, vs_torch = [], {n: [] for n in names}, [], []
    picks = {}
    for c in cases:
        pred = lib.predict(kind, c, consts, names)
        for n in names:
            e = pred[n] / c["us"][n] - 1.0
            rel.append(abs(e))
            per_cfg[n].append(abs(e))
        p = lib.pick(kind, c, consts, names)
        picks[p] = picks.get(p, 0) + 1
        oracle = min(c["us"][n] for n in names)
        ratios.append(oracle / c["us"][p])
        if c.get("torch_us"):
            vs_torch.append(c["torch_us"] / c["us"][p])
    q = lambda v, p: float(np.percentile(v, p)) if v else float("nan")   # noqa: E731
    return dict(n=len(cases), rel_err_median=q(rel, 50), rel_err_p90=q(rel, 90),
                per_config={n: dict(median=q(v, 50), p90=q(v, 90)) for n, v in per_cfg.items()},
                pick_vs_oracle_gm=common.gmean(ratios),
                pick_vs_oracle_min=float(min(ratios)) if ratios else float("nan"),
                pick_vs_torch_gm=common.gmean(vs_torch),
                pick_vs_torch_min=float(min(vs_torch)) if vs_torch else float("nan"),
                pick_below_098_torch=int(sum(v < 0.98 for v in vs_torch)), picks=picks)


def _train_quality(lib, kind, cases, consts):
    e = evaluate(lib, kind, cases, consts)
    return (round(e["pick_vs_oracle_gm"], 6), round(e["pick_vs_oracle_min"], 6))


def fit_kind(mods, lib: Library, kind: str, train: list[dict], names: list[str]) -> tuple[dict, str]:
    cm = mods.cost_model
    geoms = {c.name: Geom(c.name, c.BM, c.BN, c.CM, c.CN, getattr(c, "swap", False))
             for c in cm.CONFIGS[kind]}
    models = {n: FastModel(kind, geoms[n], train, lib.P, lib.peak, lib.hbm) for n in names}
    meas = {n: np.array([c["us"][n] for c in train]) for n in names}
    cur = mods.tuning.EFFICIENCY.get(kind, {})
    seed = {n: tuple(cur.get(n, SEED_CONSTANTS)) for n in names}
    trials = {}
    for label, fn in (("independent", _fit_independent), ("joint", _fit_joint)):
        consts = fn(models, meas, seed)
        trials[label] = (_train_quality(lib, kind, train, consts), consts)
        print(f"  fit {kind} {label}: train pick/oracle gm {trials[label][0][0]:.4f} "
              f"min {trials[label][0][1]:.4f}", flush=True)
    best = max(trials, key=lambda k: trials[k][0])
    return {n: tuple(round(float(v), 4) for v in trials[best][1][n]) for n in names}, best


# ------------------------------------------------------------------------------------------
# torch._grouped_mm's kernels and the "never lose" rules
# ------------------------------------------------------------------------------------------

# aten/src/ATen/native/cuda/GroupMM.cu (sm90, bf16): cluster 2x1; "small" (M/G <= 128 or
# N <= 128, M/G from the 2-D operand's rows, N = the 3-D operand's last dim) -> ping-pong
# 64x128x128, else cooperative 128x256x64.  For wgrad (2-D x 2-D) M = O and N = I.
TORCH_GEOMS = {"torch_c128x256": Geom("torch_c128x256", 128, 256, CM=2, CN=1),
               "torch_p64x128": Geom("torch_p64x128", 64, 128, CM=2, CN=1)}


def torch_config(kind: str, c: dict) -> str:
    if kind in ("fwd", "dgrad"):
        m = c["rows"] // len(c["counts"])
        n = c["N"] if kind == "fwd" else c["K"]
    else:
        m, n = c["N"], c["K"]
    return "torch_p64x128" if (m <= 128 or n <= 128) else "torch_c128x256"


def fit_torch(kind, train, P, peak, hbm) -> dict:
    out = {}
    for name, g in TORCH_GEOMS.items():
        sub = [c for c in train if c.get("torch_us") and torch_config(kind, c) == name]
        if len(sub) < 3:
            continue
        fm = FastModel(kind, g, sub, P, peak, hbm)
        out[name] = _fit_independent({name: fm}, {name: np.array([c["torch_us"] for c in sub])},
                                     {name: SEED_CONSTANTS})[name]
        out[name] = tuple(round(float(v), 4) for v in out[name])
    return out


def one_group_case(c: dict) -> dict:
    """The other shape-only extreme: every routed row in one group (the adversarial histogram)."""
    G = len(c["counts"])
    rows = max(0, c["rows"] - 127 * (G - 1)) if c["rows"] > 127 * G else c["rows"]
    return dict(c, counts=[rows] + [0] * (G - 1))


def balanced_case(c: dict, tp: int = 128) -> dict:
    """The shape-only stand-in for a call: the buffer's rows spread evenly over the groups."""
    G = len(c["counts"])
    per = max(0, (c["rows"] - (tp - 1) * G) // G)
    per = (per + tp - 1) // tp * tp if per else 0
    return dict(c, counts=[per] * G)


def predict_torch(kind, c, consts, P, peak, hbm) -> float | None:
    name = torch_config(kind, c)
    if name not in consts:
        return None
    return float(FastModel(kind, TORCH_GEOMS[name], [c], P, peak, hbm).predict(consts[name])[0])


def never_lose(lib: Library, kind, cases, consts, torch_consts, margin: float = 0.0) -> dict:
    """Offline evaluation of sending a call to torch's kernel when the model says it is faster
    (STATIC: on the balanced histogram of the call's shape; STATIC_BOTH: only where torch wins
    on both the balanced and the one-group histogram of the shape; COUNTS: on the real counts).  The
    time of a call sent to torch is the measured torch time (a 2x1 fused kernel with torch's
    configs, or torch itself, would run the same kernel); otherwise the measured time of our pick."""
    names = list(consts)
    res = {}

    def torch_wins(probe):
        pt = predict_torch(kind, probe, torch_consts, lib.P, lib.peak, lib.hbm)
        po = min(lib.predict(kind, probe, consts, names).values())
        return pt is not None and pt < po * (1.0 - margin)

    for rule in ("static", "static_both", "counts"):
        vs_torch, vs_best, sent = [], [], 0
        for c in cases:
            if not c.get("torch_us"):
                continue
            p = lib.pick(kind, c, consts, names)
            ours = c["us"][p]
            if rule == "static":                  # shapes only: the balanced histogram
                use_torch = torch_wins(balanced_case(c))
            elif rule == "static_both":           # shapes only: balanced AND one-group agree
                use_torch = torch_wins(balanced_case(c)) and torch_wins(one_group_case(c))
            else:                                 # the real counts (a device-side choice)
                use_torch = torch_wins(c)
            t = c["torch_us"] if use_torch else ours
            sent += use_torch
            vs_torch.append(c["torch_us"] / t)
            vs_best.append(min(c["torch_us"], min(c["us"][n] for n in names)) / t)
        res[rule] = dict(sent_to_torch=sent, n=len(vs_torch), vs_torch_gm=common.gmean(vs_torch),
                         vs_torch_min=float(min(vs_torch)) if vs_torch else float("nan"),
                         below_098=int(sum(v < 0.98 for v in vs_torch)),
                         vs_best_of_both_gm=common.gmean(vs_best),
                         vs_best_of_both_min=float(min(vs_best)) if vs_best else float("nan"))
    return res


# ------------------------------------------------------------------------------------------
# writing the constants file
# ------------------------------------------------------------------------------------------

def _replace_assign(src: str, name: str, new_text: str) -> str:
    """Replace the top-level assignment ``name = ...`` (all its lines) with new_text."""
    tree = ast.parse(src)
    lines = src.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                for t in node.targets):
            a, b = node.lineno - 1, node.end_lineno
            return "".join(lines[:a]) + new_text.rstrip("\n") + "\n" + "".join(lines[b:])
    return src.rstrip("\n") + "\n\n" + new_text.rstrip("\n") + "\n"


def render_tuning(src: str, efficiency: dict, sources: dict, peak: float, hbm: float,
                  torch_model: dict | None = None) -> str:
    eff = ["EFFICIENCY = {"]
    for kind, cfgs in efficiency.items():
        eff.append(f'    "{kind}": {{')
        for n, v in cfgs.items():
            eff.append(f'        "{n}": {tuple(float(x) for x in v)!r},')
        eff.append("    },")
    eff.append("}")
    src = _replace_assign(src, "EFFICIENCY", "\n".join(eff))
    srcs = ["CALIBRATION_SOURCES = {"] + [f"    {k!r}: {v!r}," for k, v in sources.items()] + ["}"]
    src = _replace_assign(src, "CALIBRATION_SOURCES", "\n".join(srcs))
    src = _replace_assign(src, "PEAK_TFLOPS", f"PEAK_TFLOPS = {peak:.1f}")
    src = _replace_assign(src, "HBM_TBPS", f"HBM_TBPS = {hbm:.3f}")
    if torch_model:
        tm = ["# torch._grouped_mm's two sm90 kernels (cluster 2x1), same model and constant order;",
              "# fitted by benchmarks/fit_gemm_cost_model.py for the never-lose rule (not read by",
              "# the device selector).", "TORCH_EFFICIENCY = {"]
        for kind, cfgs in torch_model.items():
            tm.append(f'    "{kind}": {{' + ", ".join(f'"{n}": {tuple(v)!r}' for n, v in cfgs.items())
                      + "},")
        tm.append("}")
        src = _replace_assign(src, "TORCH_EFFICIENCY", "\n".join(tm))
    return src


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="gemm_zoo.json file(s) or calibration JSON(s)")
    ap.add_argument("--kinds", default="", help="kinds to fit (default: every kind in the data)")
    ap.add_argument("--write", default=None, help="tuning file to write (default: the package's)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--report-out", default=None, help="JSON report of the fit and the checks")
    ap.add_argument("--holdout-every", type=int, default=4,
                    help="for calibration-format input (no held_out field): hold out every N-th")
    ap.add_argument("--write-torch-model", action="store_true",
                    help="also write TORCH_EFFICIENCY (torch's kernels) into the tuning file")
    args = ap.parse_args(argv)

    mods = common.gemm_modules()
    cm, tuning = mods.cost_model, mods.tuning
    data, meta = load_records(args.json, args.holdout_every)
    kinds = [k for k in (args.kinds.split(",") if args.kinds else data) if k in data]
    if not kinds:
        raise SystemExit("no cases of the asked kinds in the input")
    full = set(kinds) >= {"fwd", "dgrad", "wgrad", "wgrad_lp"}
    peak = float(meta.get("peak_tflops") or tuning.PEAK_TFLOPS) if full else float(tuning.PEAK_TFLOPS)
    hbm = float(meta.get("hbm_tbps") or tuning.HBM_TBPS) if full else float(tuning.HBM_TBPS)
    P = int(meta.get("sm_count") or tuning.NUM_SMS)
    lib = Library(mods, peak, hbm, P)
    print(f"input {', '.join(meta['sources'])}: " + ", ".join(
        f"{k} {len(data[k])} cases ({sum(c['held_out'] for c in data[k])} held out)" for k in kinds)
        + f"; peak {peak:.1f} TF/s, copy {hbm:.3f} TB/s, {P} SMs", flush=True)

    before = {k: dict(tuning.EFFICIENCY.get(k, {})) for k in cm.KINDS}
    new_eff = {k: dict(v) for k, v in before.items()}
    report = dict(inputs=meta["sources"], peak_tflops=peak, hbm_tbps=hbm, sm_count=P, kinds={})
    torch_model = {}
    for kind in kinds:
        cases = data[kind]
        configs = [c.name for c in cm.CONFIGS[kind]]
        names = [n for n in configs if all(n in c["us"] for c in cases)]
        skipped = [n for n in configs if n not in names]
        if skipped:
            print(f"  {kind}: not measured in every case, kept as they are: {skipped}")
        train = [c for c in cases if not c["held_out"]]
        held = [c for c in cases if c["held_out"]]
        if not train or not names:
            continue
        fitted, method = fit_kind(mods, lib, kind, train, names)
        new_eff[kind].update(fitted)
        old = {n: tuple(before[kind].get(n, SEED_CONSTANTS)) for n in names}
        ev = dict(method=method, constants=fitted, train=evaluate(lib, kind, train, fitted),
                  train_before=evaluate(lib, kind, train, old))
        if held:
            ev["held_out"] = evaluate(lib, kind, held, fitted)
            ev["held_out_before"] = evaluate(lib, kind, held, old)
        tm = fit_torch(kind, train, P, peak, hbm)
        if tm:
            torch_model[kind] = tm
            ev["torch_model"] = tm
            ev["never_lose_train"] = never_lose(lib, kind, train, fitted, tm)
            if held:
                ev["never_lose_held_out"] = never_lose(lib, kind, held, fitted, tm)
        # where no compiled config reaches torch (the config gap, whatever the selector does)
        gap = sorted((min(c["us"][n] for n in names) / c["torch_us"], c["id"]) for c in cases
                     if c.get("torch_us"))
        ev["oracle_below_098_torch"] = [dict(id=i, oracle_vs_torch=round(1.0 / r, 4))
                                        for r, i in gap if 1.0 / r < 0.98]
        if ev["oracle_below_098_torch"]:
            worst = ", ".join(f"{d['id']} {d['oracle_vs_torch']:.3f}" for d in sorted(
                ev["oracle_below_098_torch"], key=lambda d: d["oracle_vs_torch"])[:5])
            print(f"  {kind:8} {len(ev['oracle_below_098_torch'])} cases where no config reaches "
                  f"0.98x torch; worst: {worst}")
        report["kinds"][kind] = ev
        for label in ("train_before", "train", "held_out_before", "held_out"):
            if label in ev:
                e = ev[label]
                print(f"  {kind:8} {label:15} n={e['n']:4}  pred err median {e['rel_err_median']:.3f}"
                      f" p90 {e['rel_err_p90']:.3f}  pick/oracle gm {e['pick_vs_oracle_gm']:.4f} "
                      f"min {e['pick_vs_oracle_min']:.3f}  pick/torch gm {e['pick_vs_torch_gm']:.3f}"
                      f" min {e['pick_vs_torch_min']:.3f}", flush=True)
        for label in ("never_lose_train", "never_lose_held_out"):
            for rule, e in ev.get(label, {}).items():
                print(f"  {kind:8} {label:19} {rule:11}: sent {e['sent_to_torch']:3}/{e['n']:3}  "
                      f"vs torch gm {e['vs_torch_gm']:.3f} min {e['vs_torch_min']:.3f} "
                      f"(< 0.98: {e['below_098']}); vs best of both gm "
                      f"{e['vs_best_of_both_gm']:.4f} min {e['vs_best_of_both_min']:.3f}")
        for n, v in fitted.items():
            pc = ev.get("held_out", ev["train"])["per_config"].get(n, {})
            print(f"  {kind}/{n:10} ({method}): eta={v[0]:.3f} bw_frac={v[1]:.3f} "
                  f"tau_sw={v[2]:.2f} tau0={v[3]:.1f} tau_epi={v[4]:.2f}  "
                  f"held-out rel err median {pc.get('median', float('nan')):.3f}")
    if args.report_out:
        Path(args.report_out).write_text(json.dumps(report, indent=1, default=float))
        print(f"wrote {args.report_out}")
    if not args.no_write:
        path = Path(args.write or tuning.__file__)
        src = path.read_text() if path.exists() else Path(tuning.__file__).read_text()
        date = datetime.date.today().isoformat()
        sources = dict(getattr(tuning, "CALIBRATION_SOURCES", {}))
        for k in kinds:
            ntr = sum(not c["held_out"] for c in data[k])
            sources[k] = (f"benchmarks/fit_gemm_cost_model.py from {'+'.join(meta['sources'])} "
                          f"({ntr} training cases, {len(data[k]) - ntr} held out), {date}")
        sources = {k: sources[k] for k in cm.KINDS if k in sources}
        path.write_text(render_tuning(src, {k: new_eff[k] for k in cm.KINDS}, sources, peak, hbm,
                                      torch_model if args.write_torch_model else None))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
