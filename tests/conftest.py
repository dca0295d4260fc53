import os
import sys

# Virtual EP ranks (tests/virtual_ranks.py) spin in device barriers waiting for each other's
# streams; with the default 8 hardware queues two ranks' streams can share one, and a spinning
# kernel would block its peer queued behind it.  Read when the CUDA context is created.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
# Lazy module loading can need a context-wide synchronisation at a kernel's first launch, which
# would wait for a peer spinning in a barrier (CUDA programming guide, "Lazy Loading").
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import torch  # noqa: E402

# tests import their helpers (reference planner, invariant checks) as plain modules
sys.path.insert(0, os.path.dirname(__file__))

# Thousands of tiny tensors: intra-op threads only add contention on the 2-core CI machine
# (measured 8x slower planner property tests with 2 threads under load).
torch.set_num_threads(1)
