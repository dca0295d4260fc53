"""Fit the grouped-GEMM cost model's constants on COMMITTED measurements; check them on held-out
shapes; fit the never-lose rule's margin; write the constants file.  CPU only (numpy + scipy),
deterministic: the same JSON files give the same constants, whatever the tuning file held before.

    python benchmarks/fit_gemm_cost_model.py benchmarks/calibration/zoo_<date>.json \
        [--write PATH | --no-write] [--report-out FIT.json] [--kinds fwd,dgrad,wgrad_lp] [--keep-margins]

Input: gemm_zoo.json files of benchmarks/bench_gemm_zoo.py (schema moonep-gemm-zoo/1: every config
forced on every case, torch._grouped_mm, ``held_out`` per histogram case: the zoo's deterministic
split by model family and EP degree), or calibration_grouped_gemm.json files of
benchmarks/calibrate_grouped_gemm.py ({peak_tflops, hbm_tbps, data: {kind: [{skew, G, N, K,
counts, us}]}}; no split there, so ``--holdout-every N`` holds out every N-th case).  Several
files pool their cases per kind; commit them under benchmarks/calibration/ and pass them
all: CALIBRATION_SOURCES names them.

Per kind (the model is the library's: cost_model.predict, with the constants of
tuning.EFFICIENCY[kind][config] = (eta, bw_frac, tau_sw_us, tau0_us, tau_epi_us)):
  1. the "moonep" configs measured on every training case: fitted the two ways (config by config,
     Nelder-Mead on the squared log error, from fixed starting points; jointly, Powell, from the
     independent fit, with the pairwise log-ratio term that choosing needs), keeping the fit
     whose picks are better on the TRAINING cases (gm of pick/oracle, then min).  The loss runs
     on a vectorised copy of the model (``FastModel``, equal to cost_model.predict to rounding;
     tests/test_bench_gemm_zoo.py checks it);
  2. every other config, on the cases that measure it: config by config.  A "torch" config
     (torch._grouped_mm's own kernel, cluster 2 x 1) that was not measured forced stands in for
     by torch._grouped_mm's measured time on the cases where torch runs that very kernel
     (cost_model.torch_config), plus our per-call overhead over torch's (the fixed-cost probe:
     forced pick minus torch on a near-empty call); its constants are then marked SEEDED.  A
     config with no measurement keeps the tuning file's constants, or its nearest config's
     (NEAREST), SEEDED as well;
  3. the never-lose margin (tuning.NEVER_LOSE_MARGIN, cost_model.family_for): on the training
     cases, the margin of MARGIN_GRID that maximises mean log(torch / ours) - W * mean
     max(0, log(0.98 torch / ours)) (W = --loss-weight, default LOSS_WEIGHT: a 1 % shortfall
     below 0.98x torch weighs as much as a W % gain elsewhere), where a call sent to the torch
     family takes that config's measured (or stand-in) time and any other call the measured time
     of the device's pick.  (Fewest cases below 0.98x alone sends most calls to torch's kernel
     while the model cannot rank the families to within a few %, at a large cost in gm.);
  4. reports on the held-out cases with the library's own code (predict, pick, candidates,
     tie_tolerance, family_for under the new constants): prediction error |pred/meas - 1| per
     config (median, 90th percentile), pick quality of the device's choice among the "moonep"
     candidates (oracle / pick: gm, min), and the never-lose rule (calls sent to the torch
     family; against torch: gm, min, cases < 0.98; against the best of every config: gm, min),
     next to the numbers under the constants in force before the fit.
Writes the constants file whole, from the fit (default: the package's moonep_ops/gemm/tuning.json;
kinds not fitted keep the constants and sources in force; the dense peak and copy bandwidth are
kept unless every kind is refitted; nothing of the file it replaces survives), and a JSON report
(--report-out).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gemm_bench_common as common  # noqa: E402
from moonep_ops.gemm import cost_model as _model  # noqa: E402  (the geometry FastModel shares)
from moonep_ops.gemm import tuning as _tuning  # noqa: E402  (the constants file's format)

ROOT = Path(__file__).resolve().parent.parent
# Fixed starting points of the config-by-config fit (the best of them is kept): the fit never
# starts from the tuning file's constants, so it is reproducible.
SEED_STARTS = ((0.9, 1.0, 0.5, 10.0, 3.0), (0.8, 0.9, 1.0, 20.0, 1.0), (0.95, 1.0, 0.05, 2.0, 6.0))
SEED_CONSTANTS = SEED_STARTS[0]   # a config that has neither measurements nor a nearest config
# A config without measurements and without constants in the tuning file takes those of the
# first of these configs that its kind has.
NEAREST = {"s256x128": ("s256x96",), "t128x256": ("c128x256",),
           "t64x128": ("p64x256", "p128x128")}
MARGIN_GRID = tuple(round(float(m), 4) for m in np.arange(-0.05, 0.1501, 0.0025))
LOSS_WEIGHT = 10.0   # the never-lose objective's weight of a shortfall below 0.98x torch
MIN_CASES = 12  # fewer measured (or stand-in) cases fit 5 constants poorly: a seed instead


def repo_path(p) -> str:
    p = Path(p).resolve()
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return p.name


# ------------------------------------------------------------------------------------------
# input
# ------------------------------------------------------------------------------------------

def load_records(paths, holdout_every: int = 0) -> tuple[dict, dict]:
    """{kind: [record]} and meta.  A record: id, family, ep, hist, G, N (= O), K (= I), counts,
    rows (the buffer's M), us {config: us} (forced configs measured), torch_us, held_out.
    meta: sources (repo-relative paths), peak_tflops, hbm_tbps, sm_count, overhead_us {kind:
    our per-call overhead over torch's, from the fixed-cost probes}."""
    data, meta = {}, {"sources": [], "overhead_us": {}}
    for p in paths:
        doc = json.loads(Path(p).read_text())
        meta["sources"].append(repo_path(p))
        if doc.get("schema", "").startswith("moonep-gemm-zoo/"):
            hists = {h["id"]: h for h in doc["hists"]}
            names = {k: [c["name"] for c in v] for k, v in doc["configs"].items()}
            meta.setdefault("peak_tflops", doc["meta"].get("peak_tflops"))
            meta.setdefault("hbm_tbps", doc["meta"].get("hbm_tbps"))
            meta.setdefault("sm_count", doc["meta"].get("sm_count"))
            for key, v in (doc.get("probes", {}).get("fixed_cost") or {}).items():
                kind = key.split("_", 1)[1]
                if v.get("forced") and v.get("torch"):
                    d = float(v["forced"]) - float(v["torch"])
                    meta["overhead_us"][kind] = min(meta["overhead_us"].get(kind, d), d)
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
# the model, vectorised over cases (cost_model's own tile geometry and rounds; only the
# constants vary during the fit)
# ------------------------------------------------------------------------------------------

class FastModel:
    """Predicted µs of one config on many cases, for a vector of constants, without Python loops
    over cases: everything that does not depend on the constants is precomputed."""

    def __init__(self, kind: str, g, cases: list[dict], P: int, peak: float, hbm: float):
        self.kind, self.g, self.n = kind, g, len(cases)
        self.P, self.peak, self.hbm = P, peak, hbm
        if kind in ("fwd", "dgrad"):
            self._init_rows(cases)
        else:
            self._init_wgrad(cases)

    def _init_rows(self, cases):
        P, g = self.P, self.g
        A, rb, sw, idx = [], [], [], []
        for i, c in enumerate(cases):
            counts = np.asarray(c["counts"], dtype=np.int64)
            n_out, k_red = (c["N"], c["K"]) if self.kind == "fwd" else (c["K"], c["N"])
            A.append(2.0 * g.BM * g.BN * k_red / (self.peak * 1e6 / P))
            round_bytes, switch = _model.row_rounds(counts, n_out, k_red, g, P)
            if round_bytes.size == 0:
                continue
            rb.append(round_bytes)
            sw.append(switch)
            idx.append(np.full(round_bytes.size, i, dtype=np.int64))
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
            t_w = _model.wgrad_tiles(N, K, g)
            C.append(2.0 * g.BM * g.BN * order / (self.peak * 1e6 / P))
            Mm.append((order * (N + K) * 2.0 + N * K * ob) / t_w / (self.hbm * 1e6 / P))
            n = _model.wgrad_split(order.size, t_w, P)
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
# fitting (deterministic: fixed starting points, deterministic optimisers)
# ------------------------------------------------------------------------------------------

def _unpack(z):
    # eta in (0, 1.2], bw_frac in (0, 1] (no round streams faster than the device copy), the
    # times >= 0 (log-parameters clipped: a simplex step far out must not overflow)
    e = [math.exp(min(30.0, max(-30.0, float(v)))) for v in z[:5]]
    return (min(1.2, e[0]), min(1.0, e[1]), e[2], e[3], e[4])


def _pack(c):
    return [math.log(c[0]), math.log(c[1]), math.log(max(c[2], 1e-3)), math.log(max(c[3], 1e-2)),
            math.log(max(c[4], 0.3))]


def _fit_one(fm: FastModel, y_us: np.ndarray) -> tuple:
    """Config by config: Nelder-Mead on the mean squared log error from each of SEED_STARTS;
    the best result."""
    from scipy.optimize import minimize
    y = np.log(y_us)

    def loss(z):
        return float(np.mean((np.log(fm.predict(_unpack(z))) - y) ** 2))

    best = None
    for start in SEED_STARTS:
        res = minimize(loss, _pack(start), method="Nelder-Mead",
                       options=dict(maxiter=3000, xatol=1e-4, fatol=1e-9))
        if best is None or res.fun < best.fun:
            best = res
    return _unpack(best.x)


def _fit_independent(models: dict, meas: dict) -> dict:
    return {name: _fit_one(fm, meas[name]) for name, fm in models.items()}


def _fit_joint(models: dict, meas: dict, start: dict, w_ratio: float = 3.0) -> dict:
    from scipy.optimize import minimize
    names = list(models)
    y = np.stack([np.log(meas[n]) for n in names])             # [configs, cases]
    upper = np.triu(np.ones((len(names), len(names))), 1)[:, :, None]

    def loss(z):
        d = np.stack([np.log(models[n].predict(_unpack(z[5 * i:5 * i + 5]))) for i, n in
                      enumerate(names)]) - y
        err = np.mean(d ** 2, axis=0)
        diff = d[:, None, :] - d[None, :, :]
        err = err + w_ratio * np.sum(upper * diff ** 2, axis=(0, 1))
        return float(np.mean(err))

    z0 = [v for n in names for v in _pack(start[n])]
    res = minimize(loss, z0, method="Powell", options=dict(maxiter=40000, xtol=1e-4, ftol=1e-9))
    return {n: _unpack(res.x[5 * i:5 * i + 5]) for i, n in enumerate(names)}


class Library:
    """The library's model (cost_model) evaluated under given constants."""

    def __init__(self, mods, peak, hbm, P):
        self.cm, self.tuning = mods.cost_model, mods.tuning
        self.peak, self.hbm, self.P = peak, hbm, P

    @contextmanager
    def using(self, kind, consts: dict, margin=None):
        t = self.tuning
        saved = (t.EFFICIENCY.get(kind), t.PEAK_TFLOPS, t.HBM_TBPS,
                 dict(getattr(t, "NEVER_LOSE_MARGIN", {})))
        try:
            t.EFFICIENCY[kind] = {**(saved[0] or {}), **consts}
            t.PEAK_TFLOPS, t.HBM_TBPS = self.peak, self.hbm
            if margin is not None:
                t.NEVER_LOSE_MARGIN = {**saved[3], kind: margin}
            yield self.cm
        finally:
            t.EFFICIENCY[kind] = saved[0]
            t.PEAK_TFLOPS, t.HBM_TBPS = saved[1], saved[2]
            t.NEVER_LOSE_MARGIN = saved[3]

    def predict(self, kind, c, consts: dict, configs) -> dict:
        with self.using(kind, consts) as cm:
            return cm.predict(c["counts"], c["N"], c["K"], kind, sm_count=self.P, configs=configs)

    def pick(self, kind, c, consts: dict, measured) -> str:
        """The device selector's rule among the "moonep" candidates of the buffer's shape (the
        fastest predicted, near-ties within the shape's window to the least MMA work;
        cost_model.pick), only among the measured configs."""
        cm = self.cm
        cands = [n for n in cm.candidates(kind, c["rows"], len(c["counts"])) if n in measured]
        cands = cands or [n for n in measured if cm.CONFIGS[kind][cm.config_index(kind, n)].family
                          == "moonep"] or list(measured)
        pred = self.predict(kind, c, consts, cands)
        vol = {n: cm.mma_volume(c["counts"], c["N"], c["K"], kind, n) for n in pred}
        return cm.pick(pred, vol, kind, cm.tie_tolerance(kind, c["rows"], len(c["counts"])))

    def never_lose_ratio(self, kind, c, consts: dict):
        with self.using(kind, consts) as cm:
            return cm.never_lose_ratio(kind, c["rows"], len(c["counts"]), c["N"], c["K"],
                                       sm_count=self.P)

    def torch_config(self, kind, c):
        return self.cm.torch_config(kind, c["rows"], len(c["counts"]), c["N"], c["K"])


def target_us(lib: Library, kind: str, c: dict, name: str, overhead: float):
    """(µs, how) of config ``name`` on case c: measured forced, or, for the torch config that
    torch._grouped_mm itself runs on this case, torch's time + our per-call overhead."""
    if name in c["us"]:
        return c["us"][name], "measured"
    cfg = lib.cm.CONFIGS[kind][lib.cm.config_index(kind, name)]
    if cfg.family == "torch" and c.get("torch_us") and lib.torch_config(kind, c) == name:
        return c["torch_us"] + overhead, "stand-in"
    return None, None


def _train_quality(lib, kind, cases, consts, names):
    ratios = []
    for c in cases:
        p = lib.pick(kind, c, consts, names)
        ratios.append(min(c["us"][n] for n in names) / c["us"][p])
    return (round(common.gmean(ratios), 6), round(float(min(ratios)), 6))


def fit_kind(mods, lib: Library, kind: str, train: list[dict], overhead: float):
    """Constants of every config of ``kind`` that the training cases measure (or stand in for);
    returns (fitted {name: consts}, how {name: text}, method of the "moonep" fit)."""
    cm = mods.cost_model
    cfgs = {c.name: c for c in cm.CONFIGS[kind]}
    full = [n for n, c in cfgs.items() if c.family == "moonep" and all(n in x["us"] for x in train)]
    fitted, how, method = {}, {}, None
    if full:
        models = {n: FastModel(kind, cfgs[n], train, lib.P, lib.peak, lib.hbm) for n in full}
        meas = {n: np.array([x["us"][n] for x in train]) for n in full}
        trials = {}
        ind = _fit_independent(models, meas)
        trials["independent"] = (_train_quality(lib, kind, train, ind, full), ind)
        joint = _fit_joint(models, meas, ind)
        trials["joint"] = (_train_quality(lib, kind, train, joint, full), joint)
        for label, (q, _) in trials.items():
            print(f"  fit {kind} {label}: train pick/oracle gm {q[0]:.4f} min {q[1]:.4f}",
                  flush=True)
        method = max(trials, key=lambda k: trials[k][0])
        for n in full:
            fitted[n] = trials[method][1][n]
            how[n] = f"measured ({method} fit)"
    for n, cfg in cfgs.items():
        if n in fitted:
            continue
        sub, ys, kinds = [], [], set()
        for x in train:
            us, k = target_us(lib, kind, x, n, overhead)
            if us:
                sub.append(x)
                ys.append(us)
                kinds.add(k)
        if len(sub) < MIN_CASES:
            continue
        fitted[n] = _fit_one(FastModel(kind, cfg, sub, lib.P, lib.peak, lib.hbm),
                             np.array(ys))
        how[n] = ("measured" if kinds == {"measured"} else
                  f"stand-in: torch._grouped_mm's measured time of this kernel on {len(sub)} "
                  f"cases + {overhead:.2f} us per-call overhead")
    return ({n: tuple(round(float(v), 4) for v in fitted[n]) for n in fitted}, how, method)


# ------------------------------------------------------------------------------------------
# evaluation: prediction error, the device's pick, the never-lose rule
# ------------------------------------------------------------------------------------------

def _q(v, p):
    return float(np.percentile(v, p)) if len(v) else float("nan")


def evaluate(lib: Library, kind: str, cases: list[dict], consts: dict, overhead: float) -> dict:
    """Prediction error and pick quality of ``consts`` on ``cases`` (the library's code)."""
    cm = lib.cm
    moon = [n for n in consts if cm.CONFIGS[kind][cm.config_index(kind, n)].family == "moonep"
            and all(n in c["us"] for c in cases)]
    rel, per_cfg, ratios, vs_torch, picks = [], {}, [], [], {}
    for c in cases:
        tgt = {n: target_us(lib, kind, c, n, overhead) for n in consts}
        have = [n for n, (us, _) in tgt.items() if us]
        pred = lib.predict(kind, c, consts, have)
        for n in have:
            e = abs(pred[n] / tgt[n][0] - 1.0)
            label = n if tgt[n][1] == "measured" else f"{n} (stand-in)"
            per_cfg.setdefault(label, []).append(e)
            if tgt[n][1] == "measured":
                rel.append(e)
        if not moon:
            continue
        p = lib.pick(kind, c, consts, moon)
        picks[p] = picks.get(p, 0) + 1
        ratios.append(min(c["us"][n] for n in moon) / c["us"][p])
        if c.get("torch_us"):
            vs_torch.append(c["torch_us"] / c["us"][p])
    return dict(n=len(cases), rel_err_median=_q(rel, 50), rel_err_p90=_q(rel, 90),
                per_config={n: dict(median=_q(v, 50), p90=_q(v, 90), n=len(v))
                            for n, v in per_cfg.items()},
                pick_vs_oracle_gm=common.gmean(ratios),
                pick_vs_oracle_min=float(min(ratios)) if ratios else float("nan"),
                pick_vs_torch_gm=common.gmean(vs_torch),
                pick_vs_torch_min=float(min(vs_torch)) if vs_torch else float("nan"),
                pick_below_098_torch=int(sum(v < 0.98 for v in vs_torch)), picks=picks)


def rule_cases(lib: Library, kind: str, cases: list[dict], consts: dict, overhead: float):
    """Per case with a torch time: (ratio of the never-lose rule, µs if our family runs, µs if
    the torch family runs, torch µs, best µs of any config or torch, id)."""
    cm = lib.cm
    moon = [n for n in consts if cm.CONFIGS[kind][cm.config_index(kind, n)].family == "moonep"
            and all(n in c["us"] for c in cases)]
    out = []
    if not moon or lib.cm.torch_config(kind, 4096, 8, 1024, 1024) is None:
        return out
    for c in cases:
        if not c.get("torch_us"):
            continue
        r = lib.never_lose_ratio(kind, c, consts)
        a = c["us"][lib.pick(kind, c, consts, moon)]
        b, _ = target_us(lib, kind, c, lib.torch_config(kind, c), overhead)
        best = min([c["torch_us"]] + [v for v in c["us"].values() if v])
        out.append((r, a, b if b else c["torch_us"] + overhead, c["torch_us"], best, c["id"]))
    return out


def rule_quality(rows, margin, weight: float = LOSS_WEIGHT) -> dict:
    """The never-lose rule with ``margin`` (None: never the torch family) on rule_cases rows;
    ``objective``: mean log(torch/ours) - weight * mean shortfall below 0.98x torch (in log)."""
    vs_torch, vs_best, sent = [], [], 0
    for r, a, b, t, best, _ in rows:
        use = margin is not None and r is not None and r <= 1.0 + margin
        sent += use
        us = b if use else a
        vs_torch.append(t / us)
        vs_best.append(best / us)
    lg = np.log(np.asarray(vs_torch)) if vs_torch else np.zeros(0)
    short = np.maximum(0.0, math.log(0.98) - lg)
    return dict(margin=margin, sent_to_torch=sent, n=len(rows), vs_torch_gm=common.gmean(vs_torch),
                vs_torch_min=float(min(vs_torch)) if vs_torch else float("nan"),
                below_098=int(sum(v < 0.98 for v in vs_torch)),
                shortfall=float(short.mean()) if len(lg) else float("nan"),
                objective=float(lg.mean() - weight * short.mean()) if len(lg) else float("nan"),
                vs_best_gm=common.gmean(vs_best),
                vs_best_min=float(min(vs_best)) if vs_best else float("nan"))


def fit_margin(rows, weight: float = LOSS_WEIGHT) -> tuple[float | None, list]:
    """The margin of MARGIN_GRID with the best objective on the training rows (rule_quality;
    ties to the smallest margin), or None (never the torch family) when that is better still."""
    if not rows:
        return None, []
    curve = [rule_quality(rows, m, weight) for m in MARGIN_GRID]
    best = max(curve, key=lambda e: (round(e["objective"], 9), -e["margin"]))
    off = rule_quality(rows, None, weight)
    if round(off["objective"], 9) > round(best["objective"], 9):
        return None, curve
    return best["margin"], curve


# ------------------------------------------------------------------------------------------
# writing the constants file
# ------------------------------------------------------------------------------------------

def render_tuning(efficiency: dict, sources: dict, peak: float, hbm: float, seeded: dict,
                  margins: dict, *, num_sms: int, tie_tol: float, tie_tol_small: float,
                  probe_tp: int, calibrated: bool = True) -> str:
    """The constants file, whole: the fit's values under the names moonep_ops.gemm.tuning loads
    them into, in its format (nothing of the file it replaces survives, so no fit's history
    accumulates in it; what the constants are is tuning.py's docstring)."""
    return _tuning.dumps({
        "CALIBRATED": bool(calibrated),
        "CALIBRATION_SOURCES": dict(sources),
        "PEAK_TFLOPS": round(float(peak), 1),
        "HBM_TBPS": round(float(hbm), 3),
        "NUM_SMS": int(num_sms),
        "SELECT_TIE_TOL": float(tie_tol),
        "SELECT_TIE_TOL_SMALL": float(tie_tol_small),
        "NEVER_LOSE_PROBE_TP": int(probe_tp),
        "NEVER_LOSE_MARGIN": {k: float(v) for k, v in margins.items()},
        "SEEDED": {k: dict(cfgs) for k, cfgs in seeded.items() if cfgs},
        "EFFICIENCY": {k: {n: tuple(float(x) for x in v) for n, v in cfgs.items()}
                       for k, cfgs in efficiency.items()},
    })


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------

def _print_eval(kind, label, e):
    print(f"  {kind:8} {label:15} n={e['n']:4}  pred err median {e['rel_err_median']:.3f}"
          f" p90 {e['rel_err_p90']:.3f}  pick/oracle gm {e['pick_vs_oracle_gm']:.4f} "
          f"min {e['pick_vs_oracle_min']:.3f}  pick/torch gm {e['pick_vs_torch_gm']:.3f}"
          f" min {e['pick_vs_torch_min']:.3f}", flush=True)


def _print_rule(kind, label, e):
    m = "off" if e["margin"] is None else f"{e['margin']:+.4f}"
    print(f"  {kind:8} {label:19} margin {m}: sent {e['sent_to_torch']:3}/{e['n']:3}  vs torch "
          f"gm {e['vs_torch_gm']:.3f} min {e['vs_torch_min']:.3f} (< 0.98: {e['below_098']}); vs "
          f"best of all gm {e['vs_best_gm']:.4f} min {e['vs_best_min']:.3f}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="gemm_zoo.json file(s) or calibration JSON(s)")
    ap.add_argument("--kinds", default="", help="kinds to fit (default: every kind in the data)")
    ap.add_argument("--write", default=None,
                    help="constants file to write (default: the package's tuning.json)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--report-out", default=None, help="JSON report of the fit and the checks")
    ap.add_argument("--holdout-every", type=int, default=4,
                    help="for calibration-format input (no held_out field): hold out every N-th")
    ap.add_argument("--keep-margins", action="store_true",
                    help="report the never-lose margin the fit finds, but write the "
                         "NEVER_LOSE_MARGIN in force (the package's tuning module) unchanged")
    ap.add_argument("--loss-weight", type=float, default=LOSS_WEIGHT,
                    help="never-lose objective: weight of a shortfall below 0.98x torch")
    args = ap.parse_args(argv)

    mods = common.gemm_modules()
    cm, tuning = mods.cost_model, mods.tuning
    data, meta = load_records(args.json, args.holdout_every)
    asked = [k for k in args.kinds.split(",") if k] if args.kinds else list(data)
    bad = set(asked) - set(cm.KINDS)
    if bad:
        raise SystemExit(f"--kinds: unknown kind(s) {sorted(bad)}")
    kinds = [k for k in cm.KINDS if k in asked and k in data]
    if not kinds:
        raise SystemExit("no cases of the asked kinds in the input")
    full = set(kinds) >= set(cm.KINDS)
    peak = float(meta.get("peak_tflops") or tuning.PEAK_TFLOPS) if full else float(tuning.PEAK_TFLOPS)
    hbm = float(meta.get("hbm_tbps") or tuning.HBM_TBPS) if full else float(tuning.HBM_TBPS)
    P = int(meta.get("sm_count") or tuning.NUM_SMS)
    lib = Library(mods, peak, hbm, P)
    print(f"input {', '.join(meta['sources'])}: " + ", ".join(
        f"{k} {len(data[k])} cases ({sum(c['held_out'] for c in data[k])} held out)" for k in kinds)
        + f"; peak {peak:.1f} TF/s, copy {hbm:.3f} TB/s, {P} SMs; per-call overhead over torch "
        + ", ".join(f"{k} {v:.2f} us" for k, v in meta["overhead_us"].items()), flush=True)

    before = {k: dict(tuning.EFFICIENCY.get(k, {})) for k in cm.KINDS}
    seeded_before = {k: dict(getattr(tuning, "SEEDED", {}).get(k, {})) for k in cm.KINDS}
    new_eff, new_seeded = {}, {}
    margins = dict(getattr(tuning, "NEVER_LOSE_MARGIN", {}))
    for k in cm.KINDS:          # the tuning file's constants, in CONFIGS order; new configs seeded
        new_eff[k], new_seeded[k] = {}, {}
        for c in cm.CONFIGS[k]:
            if c.name in before[k]:
                new_eff[k][c.name] = tuple(before[k][c.name])
                if c.name in seeded_before[k]:
                    new_seeded[k][c.name] = seeded_before[k][c.name]
            else:
                near = next((n for n in NEAREST.get(c.name, ()) if n in before[k]), None)
                new_eff[k][c.name] = tuple(before[k].get(near, SEED_CONSTANTS))
                new_seeded[k][c.name] = (f"seed: the constants of {near}" if near in before[k]
                                         else "seed: generic constants")
    report = dict(inputs=meta["sources"], peak_tflops=peak, hbm_tbps=hbm, sm_count=P,
                  overhead_us=meta["overhead_us"], kinds={})
    for kind in kinds:
        cases = data[kind]
        train = [c for c in cases if not c["held_out"]]
        held = [c for c in cases if c["held_out"]]
        if not train:
            continue
        overhead = float(meta["overhead_us"].get(kind, 0.0))
        fitted, how, method = fit_kind(mods, lib, kind, train, overhead)
        for n, v in fitted.items():
            new_eff[kind][n] = v
            if how[n].startswith("measured"):
                new_seeded[kind].pop(n, None)
            else:
                new_seeded[kind][n] = how[n]
        for n in new_eff[kind]:
            if n in fitted:
                continue
            near = next((x for x in NEAREST.get(n, ()) if x in fitted), None)
            if near:      # not measured here: the constants of its nearest config, as fitted now
                new_eff[kind][n] = fitted[near]
                new_seeded[kind][n] = f"seed: the constants of {near} (not measured)"
            else:
                new_seeded[kind][n] = "not measured in these inputs: constants kept"
        consts = dict(new_eff[kind])
        old = {n: tuple(before[kind].get(n, new_eff[kind][n])) for n in consts}
        ev = dict(method=method, constants=fitted, how=how,
                  train=evaluate(lib, kind, train, consts, overhead),
                  train_before=evaluate(lib, kind, train, old, overhead))
        if held:
            ev["held_out"] = evaluate(lib, kind, held, consts, overhead)
            ev["held_out_before"] = evaluate(lib, kind, held, old, overhead)
        # the never-lose rule: margin fitted on the training cases, checked on the held-out ones
        rows_tr = rule_cases(lib, kind, train, consts, overhead)
        if rows_tr:
            w = args.loss_weight
            m, curve = fit_margin(rows_tr, w)
            if not args.keep_margins:
                margins.pop(kind, None)
                if m is not None:
                    margins[kind] = m
            ev["never_lose"] = dict(margin=m, loss_weight=w, curve=curve,
                                    train=rule_quality(rows_tr, m, w),
                                    train_off=rule_quality(rows_tr, None, w))
            rows_ho = rule_cases(lib, kind, held, consts, overhead)
            if rows_ho:
                ev["never_lose"]["held_out"] = rule_quality(rows_ho, m, w)
                ev["never_lose"]["held_out_off"] = rule_quality(rows_ho, None, w)
                ev["never_lose"]["held_out_sent"] = [x[5] for x in rows_ho if m is not None
                                                     and x[0] is not None and x[0] <= 1.0 + m]
        names = [n for n in consts if all(n in c["us"] for c in cases)]
        gap = sorted((min([c["us"][n] for n in names] or [math.inf]) / c["torch_us"], c["id"])
                     for c in cases if c.get("torch_us"))
        ev["oracle_below_098_torch"] = [dict(id=i, oracle_vs_torch=round(1.0 / r, 4))
                                        for r, i in gap if 1.0 / r < 0.98]
        if ev["oracle_below_098_torch"]:
            worst = ", ".join(f"{d['id']} {d['oracle_vs_torch']:.3f}" for d in sorted(
                ev["oracle_below_098_torch"], key=lambda d: d["oracle_vs_torch"])[:5])
            print(f"  {kind:8} {len(ev['oracle_below_098_torch'])} cases where no measured "
                  f"config reaches 0.98x torch; worst: {worst}")
        report["kinds"][kind] = ev
        for label in ("train_before", "train", "held_out_before", "held_out"):
            if label in ev:
                _print_eval(kind, label, ev[label])
        nl = ev.get("never_lose", {})
        for label in ("train_off", "train", "held_out_off", "held_out"):
            if label in nl:
                _print_rule(kind, f"never-lose {label}", nl[label])
        for n, v in fitted.items():
            pc = ev.get("held_out", ev["train"])["per_config"]
            pc = pc.get(n) or pc.get(f"{n} (stand-in)") or {}
            print(f"  {kind}/{n:10} eta={v[0]:.3f} bw_frac={v[1]:.3f} tau_sw={v[2]:.2f} "
                  f"tau0={v[3]:.1f} tau_epi={v[4]:.2f}  held-out rel err median "
                  f"{pc.get('median', float('nan')):.3f} p90 {pc.get('p90', float('nan')):.3f}"
                  f"  [{how[n]}]")
    if args.report_out:
        Path(args.report_out).write_text(json.dumps(report, indent=1, default=float))
        print(f"wrote {args.report_out}")
    if not args.no_write:
        path = Path(args.write) if args.write else _tuning.path("tuning.json")
        sources = dict(getattr(tuning, "CALIBRATION_SOURCES", {}))
        for k in kinds:
            ntr = sum(not c["held_out"] for c in data[k])
            sources[k] = (f"benchmarks/fit_gemm_cost_model.py on {' + '.join(meta['sources'])} "
                          f"({ntr} training cases, {len(data[k]) - ntr} held out)")
        sources = {k: sources[k] for k in cm.KINDS if k in sources}
        path.write_text(render_tuning(
            new_eff, sources, peak, hbm, new_seeded,
            {k: margins[k] for k in cm.KINDS if margins.get(k) is not None},
            num_sms=tuning.NUM_SMS, tie_tol=tuning.SELECT_TIE_TOL,
            tie_tol_small=tuning.SELECT_TIE_TOL_SMALL, probe_tp=tuning.NEVER_LOSE_PROBE_TP,
            calibrated=getattr(tuning, "CALIBRATED", True)))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
