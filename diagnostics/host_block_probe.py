"""Which host calls wait for a kernel that is still running on another stream (diagnostic, one GPU).

Virtual ranks share one CUDA context, and rank 0's barrier kernel spins until the other ranks'
kernels arrive; a host call that waits for the whole device while rank 0 is still queuing them
cannot return before that barrier times out.  Each probe runs in a fresh process: CUDA is
initialised, what the probe needs first is done and synchronised, then a ~1 s spinning kernel
(torch.cuda._sleep) is queued on a side stream and the probe's host call is timed on the default
stream (both streams from torch's pool, non-blocking).  A host time near the spinner's length means the call waited for the device; a device
time near it (with a short host time) means the call's own kernels were held behind the spinner.

    python diagnostics/host_block_probe.py [probe ...]      (default: all)
"""
import os, subprocess, sys

# set-up fragments: the stack limit raised (driver API, torch's context); the primary context's
# CU_CTX_LMEM_RESIZE_TO_MAX flag (set before torch creates the context: "pre"); one launch over
# every SM of a kernel with an N-byte local array per thread (cupy)
STACK = ("import ctypes; assert ctypes.CDLL('libcuda.so.1').cuCtxSetLimit(0, ctypes.c_size_t(%d)) "
         "== 0")
KEEP_MAX = ("import ctypes; _cu = ctypes.CDLL('libcuda.so.1'); assert _cu.cuInit(0) == 0; "
            "assert _cu.cuDevicePrimaryCtxSetFlags(0, 0x10) == 0")
LMEM_SRC = ('extern "C" __global__ void k(int *o, int i) { volatile int a[N]; '
            'for (int j = 0; j < N; ++j) a[j] = j * i; o[threadIdx.x] = a[(i * threadIdx.x) % N]; }')
LMEM = ("import cupy; _k = cupy.RawKernel(%r, 'k'); _o = cupy.zeros(1024, dtype=cupy.int32); "
        "_k((1056,), (1024,), (_o, cupy.int32(3))); cupy.cuda.Device().synchronize()")


def lmem(nbytes):
    return LMEM % LMEM_SRC.replace("N", str(nbytes // 4))


PROBES = {   # name: (set-up, probed call[, pre]); all run in the fresh process, set-up synchronised
    "arange":        ("", "torch.arange(1000, device='cuda')"),
    "arange_after_sum": ("torch.ones(1000, device='cuda').sum().item()",
                      "torch.arange(1000, device='cuda')"),
    "arange_after_arange": ("torch.arange(10, device='cuda')", "torch.arange(1000, device='cuda')"),
    "remainder_i64": ("x = torch.arange(1000, device='cuda')", "x % 5"),
    "add_i64":       ("x = torch.arange(1000, device='cuda')", "x + 1"),
    "to_float":      ("x = torch.arange(1000, device='cuda')", "x.float()"),
    "fill":          ("", "torch.full((1000,), 2.0, device='cuda')"),
    "sum":           ("x = torch.ones(1000, device='cuda')", "x.sum()"),
    "sum_after_sum": ("x = torch.ones(1000, device='cuda'); x.sum().item()", "x.sum()"),
    "new_small_segment": ("x = torch.ones(1000, device='cuda')",
                      "[torch.empty(1 << 19, dtype=torch.uint8, device='cuda') for _ in range(8)]"),
    "new_large_segment": ("x = torch.ones(1000, device='cuda')",
                      "torch.empty(64 << 20, dtype=torch.uint8, device='cuda')"),
    "cached_large":  ("torch.empty(64 << 20, dtype=torch.uint8, device='cuda')",
                      "torch.empty(64 << 20, dtype=torch.uint8, device='cuda')"),
    "matmul":        ("a = torch.randn(256, 256, device='cuda', dtype=torch.bfloat16)", "a @ a"),
    "mul_bcast":     ("a = torch.ones(1000, 64, device='cuda'); b = torch.ones(1000, device='cuda')",
                      "a * b[:, None]"),
    "cat":           ("a = torch.ones(1000, 64, device='cuda')", "torch.cat([a, a])"),
    # what primes the first cast / reduction: each other, more stack, the keep-max flag, a
    # kernel with a large local array
    "to_float_after_sum": ("x = torch.arange(1000, device='cuda'); "
                           "torch.ones(10, device='cuda').sum().item()", "x.float()"),
    "sum_after_to_float": ("x = torch.arange(1000, device='cuda'); y = x.float()", "y.sum()"),
    "sum_after_stack16k": ("x = torch.ones(1000, device='cuda'); " + STACK % 16384, "x.sum()"),
    "sum_keep_max":       ("x = torch.ones(1000, device='cuda')", "x.sum()", KEEP_MAX),
    "sum_after_lmem4k":   ("x = torch.ones(1000, device='cuda'); " + lmem(4096), "x.sum()"),
    "sum_after_lmem4k_keep_max": ("x = torch.ones(1000, device='cuda'); " + lmem(4096), "x.sum()",
                                  KEEP_MAX),
    "sum_after_lmem512_keep_max": ("x = torch.ones(1000, device='cuda'); " + lmem(512), "x.sum()",
                                   KEEP_MAX),
}

CHILD = """
import time, torch
{pre}
torch.zeros(1, device='cuda'); torch.cuda._sleep(1000); torch.cuda.synchronize()
{setup}
torch.cuda.synchronize()
side, mine = torch.cuda.Stream(), torch.cuda.Stream()
done = torch.cuda.Event()
with torch.cuda.stream(side):
    torch.cuda._sleep(int(2e9))      # about 1 s at the H200's clock
t = time.perf_counter()
with torch.cuda.stream(mine):
    {call}
    done.record()
host = time.perf_counter() - t
while not done.query():              # when the probed call's own work finished on the device
    pass
dev = time.perf_counter() - t
print("RESULT %.3f %.3f" % (host, dev))
"""


def main(names):
    env = dict(os.environ)
    print(f"{'probe':22s} {'host s':>7s} {'done on device s':>16s}   (CUDA_MODULE_LOADING="
          f"{env.get('CUDA_MODULE_LOADING', 'unset')})")
    for n in names:
        setup, call, pre = (PROBES[n] + ("",))[:3]
        r = subprocess.run([sys.executable, "-c", CHILD.format(setup=setup, call=call, pre=pre)],
                           capture_output=True, text=True, timeout=60, env=env)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")]
        if not line:
            print(f"{n:22s} error: {(r.stdout + r.stderr).strip()[-300:]}")
            continue
        host, dev = map(float, line[0].split()[1:])
        print(f"{n:22s} {host:7.3f} {dev:16.3f}   {'HOST WAITED' if host > 0.3 else 'HELD ON DEVICE' if dev > 0.3 else ''}")


if __name__ == "__main__":
    main(sys.argv[1:] or list(PROBES))
