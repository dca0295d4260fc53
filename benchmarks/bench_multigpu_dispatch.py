"""Side by side on several GPUs: MoonEP dispatch (+ planning + weight prefetch) and combine on the
CUDA symmetric-memory backend vs an NCCL all-to-all EP baseline (the torch.distributed backend:
all_to_all_single with the real split sizes, as Megatron's all-to-all dispatcher does).

    torchrun --nproc_per_node=N benchmarks/bench_multigpu_dispatch.py [--S 8192 --E 384 ...]

Every rank passes S tokens; routing is the 'hot' family tuned to maxvio in {0.2, 1, 10, 20}.
Reported per maxvio (rank 0 prints): latency of each op (max over ranks of the per-rank mean of
CUDA-event timings over --iters calls), and bandwidth by both definitions: S*K*H*2 / t
("algorithmic") and the bytes the busiest rank actually receives / t.  The baseline is plain EP:
no redundant experts, so its busiest rank receives up to (1 + maxvio) * S*K rows while MoonEP's
receives exactly S*K.  Weight prefetch moves 3*H*H'*2 bytes per redundant expert.
Set NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (no NVLink multicast).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from moonep_ops import Buffer
from moonep_ops.planner import plan_all_ranks
from moonep_ops.testing import maxvio, histogram, routing_for_maxvio


def _time(fn, iters):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    t = torch.tensor([s.elapsed_time(e) / iters * 1e3], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, default=8192)
    ap.add_argument("--E", type=int, default=384)
    ap.add_argument("--H", type=int, default=7168)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--F", type=int, default=2048, help="expert FFN dim H' (weight prefetch)")
    ap.add_argument("--maxvio", default="0.2,1,10,20")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-prefetch", action="store_true")
    a = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    S, E, H, K = a.S, a.E, a.H, a.K
    ours = Buffer(S, H, K, E, group=dist.group.WORLD, token_padding=128, device=dev, backend="symm")
    base = Buffer(S, H, K, E, group=dist.group.WORLD, token_padding=1, device=dev, backend="torch")
    B = E // R
    local_w = slot_w = None
    if not a.no_prefetch:                              # w13 and w2 of every expert as one row
        local_w = torch.randn(B, 3 * H * a.F // 1024, 1024, device=dev, dtype=torch.bfloat16)
        slot_w = ours.symmetric_zeros(local_w.shape, torch.bfloat16)
    x = torch.randn(S, H, device=dev, dtype=torch.bfloat16)
    w = torch.rand(S, K, device=dev)
    if rank == 0:
        print(f"R={R} S={S} E={E} H={H} K={K} H'={a.F} bf16, torch {torch.__version__}, "
              f"{torch.cuda.get_device_name()}")
        print("| maxvio | MoonEP dispatch+plan+prefetch us | MoonEP combine us | baseline dispatch us"
              " | baseline combine us | MoonEP algo / recv GB/s (dispatch) | baseline algo / recv"
              " GB/s (dispatch) | busiest rank rows ours / baseline | redundant experts |")
        print("|---|---|---|---|---|---|---|---|---|")
    algo_bytes = S * K * H * 2
    for mv in [float(v) for v in a.maxvio.split(",")]:
        tk = routing_for_maxvio(mv, R, E, S, K, seed=1)
        got_mv = maxvio(histogram(tk, E))
        t = tk[rank].to(dev)
        grp = plan_all_ranks(tk, E, 128, capacity=S)
        n_red = int((grp.group.layout.experts_to_copy_RB >= 0).sum())
        # rows the busiest rank receives: MoonEP exactly S*K (cap); plain EP the largest group
        ep_rows = int(histogram(tk, E).long().sum(0).view(R, B).sum(1).max())

        def moonep_dispatch():
            h, hw, cu, plan = ours.dispatch(x, t, w)
            if local_w is not None:
                ours.prefetch_weight(plan, local_weights=[local_w], slot_weights=[slot_w])
            return h, plan
        h, plan = moonep_dispatch()
        t_d = _time(moonep_dispatch, a.iters)
        t_c = _time(lambda: ours.combine(plan, h), a.iters)
        hb, _, _, pb = base.dispatch(x, t, w)
        t_bd = _time(lambda: base.dispatch(x, t, w), a.iters)
        t_bc = _time(lambda: base.combine(pb, hb), a.iters)
        ours.check_errors()
        if rank == 0:
            rows_ours = S * K
            print(f"| {got_mv:.2f} | {t_d:.0f} | {t_c:.0f} | {t_bd:.0f} | {t_bc:.0f} | "
                  f"{algo_bytes / t_d / 1e3:.0f} / {rows_ours * H * 2 / t_d / 1e3:.0f} | "
                  f"{algo_bytes / t_bd / 1e3:.0f} / {ep_rows * H * 2 / t_bd / 1e3:.0f} | "
                  f"{rows_ours} / {ep_rows} | {n_red} |", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
