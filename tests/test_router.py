"""Router and Quantile Balancing."""
import pytest
import torch

from moonep_ops.planner import plan_group, replication_cost
from moonep_ops.nn.router import Router
from moonep_ops.testing import load_per_expert, maxvio_of, skewed_router


def _run(rate, steps=16, D=32, E=64, K=8, T=2048, R=8):
    r, mu = skewed_router(D, E, K, rate)
    g = torch.Generator().manual_seed(1)
    hist = []
    for _ in range(steps):
        ids, _, scores = r(torch.randn(T, D, generator=g) + mu)
        loads = load_per_expert(ids, E)
        tpe = torch.zeros(R, E, dtype=torch.int32)
        tpe[0] = loads                       # the planner only needs per-expert totals here
        rep, moved = replication_cost(plan_group(tpe, T * K, 1, "moonep").alloc_ER)
        hist.append((maxvio_of(loads), int(rep), int(moved)))
        r.update_balance(scores)
    return hist


def test_quantile_balancing_reduces_imbalance_and_replication():
    base = _run(0.0)
    qb = _run(0.5)
    first, last = qb[0], qb[-4:]
    assert first[0] > 2.0 and base[-1][0] > 2.0            # the router really is skewed
    mv_last = sum(h[0] for h in last) / len(last)
    assert mv_last < 0.35 * first[0] and mv_last < 0.5      # maxvio falls over steps
    assert max(h[2] for h in last) < 0.2 * first[2]          # planner moves far fewer copies
    assert max(h[1] for h in last) < first[1]                # ... and replicates fewer experts
    # without balancing nothing improves
    assert sum(h[0] for h in base[-4:]) / 4 > 0.8 * base[0][0]


def test_bias_steers_selection_not_weights():
    r, mu = skewed_router(16, 8, 2, 0.5)
    x = torch.randn(64, 16) + mu
    with torch.no_grad():
        r.expert_bias.copy_(torch.linspace(3, -3, 8))
    ids, w, scores = r(x)
    assert torch.equal(w, scores.gather(1, ids.long()))     # weights from unbiased scores
    assert (ids < 4).float().mean() > 0.9                    # selection follows the bias


def test_renorm_sigmoid_and_scale():
    r = Router(16, 8, 3, score_func="sigmoid", route_norm=True, route_scale=2.5)
    ids, w, _ = r(torch.randn(10, 16))
    assert ids.dtype == torch.int32 and ids.shape == (10, 3)
    torch.testing.assert_close(w.sum(-1), torch.full((10,), 2.5))


def test_bad_router_config():
    with pytest.raises(ValueError, match="top_k"):
        Router(8, 4, 5)
    with pytest.raises(ValueError, match="score_func"):
        Router(8, 4, 2, score_func="relu")
    with pytest.raises(ValueError, match="balance_rate"):
        Router(8, 4, 2, balance_rate=2.0)
