import os
import sys

# Virtual EP ranks (moonep_ops/testing/virtual_ranks.py) spin in device barriers waiting for each
# other's streams; with the default 8 hardware queues two ranks' streams can share one, and a spinning
# kernel would block its peer queued behind it.  Read when the CUDA context is created.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
# Lazy module loading can need a context-wide synchronisation at a kernel's first launch, which
# would wait for a peer spinning in a barrier (CUDA programming guide, "Lazy Loading").
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import gc  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# tests import their helpers (reference planner, invariant checks) as plain modules
sys.path.insert(0, os.path.dirname(__file__))

# Thousands of tiny tensors: intra-op threads only add contention on the 2-core CI machine
# (measured 8x slower planner property tests with 2 threads under load).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_gc_inside_cuda_tests(request):
    """No garbage-collector pass while a CUDA test enqueues work.  A pass can free earlier tests'
    CUDA graphs and memory pools, and those frees synchronise the device: with virtual ranks,
    whose barrier kernels spin until the host has enqueued every rank, the host then waits for
    a barrier that waits for the host, until the barrier times out.  That made
    test_async_prefetch_reduce_virtual[2] (and test_async_dispatch_combine_virtual)
    fail in whole-file runs only.  Collect before the test instead."""
    if not request.node.fspath.basename.endswith("_cuda.py") or not torch.cuda.is_available():
        yield
        return
    gc.collect()
    torch.cuda.synchronize()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def nccl_world():
    """A one-rank NCCL process group on GPU 0 for the module (CUDA tests only)."""
    created = False
    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(prefix="moonep_nccl_"), "store")
        dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        created = True
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()
