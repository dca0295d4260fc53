"""The main job's output: the sweep table (stdout, sweep.md), results.json and PNG plots."""
from __future__ import annotations

import json
import os
import platform
import subprocess
from typing import Optional

LABEL = {"baseline": "plain EP", "moonep": "MoonEP"}
COLOR = {"baseline": "#d62728", "moonep": "#1f77b4"}

HEADER = ("| maxvio | model | recv max | recv mean | max/mean | redundant | tokens MB | "
          "weights MB | wire MB | step ms | loss first → last |")


def _mb(b: float) -> str:
    return f"{b / 1e6:.2f}"


def table(res: dict) -> str:
    """The sweep as a Markdown table (also readable as plain text)."""
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for row in res["rows"]:
        first = row["model"] == "baseline"
        mv = f"{row['maxvio']:.2f}" if first else ""
        lines.append(
            f"| {mv} | {LABEL[row['model']]} | {row['recv_max']:.0f} | {row['recv_mean']:.0f} | "
            f"{row['recv_max'] / row['recv_mean']:.2f} | {row['redundant']:.1f} | "
            f"{_mb(row['token_bytes'])} | {_mb(row['weight_bytes'])} | "
            f"{'n/a' if row['wire_bytes'] is None else _mb(row['wire_bytes'])} | "
            f"{row['step_ms_median']:.1f} | {row['loss'][0]:.4f} → {row['loss'][-1]:.4f} |")
    peaks = [r for r in res["rows"] if r.get("peak_mem_mib") is not None]
    if peaks:   # accelerator runs: peak device memory of each model's steps, max over ranks
        lines.append("")
        lines.append("Peak device memory per rank (MiB, max over ranks): " + "; ".join(
            f"maxvio {r['maxvio']:.2f} {LABEL[r['model']]} {r['peak_mem_mib']:.0f}" for r in peaks))
    return "\n".join(lines)


def step0_loss_gap(res: dict) -> float:
    """max over maxvio of |loss_moonep - loss_baseline| / |loss_baseline| at step 0."""
    by = {}
    for row in res["rows"]:
        by.setdefault(row["maxvio_target"], {})[row["model"]] = row["loss"][0]
    return max(abs(d["moonep"] - d["baseline"]) / abs(d["baseline"]) for d in by.values())


def header(res: dict) -> str:
    c = res["config"]
    return (f"MoonEP vs plain all-to-all EP: R={res['R']} ranks ({res['device']}, {res['dtype']}), "
            f"E={c['E']} (epn={c['E'] // res['R']}), K={c['K']}, D={c['D']}, F={c['F']}, "
            f"{c['layers']} layers (+1 shared expert each), {c['tokens']} tokens/rank, "
            f"{c['steps']} SGD steps per maxvio, compile={'on' if c['compile'] else 'off'}, "
            f"policy={c['policy']}, MoonEP data plane {res.get('ep_backend', '?')}, "
            f"torch {res['torch']}")


def footer(res: dict) -> str:
    w = res["warmup"]
    lines = ["recv: token copies a rank's experts compute per layer (mean over steps and layers); "
             "MoonEP's target is tokens*K on every rank.",
             "On a CPU box the ranks share cores and the data plane runs on gloo, so step time "
             "measures total host work (MoonEP issues more, smaller collectives); the recv "
             "columns are what an accelerator run turns into time.",
             "redundant: experts run away from home per layer (MoonEP slots); tokens/weights MB: "
             "off-rank bytes per training step (fwd+bwd, all layers and ranks, docs/architecture.md); "
             "wire MB: every torch.distributed all-to-all/all-gather byte measured (n/a: a device "
             "backend moved the rows).",
             "step ms: median over steps of the slowest rank's step (forward, backward, grad "
             "all-reduce, SGD)."]
    for kind in ("baseline", "moonep"):
        lines.append(f"warm-up {LABEL[kind]}: {w[kind]['seconds']:.1f} s (compile), "
                     f"{w[kind]['graphs']} graph(s), {w[kind]['graph_breaks']} graph break(s)")
    sweep = {k: sum(r["recompiles"] for r in res["rows"] if r["model"] == k) for k in LABEL}
    lines.append(f"graphs compiled during the sweep (new routing every step): "
                 f"{LABEL['baseline']} {sweep['baseline']}, {LABEL['moonep']} {sweep['moonep']}")
    lines.append(f"step-0 loss, MoonEP vs plain EP (same weights, data and routing): max relative "
                 f"difference {step0_loss_gap(res):.2e}")
    return "\n".join(lines)


def machine() -> str:
    try:
        import torch
        cpu = platform.processor() or platform.machine()
        if os.path.exists("/proc/cpuinfo"):
            for ln in open("/proc/cpuinfo"):
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
        gpu = (f", {torch.cuda.device_count()}x {torch.cuda.get_device_name()}"
               if torch.cuda.is_available() else "")
        return (f"{cpu}, {os.cpu_count()} cores{gpu}, Python {platform.python_version()}, "
                f"torch {torch.__version__}")
    except Exception:                                   # noqa: BLE001 - informational only
        return platform.platform()


