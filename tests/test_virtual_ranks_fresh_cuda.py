"""Virtual ranks at R = 8 as the first multi-rank work of a fresh process (docs/multi_gpu.md,
"One GPU, virtual ranks"): the rest of the CUDA suite runs R = 1 first, which would hide a
first-time step of the CUDA stack that waits for the device while rank 0's barrier spins (the
primes of moonep_ops.testing.virtual_ranks.VirtualGroup and run_threads exist for it).  Each case runs in
its own interpreter with a 6 s barrier timeout and must complete and verify; without the primes
every case timed out on the H200 (6 of 6 runs); the layer case, whose rank threads run the first
grouped GEMM while other ranks already spin, also needs the GEMM library loaded before any rank
starts (virtual_ranks._prime_libraries).  Skipped without a GPU or libmoonep_ep.so.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moonep_ops import native

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or native.ep() is None,
                                reason="needs a CUDA device and libmoonep_ep.so")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import sys, torch
sys.path.insert(0, {here!r})
import test_symm_cuda as t
import test_moe_symm_cuda as m
from moonep_ops import Buffer
from moonep_ops.testing.virtual_ranks import VirtualGroup, run_threads
R, case, premove = {R}, {case!r}, {premove}
vg = VirtualGroup(R)
if case == "all_remote":
    c = t._setup(R, **t.CONFIGS["all_remote"])
    host = {{k: c[k] for k in ("xs", "ws", "ts")}}
    if premove:                                 # every rank's inputs on the GPU before any op
        for k in host:
            c[k] = [v.cuda() for v in c[k]]
        torch.cuda.synchronize()
    bufs = [Buffer(c["S"], c["H"], c["K"], c["E"], token_padding=c["tp"], dtype=c["dtype"],
                   device=vg.device, backend=vg.backend(r)) for r in range(R)]
    streams = [torch.cuda.Stream() for _ in range(R)]
    outs = []
    for r in range(R):                          # all queued from this thread, none waited for
        with torch.cuda.stream(streams[r]):
            outs.append(t.rank_ops(c, bufs[r], r))
    torch.cuda.synchronize()
    c.update(host)
    for r in range(R):
        t.verify_rank(c, bufs[r], r, outs[r])
else:
    def mk(r, *a, **k):
        return Buffer(*a, device=vg.device, backend=vg.backend(r), **k)
    fn, check = m.moe_reference_case(R, mk)
    check(run_threads(R, fn))
print("OK")
"""


def _run_child(src: str, **env) -> tuple[str, int]:
    """Run src in a fresh interpreter with env added and this checkout first on PYTHONPATH:
    (its stdout + stderr, its exit status)."""
    path = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    r = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, **env, PYTHONPATH=os.pathsep.join(path)))
    return (r.stdout + r.stderr).strip(), r.returncode


@pytest.mark.parametrize("R", [8])
@pytest.mark.parametrize("case,premove", [("all_remote", False), ("all_remote", True),
                                          ("moe_reference", False)])
def test_first_multi_rank_work_of_a_process(R, case, premove):
    out, rc = _run_child(CHILD.format(here=HERE, R=R, case=case, premove=premove),
                         MOONEP_BARRIER_TIMEOUT_S="6", CUDA_DEVICE_MAX_CONNECTIONS="32",
                         CUDA_MODULE_LOADING="EAGER")
    assert rc == 0 and out.endswith("OK"), out[-2000:]


def test_virtual_ranks_refuse_lazy_module_loading():
    """With lazy loading any kernel's first launch may wait for a spinning peer: VirtualGroup
    says so at construction instead of timing out later."""
    src = ("from moonep_ops.testing.virtual_ranks import VirtualGroup\n"
           "VirtualGroup(1)\n"                       # R = 1 has no peer to wait for
           "try:\n    VirtualGroup(2)\nexcept RuntimeError as e:\n    print('REFUSED', e)\n")
    out, rc = _run_child(src, CUDA_MODULE_LOADING="LAZY")
    assert rc == 0 and "REFUSED" in out and "CUDA_MODULE_LOADING=EAGER" in out, out
