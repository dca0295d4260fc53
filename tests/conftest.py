import os
import sys

import torch

# tests import their helpers (reference planner, invariant checks) as plain modules
sys.path.insert(0, os.path.dirname(__file__))

# Thousands of tiny tensors: intra-op threads only add contention on the 2-core CI machine
# (measured 8x slower planner property tests with 2 threads under load).
torch.set_num_threads(1)
