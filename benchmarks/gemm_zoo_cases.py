"""The grouped-GEMM model zoo: expert shapes of public MoE models at several EP degrees, with the
per-rank group sizes that the project's own planner (``moonep_ops.plan_all_ranks``) produces from
synthetic routings.  Used by benchmarks/bench_gemm_zoo.py (measures) and
benchmarks/fit_gemm_cost_model.py (fits and evaluates the cost model).

    python benchmarks/gemm_zoo_cases.py [--out benchmarks/data/gemm_zoo_cases.json]

regenerates the committed case file (CPU, deterministic, a few minutes: the Gumbel top-k routings
at EP 64 and the planner dominate).  The benchmark reads that file instead of planning on the GPU
machine, whose held time is device time.

Legend (moonep_ops/geometry.py): D model dim, F expert FFN dim, E routed experts, K top-k, R = EP
ranks, epn = E/R, G = 2*epn groups of one rank's receive buffer (epn home experts + epn redundant
slots), s tokens per rank, M = nvs_s rows of the receive buffer (what the Buffer allocates:
align_up(s*K + (tp-1)*G, tp)), tp = token_padding = 128.  A GEMM weight is [O, I]:
  gate_up  O = F, I = D   (gate and up projections: the same shape and the same group sizes, so
                           one measurement stands for both)
  down     O = D, I = F
Histograms (``HISTS``): balanced (maxvio 0), Zipf at maxvio 1 / 10 / 20, one hot expert, and an
adversarial one (every entry on one expert, so each rank's buffer is one group).  maxvio targets
above what top-K routing allows (max_e load / mean <= E/K) are clamped to 0.8 of the maximum;
a histogram whose clamped target repeats an earlier one is dropped.  The rank kept is the one
whose largest group is largest (the most skewed composition the planner leaves; ties: lowest).
HELD_OUT (family, EP degree) pairs, 4 of the 16, are not fitted on.

The file also carries the previous calibration set (``calib``: benchmarks/calibrate_grouped_gemm.py
``calibration_set()`` with bench_grouped_gemm.histogram, seed 123 + G; true counts, no
token_padding; 32 histograms over (O, I) shapes), so that one GPU run measures both and the fit
also sees groups that are not multiples of 128 rows.  Its shape (3072, 4096) is held out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES_PATH = Path(__file__).resolve().parent / "data" / "gemm_zoo_cases.json"
CASES_VERSION = 1
TOKEN_PADDING = 128

# name: (D, F, E, K)
FAMILIES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "kimi-k2": (7168, 2048, 384, 8),
    "mixtral-8x22b": (6144, 16384, 8, 2),
    "gpt-oss-120b": (2880, 2880, 128, 4),
}
EP_DEGREES = (8, 16, 64)
TOKENS_PER_RANK = (2048, 8192)
# name: (routing kind, maxvio target)
HISTS = {
    "balanced": ("balanced", 0.0),
    "zipf_mv1": ("zipf", 1.0),
    "zipf_mv10": ("zipf", 10.0),
    "zipf_mv20": ("zipf", 20.0),
    "hot": ("hot", 8.0),
    "adversarial": ("one_expert", None),
}
SKEWED = tuple(h for h in HISTS if h != "balanced")
# Not fitted on: a deterministic 25 % of the (family, EP) pairs (4 of 16), spread over model dims
# (D 2048 / 2880 / 7168) and group counts (G 8, 16, 96).
HELD_OUT = frozenset({("qwen3-30b-a3b", 16), ("deepseek-v3", 64), ("kimi-k2", 8),
                      ("gpt-oss-120b", 16)})
CALIB_HELD_OUT_SHAPE = (3072, 4096)


def ep_degrees(E: int) -> list[int]:
    """EP degrees of the zoo that E allows (E divisible by the degree, E/EP >= 1)."""
    return [ep for ep in EP_DEGREES if E % ep == 0 and E // ep >= 1]


def projections(family: str) -> list[tuple[str, int, int]]:
    """(name, O, I) of the distinct expert GEMM weights of a family (gate/up and down; one entry
    when both have the same shape, as for gpt-oss)."""
    D, F, _, _ = FAMILIES[family]
    out = [("gate_up", F, D)]
    if (D, F) != (F, D):
        out.append(("down", D, F))
    return out


def is_held_out(family: str, ep: int) -> bool:
    return (family, ep) in HELD_OUT


def hist_id(family: str, ep: int, s: int, hist: str) -> str:
    return f"{family}/ep{ep}/s{s}/{hist}"


def _seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode()) & 0x7FFFFFFF


def max_maxvio(E: int, K: int) -> float:
    """The largest maxvio top-K routing without repeated experts allows: every token picks the
    hot expert, which then gets E/K times the mean."""
    return E / K - 1.0


def effective_target(kind: str, target, E: int, K: int):
    if target is None or target <= 0:
        return target
    return min(float(target), 0.8 * max_maxvio(E, K))


def hist_specs(E: int, K: int) -> list[tuple[str, str, float | None]]:
    """(name, routing kind, effective maxvio target) of the zoo's histograms for (E, K), without
    repeats of an earlier (kind, target)."""
    seen, out = set(), []
    for name, (kind, target) in HISTS.items():
        t = effective_target(kind, target, E, K)
        key = (kind, None if t is None else round(t, 6))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, kind, t))
    return out


# ------------------------------------------------------------------------------------------
# routings (CPU, seeded)
# ------------------------------------------------------------------------------------------

def _gumbel_topk(logp: torch.Tensor, n: int, K: int, g: torch.Generator) -> torch.Tensor:
    """n tokens' K distinct experts drawn proportionally to exp(logp) (Gumbel top-k)."""
    u = torch.rand(n, logp.numel(), generator=g).clamp_(1e-20, 1.0)
    return torch.topk(logp[None, :] - torch.log(-torch.log(u)), K, dim=1).indices


