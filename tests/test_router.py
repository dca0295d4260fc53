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
        ids, _, logits = r(torch.randn(T, D, generator=g) + mu)
        scores = r.scores(logits)
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
    ids, w, logits = r(x)
    scores = r.scores(logits)
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
    with pytest.raises(ValueError, match="num_limited_groups"):
        Router(8, 8, 2, num_expert_groups=4, num_limited_groups=5)
    with pytest.raises(ValueError, match="fewer than top_k"):
        Router(8, 8, 4, num_expert_groups=4, num_limited_groups=1)
    with pytest.raises(ValueError, match="topk_before_score"):
        Router(8, 8, 2, score_func="sigmoid", topk_before_score=True)


def _nan_rounds(router, g, D, T, poison_every=3, rounds=9):
    """Balancing steps on batches of which every ``poison_every``-th has NaN tokens."""
    for i in range(rounds):
        x = torch.randn(T, D, generator=g)
        if i % poison_every == 1:
            x[:3] = float("nan")                  # three NaN tokens
        if i % poison_every == 2:
            x[:] = float("inf")                   # a batch with no finite token at all
        _, _, logits = router(x)
        router.update_balance(router.scores(logits))


def test_nonfinite_scores_never_reach_the_balancing_bias():
    r, mu = skewed_router(16, 8, 2, 0.5)
    g = torch.Generator().manual_seed(0)
    with pytest.warns(RuntimeWarning, match="non-finite router scores"):
        _nan_rounds(r, g, 16, 64)
    assert torch.isfinite(r.expert_bias).all() and r.expert_bias.abs().sum() > 0
    assert r.nonfinite_tokens == 3 * 3 + 64 * 3
    # later clean batches still route over several experts (the bias was not poisoned)
    ids, _, _ = r(torch.randn(256, 16, generator=g) + mu)
    assert len(torch.unique(ids)) > 4


def case_nonfinite_scores_over_the_group(ctx):
    """One rank's NaN tokens leave every rank's bias finite and equal."""
    import torch.distributed as dist
    torch.manual_seed(0)
    r = Router(16, 8, 2, balance_rate=0.5, balance_group=ctx.group)
    g = torch.Generator().manual_seed(10 + ctx.rank)
    for i in range(6):
        x = torch.randn(64, 16, generator=g)
        if ctx.rank == 0 and i % 2:
            x[:5] = float("nan")
        if ctx.rank == ctx.R - 1 and i == 3:
            x[:] = float("nan")                       # this rank has no finite token
        _, _, logits = r(x)
        r.update_balance(r.scores(logits))
    assert torch.isfinite(r.expert_bias).all() and r.expert_bias.abs().sum() > 0
    biases = [torch.empty(8) for _ in range(ctx.R)]
    dist.all_gather(biases, r.expert_bias.clone(), group=ctx.group)
    for b in biases:
        assert torch.equal(b, biases[0])


from dist_harness import cached_runner, multi_rank_cases  # noqa: E402

MULTI_RANK = multi_rank_cases(globals(), ranks=(2, 4))
_results = cached_runner(__name__, MULTI_RANK, timeout_s=240)


@pytest.mark.parametrize("R,case", MULTI_RANK)
def test_multi_rank(R, case):
    res = _results(R)[case]
    assert res.ok, res.error
