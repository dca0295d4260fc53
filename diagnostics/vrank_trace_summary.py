"""Summary of a torch.profiler chrome trace of virtual ranks being queued (virtual_rank_timeouts.py
*_trace modes): per rank's queueing window (record_function "rank<r>"), the CUDA runtime/driver
calls other than kernel launches, with their durations; and per GPU stream, when its first kernels
started and how long they ran (a barrier that spins until its timeout shows as a seconds-long
kernel).  Times in ms from the start of rank 0's window.
    python diagnostics/vrank_trace_summary.py TRACE.json
"""
import collections
import json
import sys

LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def summarize(path, max_calls=60):
    ev = json.load(open(path))["traceEvents"]
    ev = [e for e in ev if e.get("ph") == "X"]
    ranks = sorted((e for e in ev if str(e.get("name", "")).startswith("rank")
                    and e.get("cat") in ("user_annotation", "cpu_op")), key=lambda e: e["ts"])
    if not ranks:
        print("trace: no rank windows")
        return
    t0 = ranks[0]["ts"]
    api = sorted((e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")),
                 key=lambda e: e["ts"])
    for w in ranks:
        lo, hi = w["ts"], w["ts"] + w["dur"]
        calls = [e for e in api if lo <= e["ts"] <= hi]
        n_launch = sum(1 for e in calls if e["name"].startswith(LAUNCH))
        other = [e for e in calls if not e["name"].startswith(LAUNCH)]
        counts = collections.Counter(e["name"] for e in other)
        print(f"{w['name']}: window {(lo - t0) / 1e3:.3f}+{w['dur'] / 1e3:.3f} ms, "
              f"{n_launch} launches; other calls: {dict(counts)}")
        for e in other[:max_calls]:
            if e["dur"] > 20 or e["name"] not in ("cudaStreamIsCapturing", "cudaGetDevice",
                                                  "cudaPeekAtLastError", "cudaGetLastError",
                                                  "cudaStreamGetCaptureInfo"):
                print(f"    {(e['ts'] - t0) / 1e3:9.3f} ms  {e['dur'] / 1e3:8.3f} ms  {e['name']}")
    gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    by_stream = collections.defaultdict(list)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream", "?")].append(e)
    for s, es in sorted(by_stream.items(), key=lambda kv: kv[1][0]["ts"]):
        first = es[0]
        longest = max(es, key=lambda e: e["dur"])
        print(f"stream {s}: {len(es)} ops, first at {(first['ts'] - t0) / 1e3:.3f} ms "
              f"({first['name'][:50]}), longest {longest['dur'] / 1e3:.3f} ms at "
              f"{(longest['ts'] - t0) / 1e3:.3f} ms ({longest['name'][:60]})")


if __name__ == "__main__":
    summarize(sys.argv[1])