def _maxvio_counts(cnt: torch.Tensor) -> float:
    cnt = cnt.double()
    return float(cnt.max() / cnt.mean() - 1.0) if cnt.sum() > 0 else 0.0


def _weights(kind: str, E: int, param: float, perm: torch.Tensor) -> torch.Tensor:
    if kind == "zipf":
        w = torch.empty(E, dtype=torch.float64)
        w[perm] = 1.0 / (torch.arange(E, dtype=torch.float64) + 1.0) ** param
    else:                                                        # hot: one expert at param x
        w = torch.ones(E, dtype=torch.float64)
        w[perm[0]] = param
    return w / w.sum()


_PARAM_CACHE: dict = {}


def routing_param(kind: str, E: int, K: int, target: float) -> float:
    """Zipf exponent / hot-expert weight whose routing has maxvio ~= target (bisection on a
    16k-token sample with a fixed seed; independent of R and s, so cached per (E, K, target))."""
    key = (kind, E, K, round(target, 6))
    if key in _PARAM_CACHE:
        return _PARAM_CACHE[key]
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(_seed("perm", E)))
    n = 16384

    def mv(param):
        g = torch.Generator().manual_seed(_seed("bisect", kind, E, K))
        ids = _gumbel_topk(torch.log(_weights(kind, E, param, perm)).float(), n, K, g)
        return _maxvio_counts(torch.bincount(ids.reshape(-1), minlength=E))

    if kind == "zipf":
        lo, hi = 0.0, 8.0
        for _ in range(18):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if mv(mid) < target else (lo, mid)
        p = 0.5 * (lo + hi)
    else:
        lo, hi = 0.0, math.log(1e7)
        for _ in range(18):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if mv(math.exp(mid)) < target else (lo, mid)
        p = math.exp(0.5 * (lo + hi))
    _PARAM_CACHE[key] = p
    return p


