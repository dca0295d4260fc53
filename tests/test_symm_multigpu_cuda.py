"""The CUDA data plane across real GPUs: one process per GPU, NCCL process group, symmetric
regions from torch.distributed._symmetric_memory (TorchSymmetricHeap), staged combine (the
multi-process path).  Same checks as the virtual-rank tests: every data-plane output bitwise
against the CPU references, prefetch/reduce on a random table, the MoE layer against the dense
reference.  Skipped unless at least 2 GPUs and libmoonep_ep.so are present.

    python -m pytest -q tests/test_symm_multigpu_cuda.py        # R = 2, 4, 8 up to the GPU count
"""
from __future__ import annotations

import os
import tempfile
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from moonep_ops import native

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or native.ep() is None,
    reason="needs >= 2 GPUs and libmoonep_ep.so")

NAMES = ["dup", "per_rank_s", "larger_zipf_tp8", "uniform_fp32_tp4", "one_expert", "all_remote"]


def _worker(rank, R, init_file, q):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.distributed as dist
    from moonep_ops.buffer import Buffer
    from moonep_ops.backends import SymmBackend, TorchSymmetricHeap
    import test_symm_cuda as tsc
    import test_moe_symm_cuda as tmc
    try:
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                                world_size=R, device_id=dev)

        def make(r, *a, **k):
            buf = Buffer(*a, group=dist.group.WORLD, device=dev, **k)
            assert isinstance(buf.backend, SymmBackend)
            assert isinstance(buf.backend.heap, TorchSymmetricHeap) and not buf.backend.direct
            return buf

        done = []
        for name in NAMES:
            cfg = dict(tsc.CONFIGS[name])
            if cfg.get("E", 8) % R:
                cfg["E"] = 4 * R
            c = tsc._setup(R, **cfg)
            buf = make(rank, c["S"], c["H"], c["K"], c["E"], token_padding=c["tp"], dtype=c["dtype"])
            tsc.check_rank_buffer(c, buf, rank)
            done.append(name)
        tsc.prefetch_reduce_case(R, make)(rank)
        done.append("prefetch_reduce")
        rank_fn, check = tmc.moe_reference_case(R, make)
        res = rank_fn(rank)
        gathered = [None] * R
        dist.all_gather_object(gathered, res)
        check(gathered)
        done.append("moe_layer")
        q.put((rank, "ok", done))
    except BaseException:                  # noqa: BLE001  (reported to the parent)
        q.put((rank, "fail", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("R", [2, 4, 8])
def test_multigpu_symmetric_memory(R):
    if torch.cuda.device_count() < R:
        pytest.skip(f"needs {R} GPUs")
    init_file = os.path.join(tempfile.mkdtemp(prefix="moonep_mg_"), "store")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, R, init_file, q)) for r in range(R)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(R):
            rank, status, info = q.get(timeout=600)
            results[rank] = (status, info)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    fails = {r: v[1] for r, v in results.items() if v[0] != "ok"}
    assert not fails, "\n".join(f"rank {r}:\n{tb}" for r, tb in fails.items())
    assert all(v[1][-1] == "moe_layer" for v in results.values())
