"""Why virtual ranks at R = 8 on one GPU can time out at a barrier (diagnostic, one H200).

Virtual ranks (moonep_ops.backends.VirtualGroup) queue every rank's ops from the host before any
rank's barrier can complete on the device.  Hypothesis: a host call that implicitly
synchronises the device while peers are still unqueued stalls the queued barrier work: the CUDA
programming guide lists "a device memory allocation" among the operations that stop commands of
different streams from running concurrently, and a cold caching allocator calls cudaMalloc.

Runs the two R = 8 cases that timed out (the all_remote data-plane round trip, and the MoE
layer against its dense reference) each in a fresh process, under
  default      the native caching allocator, cold;
  warm         the native allocator after reserving and freeing memory first (no cudaMalloc later);
  async        PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync (stream-ordered, no implicit sync);
with a 15 s barrier timeout, and prints pass / timeout and the wall time of each.
    python diagnostics/virtual_rank_timeouts.py
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
if {warm}:
    torch.empty(int(6e9), dtype=torch.uint8, device="cuda"); torch.cuda.synchronize()
    blocks = [torch.empty(2**20 - 512, dtype=torch.uint8, device="cuda") for _ in range(512)]
    small = [torch.empty(4096, dtype=torch.uint8, device="cuda") for _ in range(4096)]
    del blocks, small
import test_symm_cuda as t
import test_moe_symm_cuda as m
from moonep_ops import Buffer
from moonep_ops.backends import VirtualGroup
from virtual_ranks import run_threads
R = 8
t0 = time.time()
vg = VirtualGroup(R)
bufs = []
def report():
    torch.cuda.synchronize()
    for r, b in enumerate(bufs):
        be = b.backend
        print("rank", r, "epoch", int(be.epoch.item()), "err", be.err.tolist(),
              "sig", be.sig.tolist(), flush=True)
try:
    if {case!r} == "all_remote":
        c = t._setup(R, **t.CONFIGS["all_remote"])
        if {premove}:               # every rank's inputs on the GPU before any rank's first op
            for key in ("xs", "ws", "ts"):
                c[key] = [v.cuda() for v in c[key]]
            torch.cuda.synchronize()
        bufs = [Buffer(c["S"], c["H"], c["K"], c["E"], token_padding=c["tp"], dtype=c["dtype"],
                       device=vg.device, backend=vg.backend(r)) for r in range(R)]
        streams = [torch.cuda.Stream() for _ in range(R)]
        outs = []
        for r in range(R):
            th = time.time()
            # where the host blocks, if it does: every thread's stack after 3 s
            faulthandler.dump_traceback_later(3, exit=False)
            with torch.cuda.stream(streams[r]):
                outs.append(t.rank_ops(c, bufs[r], r))
            faulthandler.cancel_dump_traceback_later()
            print("rank", r, "queued in %.3f s" % (time.time() - th), flush=True)
        report()
        for r in range(R):
            t.verify_rank(c, bufs[r], r, outs[r])
    else:
        faulthandler.dump_traceback_later(4, exit=False)
        def mk(r, *a, **k):
            b = Buffer(*a, device=vg.device, backend=vg.backend(r), **k)
            bufs.append(b)
            return b
        fn, check = m.moe_reference_case(R, mk)
        res = run_threads(R, fn)
        check(res)
    print("PASS %.1f s" % (time.time() - t0))
except BaseException as e:
    print("FAIL", type(e).__name__, str(e)[:600], flush=True)
    report()
    raise SystemExit(1)
"""


def main():
    results = []
    for case in ("all_remote", "moe_reference"):
        for mode in sys.argv[1:] or ("default",):
            if mode == "premove" and case != "all_remote":
                continue
            env = dict(os.environ, MOONEP_BARRIER_TIMEOUT_S="6", CUDA_DEVICE_MAX_CONNECTIONS="32",
                       CUDA_MODULE_LOADING="EAGER", PYTHONPATH=ROOT)
            if mode == "async":
                env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
            code = CHILD.format(root=ROOT, warm=mode == "warm", case=case,
                                premove=mode == "premove")
            t0 = time.time()
            try:
                r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                   text=True, timeout=120)
                out = (r.stdout + r.stderr).strip()
                print(out[-6000:])
                tail = out.splitlines()
                verdict = tail[-1][:200] if tail else f"exit {r.returncode}"
            except subprocess.TimeoutExpired:
                verdict = "HUNG (killed after 120 s)"
            results.append((case, mode, verdict, time.time() - t0))
            print(f"{case:14} {mode:8} {time.time() - t0:6.1f} s  {verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