def make_topk(kind: str, R: int, E: int, s: int, K: int, param, seed: int) -> list[torch.Tensor]:
    """Every rank's [s, K] int32 expert ids."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(_seed("perm", E)))
    t = torch.arange(s)[:, None]
    k = torch.arange(K)[None, :]
    out = []
    logp = None if kind in ("balanced", "one_expert") else torch.log(
        _weights(kind, E, param, perm)).float()
    for r in range(R):
        if kind == "balanced":           # exact round robin: every expert the same load
            ids = (t * K + k + r * s * K) % E
        elif kind == "one_expert":       # every entry on expert 0 (repeats inside a token)
            ids = torch.zeros(s, K, dtype=torch.long)
        else:
            ids = _gumbel_topk(logp, s, K, g)
        out.append(ids.to(torch.int32).contiguous())
    return out


# ------------------------------------------------------------------------------------------
# planner -> one rank's groups
# ------------------------------------------------------------------------------------------

def plan_groups(topk: list[torch.Tensor], E: int) -> dict:
    """One rank's group sizes from the project's planner: the rank whose largest group is the
    largest (ties: the lowest rank)."""
    import moonep_ops
    res = moonep_ops.plan_all_ranks(topk, E, TOKEN_PADDING)
    best = None
    for p in res.plans:
        cu = p.cu_seqlens.to(torch.int64)
        counts = torch.diff(cu, prepend=cu.new_zeros(1))
        key = int(counts.max())
        if best is None or key > best[0]:
            best = (key, p, counts)
    _, p, counts = best
    return dict(rank=int(p.rank), M=int(p.nvs_s), counts=[int(c) for c in counts.tolist()],
                remote=int(p.remote_stats[0]))


def build_hist(family: str, ep: int, s: int, name: str, kind: str, target, spec=None,
               held_out=None) -> dict:
    """One histogram case; ``spec`` = (D, F, E, K) (default FAMILIES[family]), ``held_out``
    (default: the HELD_OUT rule)."""
    D, F, E, K = spec or FAMILIES[family]
    param = routing_param(kind, E, K, target) if kind in ("zipf", "hot") else None
    topk = make_topk(kind, ep, E, s, K, param, _seed(family, ep, s, name))
    cnt = torch.stack([torch.bincount(t.reshape(-1).long(), minlength=E) for t in topk]).sum(0)
    g = plan_groups(topk, E)
    G = 2 * (E // ep)
    assert len(g["counts"]) == G and sum(g["counts"]) <= g["M"]
    return dict(id=hist_id(family, ep, s, name), family=family, ep=ep, s=s, hist=name,
                routing=kind, target=target, param=param, maxvio=round(_maxvio_counts(cnt), 4),
                D=D, F=F, E=E, K=K, R=ep, epn=E // ep, G=G,
                held_out=is_held_out(family, ep) if held_out is None else bool(held_out),
                **g)


def calibration_hists() -> list[dict]:
    """The previous calibration set as histogram cases with one (O, I) shape each, generated by
    the scripts that defined it (so nothing is re-implemented here)."""
    bdir = str(Path(__file__).resolve().parent)
    if bdir not in sys.path:
        sys.path.insert(0, bdir)
    from bench_grouped_gemm import histogram           # noqa: E402  (current package layout)
    from calibrate_grouped_gemm import calibration_set  # noqa: E402
    out = []
    for skew, G, total, N, K in calibration_set():
        counts = [int(c) for c in histogram(skew, G, total or 0, seed=123 + G)]
        out.append(dict(id=f"calib/{N}x{K}/{skew}/G{G}", family="calib", ep=None, s=None,
                        hist=skew, routing="calibrate_grouped_gemm.calibration_set",
                        target=None, param=None, maxvio=None, D=None, F=None, E=None, K=None,
                        R=None, epn=G // 2, G=G, held_out=(N, K) == CALIB_HELD_OUT_SHAPE,
                        rank=None, M=int(sum(counts)), counts=counts, remote=None,
                        shapes=[["calib", N, K]]))
    return out


def zoo_specs(families=None, eps=None, tokens=None, hists=None):
    """(family, ep, s, hist name, kind, target) of every zoo histogram case, in a fixed order."""
    for fam, (D, F, E, K) in FAMILIES.items():
        if families and fam not in families:
            continue
        for ep in ep_degrees(E):
            if eps and ep not in eps:
                continue
            for s in TOKENS_PER_RANK:
                if tokens and s not in tokens:
                    continue
                for name, kind, target in hist_specs(E, K):
                    if hists and name not in hists:
                        continue
                    yield fam, ep, s, name, kind, target


def build_all(progress: bool = True, **filters) -> list[dict]:
    out = []
    t0 = time.time()
    for fam, ep, s, name, kind, target in zoo_specs(**filters):
        out.append(build_hist(fam, ep, s, name, kind, target))
        if progress:
            h = out[-1]
            print(f"[{time.time() - t0:6.1f} s] {h['id']:42} G={h['G']:3} M={h['M']:6} "
                  f"maxvio {h['maxvio']:7.2f} rank {h['rank']:2} max group {max(h['counts'])}",
                  flush=True)
    return out


def save(hists: list[dict], path: Path, calib: list[dict] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(version=CASES_VERSION, token_padding=TOKEN_PADDING, families=FAMILIES,
               ep_degrees=EP_DEGREES, tokens_per_rank=TOKENS_PER_RANK,
               hists_def={k: list(v) for k, v in HISTS.items()},
               held_out=sorted([list(x) for x in HELD_OUT]),
               generator="benchmarks/gemm_zoo_cases.py", torch=torch.__version__,
               hists=hists)
    # one histogram per line: diffable, and ~50 kB
    lines = json.dumps({k: v for k, v in doc.items() if k != "hists"}, indent=1)[:-2]
    body = ",\n".join("  " + json.dumps(h, separators=(",", ":")) for h in hists)
    cal = ",\n".join("  " + json.dumps(h, separators=(",", ":")) for h in (calib or []))
    path.write_text(lines + ',\n "hists": [\n' + body + '\n ],\n "calib": [\n' + cal
                    + "\n ]\n}\n")


def load(path: Path = CASES_PATH, calib: bool = False) -> list[dict]:
    """The zoo's histogram cases (``calib=True``: the calibration-set cases instead)."""
    doc = json.loads(Path(path).read_text())
    if doc.get("version") != CASES_VERSION:
        raise ValueError(f"{path}: case file version {doc.get('version')} != {CASES_VERSION}")
    return doc.get("calib", []) if calib else doc["hists"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(CASES_PATH))
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--calib-only", action="store_true",
                    help="keep the file's zoo cases, regenerate only the calibration set")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    hists = load(Path(args.out)) if args.calib_only else build_all()
    calib = calibration_hists()
    save(hists, Path(args.out), calib)
    print(f"wrote {len(hists)} zoo and {len(calib)} calibration histogram cases to {args.out}")


if __name__ == "__main__":
    main()
