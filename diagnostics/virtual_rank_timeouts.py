"""Virtual ranks at R = 8 on one GPU, each case as the first multi-rank work of a fresh process
(diagnostic, one H200).

Virtual ranks (moonep_ops.testing.virtual_ranks.VirtualGroup) queue every rank's ops from the host before any
rank's barrier can complete on the device.  In a fresh process, R >= 4, the other ranks' first
kernels do not start until rank 0's histogram barrier has timed out, although the host calls of
every rank are the same as in a process that ran the case at R = 1 first (which passes):
docs/multi_gpu.md keeps what each mode below showed.  Runs the all_remote data-plane round trip
and the MoE layer against its dense reference, each in a fresh process, as
  fresh     R = 8 straight away;
  premove   fresh, with every rank's inputs on the GPU before any rank's first op;
  after_r1  the same case at R = 1 first, then R = 8 (the test suite's order);
  premove_reserve      premove, the caching allocator first given freed blocks of every size;
  mallocasync_premove  premove on the stream-ordered allocator (backend:cudaMallocAsync);
  premove_matmul       premove after one bf16 cuBLAS GEMM (a large shared-memory kernel);
  premove_stream1      premove with the ranks on torch's pool streams 1..8 (after_r1's);
  premove_blas, premove_mm64, premove_fp32mm, premove_randn, premove_sleep, premove_gg
                       premove after one of: the cuBLAS handle only, a 64x64 bf16 GEMM, a
                       4096^2 fp32 GEMM, the 4096^2 bf16 inputs and their sum without a GEMM,
                       one trivial kernel, one of our grouped GEMMs;
  premove_rsmall, premove_smem{N}
                       premove after a one-block reduction; after a one-block kernel with N
                       bytes of dynamic shared memory (cupy);
  fresh_reduce         fresh after one reduction kernel (both cases);
  premove_cat1k        premove after one torch.cat of 1,000 tensors;
  premove_upto<stage>  premove with each rank's ops only up to that stage of
                       test_symm_cuda.RANK_OPS_STAGES (dispatch, combine, scaled, reuse,
                       autograd): which ops queued while rank 0's barrier spins hold it up;
  fresh_noprime, premove_noprime, fresh_noprime_device
                       without the prime that VirtualGroup runs once per device and
                       run_threads once per thread (_prime_device, prime_thread of
                       moonep_ops/testing/virtual_ranks.py);
                       noprime_device: without the device prime only.  Every other mode runs
                       with both (they were measured before the primes existed, i.e. as
                       noprime: docs/multi_gpu.md keeps those results);
  premove_loadmode, premove_lazyenv_loadmode
                       premove printing the driver's module loading mode, with
                       CUDA_MODULE_LOADING=EAGER (every mode's default) or LAZY;
  premove_philox, premove_reduce, premove_item, premove_pinned
                       premove after randn's kernel only, one reduction, one device-to-host
                       copy into pageable memory, one into pinned memory;
  premove_stack[N]     premove after setting the stack-size limit to N bytes (default: the
                       current limit, set again);
  premove_nopdl        premove with the planner's programmatic dependent launches off (needs
                       MOONEP_LIB_DIR=moonep_ops/lib/diagnostics);
  fresh_nocopyprime    fresh, the primes without their two host <-> device copies;
  fresh_oplog          fresh, each rank's ops recorded as its thread queues them: on a timeout
                       every rank's last ops and when its host queued them (layer case);
  premove_trace, after_r1_trace  premove / after_r1 (inputs on the GPU) under torch.profiler:
            the chrome trace goes to $OUT, and vrank_trace_summary.py prints the host's CUDA
            calls in each rank's queueing window and when each rank's first kernels ran;
with a 6 s barrier timeout; prints pass / timeout and the wall time of each.
    [CASES=all_remote,moe_reference] [REPEAT=n] \
        python diagnostics/virtual_rank_timeouts.py [MODE ...]
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
from moonep_ops.testing.virtual_ranks import VirtualGroup, run_threads


LOG, T0 = [], time.time()


def _logged(fn):
    # fn run under a per-thread dispatch mode that records (time, rank, op) of every op
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpLog(TorchDispatchMode):
        def __init__(self, r):
            super().__init__()
            self.r = r

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            LOG.append((time.time(), self.r, str(func).replace("aten.", "")))
            return func(*args, **(kwargs or {{}}))

    def wrapped(r):
        with OpLog(r):
            return fn(r)
    return wrapped


def run(R, premove=False):
    vg = VirtualGroup(R)
    bufs = []
    try:
        if {case!r} == "all_remote":
            c = t._setup(R, **t.CONFIGS["all_remote"])
            host = {{key: c[key] for key in ("xs", "ws", "ts")}}   # verify_rank's reference
            if premove:
                for key in host:
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
                with torch.cuda.stream(streams[r]), torch.profiler.record_function(f"rank{{r}}"):
                    outs.append(t.rank_ops(c, bufs[r], r, stop=STOP))
                faulthandler.cancel_dump_traceback_later()
                print("rank", r, "queued in %.3f s" % (time.time() - th), flush=True)
            torch.cuda.synchronize()
            c.update(host)
            for r in range(R):
                if STOP is None:
                    t.verify_rank(c, bufs[r], r, outs[r])
                else:                 # a prefix of the ops: only the error words are checked
                    bufs[r].check_errors()
        else:
            def mk(r, *a, **k):
                b = Buffer(*a, device=vg.device, backend=vg.backend(r), **k)
                bufs.append(b)
                return b
            fn, check = m.moe_reference_case(R, mk)
            if "oplog" in MODE:                 # every aten / moonep op each rank queues, timed
                fn = _logged(fn)
            # every thread's stack 4 s in (the barrier timeout is 6 s): where a rank thread
            # blocks while another rank spins
            faulthandler.dump_traceback_later(4, exit=False)
            res = run_threads(R, fn)
            faulthandler.cancel_dump_traceback_later()
            check(res)
    except BaseException:
        for r in range(R):                     # each rank's last ops queued (oplog mode)
            last = [e for e in LOG if e[1] == r][-6:]
            print("rank", r, "ops queued", sum(e[1] == r for e in LOG), "last:",
                  ", ".join(f"{{e[2]}} @{{e[0] - T0:.2f}}" for e in last), flush=True)
        torch.cuda.synchronize()
        for r, b in enumerate(bufs):
            be = b.backend
            print("rank", r, "epoch", int(be.epoch.item()), "err", be.err.tolist(),
                  "sig", be.sig.tolist(), flush=True)
        raise


MODE = {mode!r}
# "_upto<stage>": rank_ops only up to that stage (test_symm_cuda.RANK_OPS_STAGES)
STOP = MODE.rsplit("_upto", 1)[1] if "_upto" in MODE else None
if "loadmode" in MODE:            # what the driver says its module loading mode is
    import ctypes
    torch.zeros(1, device="cuda")
    lm = ctypes.c_int()
    ctypes.CDLL("libcuda.so.1").cuModuleGetLoadingMode(ctypes.byref(lm))
    print("module loading mode", {{1: "EAGER", 2: "LAZY"}}.get(lm.value, lm.value),
          "env", os.environ.get("CUDA_MODULE_LOADING"))
if "matmul" in MODE:              # a cuBLAS GEMM (large shared-memory footprint) first
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
if "blas" in MODE:                 # the cuBLAS handle only (cublasCreate, workspace), no GEMM
    torch.zeros(1, device="cuda")
    torch.cuda.current_blas_handle()
    torch.cuda.synchronize()
if "mm64" in MODE:                 # a tiny bf16 cuBLAS GEMM
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
if "fp32mm" in MODE:               # a large fp32 cuBLAS GEMM (another kernel family)
    a = torch.randn(4096, 4096, device="cuda")
    (a @ a).sum().item()
if "randn" in MODE:                # the big matmul's inputs and reduction, without the GEMM
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    a.sum().item()
if "philox" in MODE:               # randn's kernel only, completed
    torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
if "reduce" in MODE:               # one reduction kernel, completed
    torch.ones(1 << 20, device="cuda").sum()
    torch.cuda.synchronize()
if "item" in MODE:                 # one device-to-host copy into pageable memory
    torch.zeros(1, device="cuda").item()
if "pinned" in MODE:               # one device-to-host copy into pinned memory
    hp = torch.empty(1, pin_memory=True)
    hp.copy_(torch.zeros(1, device="cuda"), non_blocking=True)
    torch.cuda.synchronize()
if "rsmall" in MODE:               # one small (single-block) reduction kernel, completed
    torch.ones(1000, device="cuda").sum()
    torch.cuda.synchronize()
if "smem" in MODE:                 # one 1-block kernel with N bytes of dynamic shared memory (cupy)
    import cupy
    torch.zeros(1, device="cuda")
    nb = int(MODE.rsplit("smem", 1)[1])
    kern = cupy.RawKernel(r'extern "C" __global__ void k(int* o) {{'
                          r' extern __shared__ int sh[]; sh[threadIdx.x] = threadIdx.x;'
                          r' __syncthreads(); if (threadIdx.x == 0) o[0] = sh[31]; }}', "k")
    if nb > 48 * 1024:
        kern.max_dynamic_shared_size_bytes = nb
    o = cupy.zeros(1, dtype=cupy.int32)
    kern((1,), (32,), (o,), shared_mem=max(nb, 128))
    cupy.cuda.runtime.deviceSynchronize()
    print("smem kernel", nb, "bytes ran, out", int(o[0]))
if "cat1k" in MODE:                # torch.cat of 1,000 tensors (a large parameter block), completed
    torch.cat([torch.zeros(1, device="cuda") for _ in range(1000)])
    torch.cuda.synchronize()
if "sleep" in MODE:                # one trivial kernel, completed
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
if "gg" in MODE:                   # one of our CUTLASS sm90 grouped GEMMs (TMA, clusters)
    from moonep_ops.ops import grouped_mm as gg
    xg = torch.randn(1600, 512, device="cuda", dtype=torch.bfloat16)
    wg = torch.randn(8, 256, 512, device="cuda", dtype=torch.bfloat16)
    cg = torch.arange(1, 17, device="cuda", dtype=torch.int32) * 100
    gg.grouped_mm(xg, wg, wg.clone(), cg).sum().item()
if "stack" in MODE:               # the stack-size limit set (driver API) before the case
    import ctypes
    torch.zeros(1, device="cuda")
    cu = ctypes.CDLL("libcuda.so.1")
    cur = ctypes.c_size_t()
    cu.cuCtxGetLimit(ctypes.byref(cur), 0)          # CU_LIMIT_STACK_SIZE
    new = int(MODE.rsplit("stack", 1)[1] or cur.value)
    print("stack limit", cur.value, "->", new, "rc", cu.cuCtxSetLimit(0, ctypes.c_size_t(new)))
if "nopdl" in MODE:               # planner kernels launched without PDL (diagnostics build)
    from moonep_ops import native
    native.require_ep().plan_debug_pdl(0)
if "stream1" in MODE:             # the ranks' streams start at torch's pool stream 1, not 0
    _skip = torch.cuda.Stream()
if MODE.endswith("reserve"):      # the caching allocator holds freed blocks of every size class
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda")
            for n in [512 << 10] * 256 + [8 << 20] * 64 + [256 << 20] * 16 + [4 << 30] * 2]
    del keep
if "nocopyprime" in MODE:         # the primes without their host <-> device copies
    from moonep_ops.testing import virtual_ranks

    def _gemm_only(device):
        a = torch.ones(64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        (a @ a).float().sum().backward()
        torch.cuda.current_stream(device).synchronize()
    virtual_ranks.prime_thread = _gemm_only
if "noprime" in MODE:             # without the library's prime (VirtualGroup, run_threads)
    from moonep_ops.testing import virtual_ranks
    virtual_ranks._PRIMED.add(torch.cuda.current_device())
    if "noprime_device" not in MODE:
        virtual_ranks.prime_thread = lambda device: None
t0 = time.time()
prof = None
try:
    if MODE.startswith("after_r1"):
        run(1)
    if MODE.endswith("trace"):
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    run(8, premove="premove" in MODE or MODE.endswith("trace"))
    print("PASS %.1f s" % (time.time() - t0))
except BaseException as e:
    print("FAIL", type(e).__name__, str(e)[:600], flush=True)
    raise SystemExit(1)
finally:
    if prof is not None:
        prof.__exit__(None, None, None)
        path = os.path.join(os.environ.get("OUT", "/tmp"), f"vrank_{{MODE}}_{{os.getpid()}}.json")
        prof.export_chrome_trace(path)
        sys.path.insert(0, {here!r})
        import vrank_trace_summary
        vrank_trace_summary.summarize(path)
"""