def git_commit() -> Optional[str]:
    """Short HEAD, with "+dirty" when tracked files differ from it (a copied work tree whose .git
    is older than its files, e.g. the GPU box's copy, then reads as "<old>+dirty", not as <old>)."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        run = lambda *a: subprocess.run(["git", *a], cwd=here, text=True, capture_output=True,
                                        timeout=5).stdout.strip()
        head = run("rev-parse", "--short", "HEAD")
        if not head:
            return None
        dirty = run("status", "--porcelain", "--untracked-files=no")
        return head + ("+dirty" if dirty else "")
    except Exception:                                   # noqa: BLE001
        return None


def plots(res: dict, out: str) -> list[str]:
    """load_per_rank.png, step_time.png, loss.png in ``out``; returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    targets = sorted({r["maxvio_target"] for r in rows})
    by = {(r["maxvio_target"], r["model"]): r for r in rows}
    R = res["R"]
    c = res["config"]
    cap = c["tokens"] * c["K"]
    paths = []

    fig, axes = plt.subplots(1, len(targets), figsize=(3.2 * len(targets) + 1, 3.6), sharey=True,
                             squeeze=False)
    for ax, v in zip(axes[0], targets):
        xs = list(range(R))
        wdt = 0.4
        for j, kind in enumerate(("baseline", "moonep")):
            r = by[(v, kind)]
            ax.bar([x + (j - 0.5) * wdt for x in xs], r["recv_per_rank"], wdt,
                   color=COLOR[kind], label=LABEL[kind])
        ax.axhline(cap, color="k", ls="--", lw=1, label="tokens·K")
        ax.set_title(f"maxvio {by[(v, 'baseline')]['maxvio']:.1f}")
        ax.set_xlabel("EP rank, heaviest first")
        ax.set_xticks(xs)
    axes[0][0].set_ylabel("token copies received per layer")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Per-rank load: plain EP vs MoonEP (R={R}, E={c['E']}, K={c['K']})")
    fig.tight_layout()
    paths.append(os.path.join(out, "load_per_rank.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for kind in ("baseline", "moonep"):
        mv = [by[(v, kind)]["maxvio"] for v in targets]
        med = [by[(v, kind)]["step_ms_median"] for v in targets]
        lo = [m - min(by[(v, kind)]["step_ms"]) for m, v in zip(med, targets)]
        hi = [max(by[(v, kind)]["step_ms"]) - m for m, v in zip(med, targets)]
        ax.errorbar(mv, med, yerr=[lo, hi], marker="o", capsize=3, color=COLOR[kind],
                    label=LABEL[kind])
    ax.set_xlabel("router imbalance maxvio")
    ax.set_ylabel("training step (ms, median; bars: min-max)")
    ax.set_title(f"Step time vs imbalance ({res['device']}, {R} ranks)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(out, "step_time.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for i, v in enumerate(targets):
        for kind, ls, mk in (("baseline", "-", "o"), ("moonep", "--", "x")):
            r = by[(v, kind)]
            ax.plot(range(len(r["loss"])), r["loss"], ls, marker=mk, color=f"C{i}",
                    label=f"{LABEL[kind]}, maxvio {r['maxvio']:.1f}")
    ax.set_xlabel("SGD step")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("loss (global MSE)")
    ax.set_title("Training loss (the two builds compute the same function)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(out, "loss.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write(res: dict, out: str, command: str) -> list[str]:
    """results.json, sweep.md and the plots; returns the files written."""
    import datetime
    os.makedirs(out, exist_ok=True)
    res = dict(res, command=command, commit=git_commit(), machine=machine(),
               date=datetime.date.today().isoformat())
    paths = [os.path.join(out, "results.json"), os.path.join(out, "sweep.md")]
    with open(paths[0], "w") as f:
        json.dump(res, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(f"- Date {res['date']}, commit {res['commit']}, {res['machine']}\n"
                f"- Command: `{command}`\n- {header(res)}\n\n{table(res)}\n\n{footer(res)}\n")
    try:
        paths += plots(res, out)
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib)")
    return paths


def main(argv=None) -> int:
    """``python -m apps.job.report moonep_out/results.json [--out DIR]``: print the table
    of a finished run again and redraw its plots."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m apps.job.report", description=main.__doc__)
    ap.add_argument("results")
    ap.add_argument("--out", default=None, help="folder for the plots (default: next to results)")
    a = ap.parse_args(argv)
    try:
        with open(a.results) as f:
            res = json.load(f)
    except (OSError, ValueError) as e:
        ap.error(f"cannot read {a.results}: {e}")
    out = a.out or os.path.dirname(os.path.abspath(a.results))
    os.makedirs(out, exist_ok=True)
    print(header(res))
    print(table(res))
    print(footer(res))
    print("wrote " + ", ".join(plots(res, out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
