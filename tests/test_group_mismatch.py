"""Ranks whose Buffers disagree: every rank raises the same clear ValueError, nothing hangs.

``Buffer(...)`` compares a fingerprint of (R, E, S, K, D, token_padding, dtype, policy,
backend, slack_ppm, replica_cost) over the group before any tensor collective or allocation.  Each case builds a
Buffer whose arguments differ on the last rank; every rank must raise a ValueError that names
the field, and the process group must still work afterwards (a normal Buffer's dispatch /
combine round trip).  A rank whose arguments fail a local check (E not divisible by R, an
integer dtype, an unknown policy) still takes part in the exchange, so its peers raise too
instead of waiting in it.  Real gloo ranks (tests/dist_harness.py), R = 2 and 4.
"""
from __future__ import annotations

import pytest
import torch

import moonep_ops  # noqa: F401
from moonep_ops.buffer import Buffer

try:
    from dist_harness import cached_runner, multi_rank_cases
except ImportError:                                    # imported as tests.test_group_mismatch
    from tests.dist_harness import cached_runner, multi_rank_cases

BASE = dict(S=8, D=16, K=2, E=8, token_padding=1, dtype=torch.float32, policy="moonep")


def _build(ctx, **kw):
    a = dict(BASE, **kw)
    return Buffer(a.pop("S"), a.pop("D"), a.pop("K"), a.pop("E"), group=ctx.group, **a)


def _round_trip(ctx):
    """The group still works: a Buffer built by every rank, dispatch, combine."""
    buf = _build(ctx)
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(BASE["S"], BASE["D"], generator=g)
    ids = torch.stack([torch.randperm(BASE["E"], generator=g)[:BASE["K"]]
                       for _ in range(BASE["S"])]).to(torch.int32)
    h, w, cu, plan = buf.dispatch(x, ids)
    y, _ = buf.combine(plan, h)
    assert torch.equal(y, x + x)                      # K = 2 copies, added in fp32
    buf.destroy()


def _mismatch(ctx, field, mine, theirs, exc=ValueError, own_exc=None, own_match=None):
    """The last rank passes ``theirs``, the others ``mine``; every rank raises (the last one
    ``own_exc`` matching ``own_match`` when its own arguments are bad), naming ``field``."""
    last = ctx.rank == ctx.R - 1
    kw = theirs if last else mine
    if last and own_exc is not None:
        with pytest.raises(own_exc, match=own_match):
            _build(ctx, **kw)
    else:
        with pytest.raises(exc, match=field) as info:
            _build(ctx, **kw)
        assert "moonep Buffer" in str(info.value)
    _round_trip(ctx)


def case_token_padding(ctx):
    _mismatch(ctx, r"disagree on token_padding \(rank 0: 4", dict(token_padding=4),
              dict(token_padding=8))


def case_num_experts(ctx):
    _mismatch(ctx, r"disagree on E \(rank 0: 8", dict(E=8), dict(E=16))


def case_dtype(ctx):
    _mismatch(ctx, r"disagree on dtype \(rank 0: torch.float32", dict(dtype=torch.float32),
              dict(dtype=torch.bfloat16))


def case_capacity(ctx):
    _mismatch(ctx, r"disagree on S \(rank 0: 8", dict(S=8), dict(S=12))


def case_model_dim(ctx):
    _mismatch(ctx, r"disagree on D \(rank 0: 16", dict(D=16), dict(D=32))


def case_policy(ctx):
    _mismatch(ctx, r"disagree on policy \(rank 0: moonep", dict(policy="moonep"),
              dict(policy="lean"))


def case_slack(ctx):
    _mismatch(ctx, r"disagree on slack_ppm \(rank 0: 50000", dict(policy="cost", slack=0.05,
                                                                   replica_cost=10),
              dict(policy="cost", slack=0.1, replica_cost=10))


def case_replica_cost(ctx):
    _mismatch(ctx, r"disagree on replica_cost \(rank 0: 10", dict(policy="cost", slack=0.05,
                                                                  replica_cost=10),
              dict(policy="cost", slack=0.05, replica_cost=20))


def case_top_k(ctx):
    _mismatch(ctx, r"disagree on K \(rank 0: 2", dict(K=2), dict(K=3))


def case_reject_experts_not_divisible(ctx):
    _mismatch(ctx, rf"rank {ctx.R - 1} rejected its Buffer arguments .*divisible", {},
              dict(E=2 * ctx.R + 1), own_exc=ValueError, own_match="divisible")


def case_reject_integer_dtype(ctx):
    _mismatch(ctx, rf"rank {ctx.R - 1} rejected .*TypeError: dtype", {},
              dict(dtype=torch.int32), own_exc=TypeError, own_match="dtype")


def case_reject_unknown_policy(ctx):
    _mismatch(ctx, rf"rank {ctx.R - 1} rejected .*policy", {}, dict(policy="nope"),
              own_exc=ValueError, own_match="policy must be one of")


def case_reject_on_every_rank(ctx):
    """Every rank rejects: each raises its own error (no rank waits for another)."""
    with pytest.raises(ValueError, match="divisible"):
        _build(ctx, E=2 * ctx.R + 1)
    _round_trip(ctx)


MULTI_RANK = multi_rank_cases(globals(), ranks=(2, 4))
# A hang would show as a timeout of the whole spawn: a short collective timeout, a deadline.
_results = cached_runner(__name__, MULTI_RANK, timeout_s=300, pg_timeout_s=20)


@pytest.mark.parametrize("R,case", MULTI_RANK)
def test_multi_rank(R, case):
    res = _results(R)[case]
    assert res.ok, res.error

