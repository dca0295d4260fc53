"""Time the plain SwiGLU kernel variants of diagnostics/swiglu_probe.cu side by side (H100/H200).

    python diagnostics/swiglu_probe.py [--so diagnostics/swiglu_probe.so] [--lib LIB]

Variant 0 is a copy of the library's kernel before 16-byte packs (one 2-byte aligned pack per
thread, at most 8 blocks per SM); the library's kernel now has variant 11's shape (csrc/swiglu.cu).
``--lib`` (default moonep_ops/lib/libmoonep_ep.so) adds the built library's own exports as
variant -1; every variant is checked bitwise (or in bf16 ulps) against variant 0.
"""
import argparse
import ctypes
import statistics

import torch

SHAPES = [(49024, 768), (32768, 2048), (36864, 2880), (16384, 1024), (4096, 512)]
NAMES = {0: "old library", 1: "restrict U1", 2: "restrict U2", 3: "restrict U4", 4: "restrict U1 capped",
         5: "U2 fast sigmoid", 6: "U1 fast sigmoid", 7: "U4 lb2", 8: "U8", 9: "U4 lb2 capped 2/SM",
         10: "U2 lb3", 11: "aligned U1", 12: "aligned U2 4/SM", 13: "aligned U4 2/SM",
         14: "aligned U2", 15: "aligned U1 8/SM"}


def gpu_us(fn) -> float:
    """GPU microseconds of one call of ``fn`` (CUDA events around it on the current stream)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--so", default="diagnostics/swiglu_probe.so")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--lib", default="moonep_ops/lib/libmoonep_ep.so")
    a = ap.parse_args()
    lib = ctypes.CDLL(a.so)
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.probe_bwd.argtypes = [I, P, P, P, P, P, P, I64, I, P]
    lib.probe_fwd.argtypes = [I, P, P, P, I64, I, P]
    ep = ctypes.CDLL(a.lib) if a.lib else None
    if ep is not None:
        ep.moonep_ep_swiglu_bwd.argtypes = [P, P, P, P, P, P, I64, I, P]
        ep.moonep_ep_swiglu_fwd.argtypes = [P, P, P, I64, I, P]
        NAMES[-1] = "library export"
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(torch.cuda.get_device_name(dev), "SMs", sms)
    for M, F in SHAPES:
        g, u, da = (torch.randn(M, F, device=dev).mul(3).bfloat16() for _ in range(3))
        n = M * F

        def run(kind, v, o):
            st = torch.cuda.current_stream().cuda_stream
            if v == -1:
                rc = (ep.moonep_ep_swiglu_bwd(g.data_ptr(), u.data_ptr(), da.data_ptr(),
                                              o[0].data_ptr(), o[1].data_ptr(), o[2].data_ptr(),
                                              n, sms, st) if kind == "bwd" else
                      ep.moonep_ep_swiglu_fwd(g.data_ptr(), u.data_ptr(), o[0].data_ptr(), n, sms,
                                              st))
            elif kind == "bwd":
                rc = lib.probe_bwd(v, g.data_ptr(), u.data_ptr(), da.data_ptr(), o[0].data_ptr(),
                                   o[1].data_ptr(), o[2].data_ptr(), n, sms, st)
            else:
                rc = lib.probe_fwd(v, g.data_ptr(), u.data_ptr(), o[0].data_ptr(), n, sms, st)
            assert rc == 0, rc

        for kind, nout, nbytes in (("fwd", 1, 6 * n), ("bwd", 3, 12 * n)):
            times = {v: [] for v in NAMES}
            res = {}
            for v in NAMES:
                o = [torch.empty_like(g) for _ in range(nout)]
                run(kind, v, o)
                res[v] = o
            for r in range(a.reps):
                for v in (NAMES if r % 2 == 0 else list(NAMES)[::-1]):
                    times[v].append(gpu_us(lambda: run(kind, v, res[v])))
            for v in NAMES:
                t = statistics.median(times[v])
                same = all(torch.equal(x, y) for x, y in zip(res[v], res[0]))
                ulp = max(float(((x.view(torch.int16).int() - y.view(torch.int16).int()).abs()).max())
                          for x, y in zip(res[v], res[0]))
                print(f"[{M}, {F}] {kind} {NAMES[v]:20s} {t:8.1f} us {nbytes / t / 1e3:7.0f} GB/s "
                      f"{'bitwise' if same else f'max ulp {ulp:.0f}'}", flush=True)
        # achievable bandwidth: torch's add (2 reads, 1 write) and copy
        c = torch.empty_like(g)
        for nm, fn, nb in (("add", lambda: torch.add(g, u, out=c), 6 * n), ("copy", lambda: c.copy_(g), 4 * n)):
            fn()
            t = statistics.median(gpu_us(fn) for _ in range(10))
            print(f"[{M}, {F}] torch {nm:16s}     {t:8.1f} us {nb / t / 1e3:7.0f} GB/s", flush=True)
        # torch's own ops for scale
        for kind in ("fwd", "bwd"):
            def tf():
                gf, uf = g.float(), u.float()
                sig = torch.sigmoid(gf)
                if kind == "fwd":
                    return (gf * sig * uf).bfloat16()
                d = da.float()
                return ((d * uf * sig * (1 + gf * (1 - sig))).bfloat16(), (d * gf * sig).bfloat16(),
                        (gf * sig * uf).bfloat16())
            tf()
            t = statistics.median(gpu_us(tf) for _ in range(5))
            print(f"[{M}, {F}] {kind} torch eager           {t:8.1f} us", flush=True)


if __name__ == "__main__":
    main()
