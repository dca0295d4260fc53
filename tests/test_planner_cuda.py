"""The planner on CUDA tensors: bitwise equal to CPU, and no host synchronisation."""
import pytest
import torch

import moonep_ops as m
from moonep_ops.testing import histogram, make_routing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("policy", m.POLICIES)
@pytest.mark.parametrize("kind,R,E,s,K,tp", [("zipf", 8, 64, 512, 8, 128), ("one_expert", 4, 16, 33, 4, 8),
                                            ("hot", 64, 256, 64, 8, 128), ("all_remote", 2, 8, 7, 3, 1)])
def test_cuda_equals_cpu_without_sync(policy, kind, R, E, s, K, tp, monkeypatch):
    monkeypatch.setenv("MOONEP_VALIDATE", "auto")       # data checks off on CUDA
    tk = make_routing(kind, R, E, s, K, seed=3)
    tpe = histogram(tk, E)
    cpu = m.plan(tpe, tk[1], 1, num_ranks=R, capacity=s, token_padding=tp, policy=policy)
    tpe_c, tk_c = tpe.cuda(), tk[1].cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = m.plan(tpe_c, tk_c, 1, num_ranks=R, capacity=s, token_padding=tp, policy=policy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(cpu[:5], gpu[:5]):
        assert torch.equal(a, b.cpu())