def main():
    for case in os.environ.get("CASES", "all_remote,moe_reference").split(","):
        modes = sys.argv[1:] or ["fresh", "premove", "after_r1"]
        for mode in modes * int(os.environ.get("REPEAT", 1)):
            if not mode.startswith(("fresh", "after_r1")) and case != "all_remote":
                continue
            env = dict(os.environ, MOONEP_BARRIER_TIMEOUT_S="6", CUDA_DEVICE_MAX_CONNECTIONS="32",
                       CUDA_MODULE_LOADING="EAGER", PYTHONPATH=ROOT)
            if "lazyenv" in mode:               # the driver's default loading mode instead
                env["CUDA_MODULE_LOADING"] = "LAZY"
            if mode.startswith("mallocasync"):   # stream-ordered allocator: no cudaMalloc
                env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
            t0 = time.time()
            try:
                r = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, here=HERE, case=case,
                                                                       mode=mode)],
                                   env=env, capture_output=True, text=True, timeout=120)
                out = (r.stdout + r.stderr).strip()
                print(out[-3000:] if case == "all_remote" else out[-30000:])
                tail = out.splitlines()
                verdict = tail[-1][:200] if tail else f"exit {r.returncode}"
            except subprocess.TimeoutExpired:
                verdict = "HUNG (killed after 120 s)"
            print(f"{case:14} {mode:8} {time.time() - t0:6.1f} s  {verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
