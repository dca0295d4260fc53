"""Virtual ranks at R = 8 on one GPU, each case as the first multi-rank work of a fresh process
(diagnostic, one H200).

Virtual ranks (moonep_ops.backends.VirtualGroup) queue every rank's ops from the host before any
rank's barrier can complete on the device, so no host call made while a barrier spins may order
later device work behind the work in flight.  The first cudaFuncSetAttribute of a planner
kernel does (csrc/plan_kernels.cu moonep_plan_prepare): made at rank 0's first dispatch, it held
rank 1's first host-to-device copy (and, with inputs already on the GPU, rank 1's kernels) until
rank 0's histogram barrier timed out; a process that had run a one-rank case first was fine.
SymmBackend now sets those attributes when a Buffer is built.  Runs the all_remote data-plane
round trip and the MoE layer against its dense reference, each in a fresh process, as
  fresh     R = 8 straight away;
  premove   fresh, with every rank's inputs on the GPU before any rank's first op;
  after_r1  the same case at R = 1 first, then R = 8 (the test suite's order);
with a 6 s barrier timeout; prints pass / timeout and the wall time of each.
    [CASES=all_remote,moe_reference] python diagnostics/virtual_rank_timeouts.py [MODE ...]
"""
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import faulthandler, os, sys, time
sys.path.insert(0, os.path.join({root!r}, "tests"))
sys.path.insert(0, {root!r})
import torch
import test_symm_cuda as t
import test_moe_symm_cuda as m
from moonep_ops import Buffer
from moonep_ops.backends import VirtualGroup
from virtual_ranks import run_threads


def run(R, premove=False):
    vg = VirtualGroup(R)
    bufs = []
    try:
        if {case!r} == "all_remote":
            c = t._setup(R, **t.CONFIGS["all_remote"])
            if premove:
                for key in ("xs", "ws", "ts"):
                    c[key] = [v.cuda() for v in c[key]]
                torch.cuda.synchronize()
            bufs = [Buffer(c["S"], c["H"], c["K"], c["E"], token_padding=c["tp"],
                           dtype=c["dtype"], device=vg.device, backend=vg.backend(r))
                    for r in range(R)]
            streams = [torch.cuda.Stream() for _ in range(R)]
            outs = []
            for r in range(R):
                th = time.time()
                faulthandler.dump_traceback_later(3, exit=False)   # where the host blocks
                with torch.cuda.stream(streams[r]):
                    outs.append(t.rank_ops(c, bufs[r], r))
                faulthandler.cancel_dump_traceback_later()
                print("rank", r, "queued in %.3f s" % (time.time() - th), flush=True)
            torch.cuda.synchronize()
            for r in range(R):
                t.verify_rank(c, bufs[r], r, outs[r])
        else:
            def mk(r, *a, **k):
                b = Buffer(*a, device=vg.device, backend=vg.backend(r), **k)
                bufs.append(b)
                return b
            fn, check = m.moe_reference_case(R, mk)
            check(run_threads(R, fn))
    except BaseException:
        torch.cuda.synchronize()
        for r, b in enumerate(bufs):
            be = b.backend
            print("rank", r, "epoch", int(be.epoch.item()), "err", be.err.tolist(),
                  "sig", be.sig.tolist(), flush=True)
        raise


t0 = time.time()
try:
    if {mode!r} == "after_r1":
        run(1)
    run(8, premove={mode!r} == "premove")
    print("PASS %.1f s" % (time.time() - t0))
except BaseException as e:
    print("FAIL", type(e).__name__, str(e)[:600], flush=True)
    raise SystemExit(1)
"""


def main():
    for case in os.environ.get("CASES", "all_remote,moe_reference").split(","):
        for mode in sys.argv[1:] or ("fresh", "premove", "after_r1"):
            if mode == "premove" and case != "all_remote":
                continue
            env = dict(os.environ, MOONEP_BARRIER_TIMEOUT_S="6", CUDA_DEVICE_MAX_CONNECTIONS="32",
                       CUDA_MODULE_LOADING="EAGER", PYTHONPATH=ROOT)
            t0 = time.time()
            try:
                r = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, case=case,
                                                                       mode=mode)],
                                   env=env, capture_output=True, text=True, timeout=120)
                out = (r.stdout + r.stderr).strip()
                print(out[-3000:])
                tail = out.splitlines()
                verdict = tail[-1][:200] if tail else f"exit {r.returncode}"
            except subprocess.TimeoutExpired:
                verdict = "HUNG (killed after 120 s)"
            print(f"{case:14} {mode:8} {time.time() - t0:6.1f} s  {verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
