"""Do CUDA streams of one process block each other through shared hardware queues?
(diagnostic, one GPU)

For every stream i of 32 from torch's pool: a ~25 ms spin kernel on i followed by a tiny kernel
that depends on it (stream order), then a tiny kernel + event on every other stream j; 5 ms
later, the events not yet complete are the streams queued behind i's waiting kernel.  That is
a virtual rank's barrier: a spinning kernel and the rank's next kernels queued behind it.  Run
per CUDA_DEVICE_MAX_CONNECTIONS value (8, the default, and 32); on the H200 no stream waited
behind another at either value (docs/multi_gpu.md), so hardware-queue sharing is not what made
virtual ranks time out.
    [CONNS=8,32] python diagnostics/stream_queues.py
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import os, sys, time
sys.path.insert(0, {root!r})
import torch
torch.zeros(1, device="cuda")
n = 32
ss = [torch.cuda.Stream() for _ in range(n)]
SPIN = 50_000_000                     # cycles: ~25 ms at 2 GHz
blocked = {{}}
for i in range(n):
    torch.cuda.synchronize()
    with torch.cuda.stream(ss[i]):
        torch.cuda._sleep(SPIN)
        torch.cuda._sleep(1000)           # waits for the spin: the queue's head blocks here
    evs = []
    for j in range(n):
        if j != i:
            e = torch.cuda.Event()
            with torch.cuda.stream(ss[j]):
                torch.cuda._sleep(1000)
                e.record()
            evs.append((j, e))
    time.sleep(0.005)
    blocked[i] = [j for j, e in evs if not e.query()]
    torch.cuda.synchronize()
groups, seen = [], set()
for i in range(n):
    if i in seen:
        continue
    g = sorted({{i, *blocked[i]}})
    seen.update(g)
    groups.append(g)
shared = [g for g in groups if len(g) > 1]
print(f"CUDA_DEVICE_MAX_CONNECTIONS={{os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}}: "
      f"{{n}} pool streams, {{len(groups)}} that never wait for another; "
      f"waiting behind another: {{shared if shared else 'none'}}")
"""


def main():
    for conns in os.environ.get("CONNS", "8,32").split(","):
        env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS=conns)
        r = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT)], env=env,
                           capture_output=True, text=True, timeout=300)
        print((r.stdout + r.stderr).strip()[-2000:], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
