"""The plain all-to-all EP baseline (moonep_ops/testing/baseline.py) on real gloo ranks: it equals
the dense reference, and the main job's MoonEP and baseline builds compute the same loss and
the same gradients from the same weights, data and routing."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moonep_ops  # noqa: F401
from moonep_ops.testing.baseline import AllToAllEPMoE
from moonep_ops.buffer import Buffer
from apps.job.model import (ForcedRouter, batch, build_model, full_weights, load_weights,
                                  step_routing)
from moonep_ops.testing import reference_moe

try:
    from dist_harness import cached_runner, multi_rank_cases
except ImportError:                                    # imported as tests.test_a2a_baseline
    from tests.dist_harness import cached_runner, multi_rank_cases

D, F, E, K = 16, 8, 8, 3


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _weights(seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, F, D, generator=g) * 0.3, torch.randn(E, F, D, generator=g) * 0.3,
            torch.randn(E, D, F, generator=g) * 0.3, torch.randn(E, D, generator=g) * 0.5)


def _tokens(r, s, seed=5):
    g = torch.Generator().manual_seed(seed * 1000 + r)
    x = torch.randn(s, D, generator=g)
    x[:, 1] += 1.5                       # a hot expert: rank loads differ
    return x, torch.randn(s, D, generator=g)


def _check_against_reference(ctx, sizes, forced_maxvio=None, tp=1):
    R, r = ctx.R, ctx.rank
    B = E // R
    w1, w3, w2, gate = _weights()
    layer = AllToAllEPMoE(D, F, E, K, group=ctx.group, token_padding=tp)
    sl = slice(r * B, (r + 1) * B)
    with torch.no_grad():
        layer.w1.copy_(w1[sl])
        layer.w3.copy_(w3[sl])
        layer.w2.copy_(w2[sl])
        layer.router.gate.weight.copy_(gate)
        layer.router.gate.weight[3, 1] += 2.0
    ids_all = None
    if forced_maxvio is not None:        # synthetic routing with duplicates inside tokens
        layer.router = ForcedRouter(layer.router, sizes[r])
        ids_all = step_routing(forced_maxvio, 0, 0, R, E, sizes[0], K, seed=1)
        layer.router.ids.copy_(ids_all[r])
    x, gy = _tokens(r, sizes[r])
    x.requires_grad_(True)
    out = layer(x)
    (out * gy).sum().backward()
    layer.reduce_router_grad()
    # what the layer's experts received equals the routing's per-rank load
    recv = torch.tensor([layer.last_recv_rows])
    all_recv = [torch.zeros(1, dtype=torch.long) for _ in range(R)]
    if R > 1:
        dist.all_gather(all_recv, recv)
    else:
        all_recv = [recv]

    # dense fp32 reference over every rank's tokens
    W1, W3, W2, G = (t.clone().requires_grad_(True) for t in _weights())
    with torch.no_grad():
        G[3, 1] += 2.0
    xs, gys = zip(*(_tokens(q, sizes[q]) for q in range(R)))
    X = torch.cat(xs).requires_grad_(True)
    scores = torch.softmax(X @ G.t(), -1)
    ids = (torch.cat(ids_all).long() if ids_all is not None
           else torch.topk(scores.detach(), K, dim=-1).indices)
    ref = reference_moe(X, ids, scores.gather(1, ids), W1, W3, W2)
    (ref * torch.cat(gys)).sum().backward()
    load = torch.bincount(ids.reshape(-1), minlength=E).view(R, B).sum(1)
    assert [int(v) for v in all_recv] == load.tolist()
    lo = sum(sizes[:r])
    rows = slice(lo, lo + sizes[r])
    inner = layer.router.inner if forced_maxvio is not None else layer.router
    checks = {"out": (out, ref[rows]), "dx": (x.grad, X.grad[rows]),
              "router": (inner.gate.weight.grad, G.grad),
              "w1": (layer.w1.grad, W1.grad[sl]), "w3": (layer.w3.grad, W3.grad[sl]),
              "w2": (layer.w2.grad, W2.grad[sl])}
    bad = {k: _rel(a, b) for k, (a, b) in checks.items() if _rel(a, b) > 1e-5}
    assert not bad, (sizes, bad)


def case_baseline_vs_reference(ctx):
    _check_against_reference(ctx, [12] * ctx.R)


def case_baseline_vs_reference_ragged(ctx):
    """Different token counts per rank, one rank with a single token."""
    _check_against_reference(ctx, [(5, 12, 1, 9)[q % 4] for q in range(ctx.R)])


def case_baseline_vs_reference_padded(ctx):
    """Expert segments padded to 4 rows (as on GPUs): padding rows never reach an output."""
    _check_against_reference(ctx, [(5, 12, 1, 9)[q % 4] for q in range(ctx.R)], tp=4)


def case_baseline_vs_reference_duplicates(ctx):
    """Forced routing at maxvio 6 (E=8, K=3): the hot expert repeats inside tokens."""
    _check_against_reference(ctx, [16] * ctx.R, forced_maxvio=6.0)


def case_moonep_and_baseline_models_agree(ctx):
    """The main job's two builds: same loss, same grads of every parameter (fp32)."""
    R, r = ctx.R, ctx.rank
    L, s = 2, 16
    buf = Buffer(s, D, K, E, group=ctx.group, token_padding=4, dtype=torch.float32)
    weights = full_weights(L, E, D, F, seed=2)
    models = {}
    for kind in ("baseline", "moonep"):
        m = build_model(kind, L=L, E=E, K=K, D=D, F=F, s=s, dtype=torch.float32,
                        device=torch.device("cpu"), group=ctx.group, buffer=buf)
        load_weights(m, weights, r)
        m.set_routing([step_routing(4.0, 0, l, R, E, s, K, seed=0)[r] for l in range(L)])
        models[kind] = m
    x, y = batch(0, r, s, D, 0, torch.float32, "cpu")
    losses, grads = {}, {}
    for kind, m in models.items():
        loss = (m(x) - y).pow(2).sum() / (R * s * D)
        loss.backward()
        glob = loss.detach().clone()
        rep = {id(p) for p in m.replicated_parameters()}
        g = {}
        for n, p in m.named_parameters():
            t = p.grad.clone()
            if R > 1:
                if id(p) in rep:
                    dist.all_reduce(t)
            g[n.replace("router.inner.", "router.")] = t
        if R > 1:
            dist.all_reduce(glob)
        losses[kind], grads[kind] = float(glob), g
    assert abs(losses["moonep"] - losses["baseline"]) <= 1e-6 * abs(losses["baseline"]), losses
    assert grads["moonep"].keys() == grads["baseline"].keys()
    bad = {n: _rel(grads["moonep"][n], grads["baseline"][n]) for n in grads["baseline"]
           if _rel(grads["moonep"][n], grads["baseline"][n]) > 1e-5}
    assert not bad, bad
    # and the router really received gradient (the route weights flow through both builds)
    assert grads["moonep"]["layers.0.router.gate.weight"].abs().sum() > 0


MULTI_RANK = multi_rank_cases(globals())
_results = cached_runner(__name__, MULTI_RANK, timeout_s=300, pg_timeout_s=60)


@pytest.mark.parametrize("R,case", MULTI_RANK)
def test_multi_rank(R, case):
    res = _results(R)[case]
    assert res.ok, res.error


def test_bad_configuration():
    with pytest.raises(ValueError, match="K=9 > num_experts E=8"):
        AllToAllEPMoE(D, F, 8, 9)
    with pytest.raises(ValueError, match="hidden sizes"):
        AllToAllEPMoE(D, 0, 8, 2)
    with pytest.raises(ValueError, match="token_padding"):
        AllToAllEPMoE(D, F, 8, 2, token_padding=0)
