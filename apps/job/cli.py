"""``python -m apps.job``: the main job (the README's first command, ``make demo``).

Trains a small Kimi-K3-like MoE layer stack with expert parallelism on R ranks -- R gloo
processes spawned on this machine, or the ranks of a ``torchrun`` launch (NCCL on GPUs) --
and sweeps the router imbalance maxvio, comparing MoonEP (``MoonEPMoE``) with a plain
all-to-all EP baseline side by side: tokens received per rank, redundant experts, bytes moved,
step time and loss.  Writes the table and PNG plots to --out.  ``--planner-only`` runs the
planner alone over simulated ranks (no processes, instant, any size).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from .run import JobConfig, run_spawn, run_torchrun, under_torchrun


def _int(name, lo=1):
    def parse(v):
        try:
            x = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {v!r}")
        if x < lo:
            raise argparse.ArgumentTypeError(f"{name} must be >= {lo}, got {x}")
        return x
    return parse


def _float(name):
    def parse(v):
        try:
            x = float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {v!r}")
        if not x >= 0 or x == float("inf"):
            raise argparse.ArgumentTypeError(f"{name} must be a finite number >= 0, got {v}")
        return x
    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message):                  # one line, no usage dump, exit status 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parser() -> argparse.ArgumentParser:
    d = JobConfig()
    ap = _Parser(prog="python -m apps.job",
                                 description=__doc__.split("\n\n")[1].replace("\n", " "))
    ap.add_argument("--ranks", "-R", type=_int("R"), default=None,
                    help=f"EP ranks (default {d.R}; under torchrun: WORLD_SIZE)")
    ap.add_argument("--experts", "-E", type=_int("E"), default=d.E)
    ap.add_argument("--topk", "-K", type=_int("K"), default=d.K)
    ap.add_argument("--dim", "-D", type=_int("D"), default=d.D, help="model dim")
    ap.add_argument("--ffn", "-F", type=_int("F"), default=d.F, help="expert FFN dim")
    ap.add_argument("--layers", "-L", type=_int("layers"), default=d.layers)
    ap.add_argument("--tokens", "-s", type=_int("tokens"), default=d.tokens,
                    help="tokens per rank per step")
    ap.add_argument("--steps", type=_int("steps"), default=d.steps, help="SGD steps per maxvio")
    ap.add_argument("--maxvio", type=_float("maxvio"), nargs="+", default=list(d.maxvio),
                    help="router imbalances to sweep (hottest expert = (maxvio+1) x mean load)")
    ap.add_argument("--lr", type=_float("lr"), default=d.lr)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--token-padding", type=_int("token_padding"), default=d.token_padding)
    ap.add_argument("--policy", choices=("moonep", "lean", "cost"), default=d.policy)
    ap.add_argument("--slack", type=_float("slack"), default=0.05,
                    help="policy cost: the cap slack eps (default 0.05)")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default=d.backend,
                    help="process group; auto: NCCL under torchrun on GPUs, else gloo")
    ap.add_argument("--ep-backend", choices=("auto", "symm", "torch"), default=d.ep_backend,
                    help="MoonEP data plane (Buffer backend); auto: CUDA symmetric-memory "
                         "kernels when built and on GPUs, else torch.distributed")
    ap.add_argument("--no-compile", action="store_true", help="run eagerly")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--out", default=d.out, help=f"output folder (default ./{d.out})")
    ap.add_argument("--timeout", type=_float("timeout"), default=d.timeout_s,
                    help="seconds before a wedged run is killed")
    ap.add_argument("--profile", action="store_true",
                    help="after the sweep, profile one step of each model (torch.profiler) and "
                         "write the top ops by self time to OUT/profile_<model>.txt")
    ap.add_argument("--planner-only", action="store_true",
                    help="planner over simulated ranks only (no processes, no training)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    torchrun = under_torchrun()
    if torchrun:
        world = int(os.environ["WORLD_SIZE"])
        if a.ranks is not None and a.ranks != world:
            ap.error(f"--ranks {a.ranks} differs from torchrun's WORLD_SIZE={world}")
        a.ranks = world
    R = a.ranks if a.ranks is not None else JobConfig.R
    E, K = a.experts, a.topk
    if E % R:
        ap.error(f"E={E} is not divisible by R={R}")
    if K > E:
        ap.error(f"K={K} > E={E}")
    if K > 127:
        ap.error(f"K={K} > 127 is not supported")
    if not torchrun and R > 64:
        ap.error(f"R={R} > 64 processes on one machine")
    if any(v > E - 1 for v in a.maxvio):
        ap.error(f"maxvio values must be <= E-1 = {E - 1} (all tokens on one expert)")
    if a.backend == "nccl" and not torchrun:
        ap.error("--backend nccl needs torchrun (one process per GPU)")
    if a.ep_backend == "symm" and not torchrun:
        ap.error("--ep-backend symm needs GPUs under torchrun")
    if not a.planner_only:
        try:
            os.makedirs(a.out, exist_ok=True)
        except OSError as e:
            ap.error(f"cannot create the output folder {a.out!r}: {e.strerror}")
        if not os.access(a.out, os.W_OK):
            ap.error(f"the output folder {a.out!r} is not writable")
    if a.planner_only:
        from .planner_demo import planner_table
        planner_table(R, E, K, a.tokens, a.token_padding, a.maxvio, a.seed)
        return 0

    cfg = JobConfig(R=R, E=E, K=K, D=a.dim, F=a.ffn, layers=a.layers, tokens=a.tokens,
                    steps=a.steps, maxvio=tuple(a.maxvio), lr=a.lr, seed=a.seed,
                    token_padding=a.token_padding, policy=a.policy,
                    slack=a.slack if a.policy == "cost" else 0.0, backend=a.backend,
                    ep_backend=a.ep_backend,
                    compile=not a.no_compile, out=a.out, progress=not a.no_progress,
                    timeout_s=a.timeout, profile=a.profile)
    from . import report
    t0 = time.time()
    if torchrun:
        res = run_torchrun(cfg)
        if res is None:                     # ranks other than 0 report nothing
            return 0
    else:
        print(f"main job: {R} gloo ranks on this machine (spawned processes), "
              f"compile={'on' if cfg.compile else 'off'}; progress on stderr", flush=True)
        try:
            res = run_spawn(cfg)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    command = "python -m apps.job" + ("" if argv is None and len(sys.argv) <= 1 else
                                        " " + shlex.join(sys.argv[1:] if argv is None else argv))
    print(report.header(res))
    print(report.table(res))
    print(report.footer(res))
    paths = report.write(res, cfg.out, command)
    for kind, text in res.get("profile", {}).items():
        path = os.path.join(cfg.out, f"profile_{kind}.txt")
        with open(path, "w") as f:
            f.write(text)
        paths.append(path)
    print(f"wrote {', '.join(paths)} ({time.time() - t0:.0f} s)")
    return 0
