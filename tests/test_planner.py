"""The planner: bit-exact MoonEP (vs a loop reference), invariants, op registration, errors."""
from __future__ import annotations

import os
import random

import pytest
import torch
from torch._dynamo.utils import counters

import moonep_ops as m
from moonep_ops.geometry import Geometry
from moonep_ops.planner import plan_group, replication_cost
from moonep_ops.testing import KINDS, histogram, make_hist_rx, make_routing
from planner_checks import plan_violations
from planner_reference import encode_dst, reference_plan

# §2.5 of the digest: R=4, E=8, s=4, K=2.
WORKED_TOPK = [[0, 1, 0, 2, 0, 1, 2, 3], [0, 2, 0, 4, 1, 5, 2, 6],
               [0, 2, 0, 3, 1, 4, 2, 7], [0, 1, 0, 2, 3, 4, 5, 6]]


@pytest.fixture
def worked_example():
    return [torch.tensor(v, dtype=torch.int32).view(4, 2) for v in WORKED_TOPK]


def test_worked_example(worked_example):
    res = m.plan_all_ranks(worked_example, num_experts=8)
    assert res.group.z_RR.tolist() == [[0, 1, 0, 5], [0, 0, 3, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    alloc = res.group.alloc_ER
    assert alloc[0].tolist() == [4, 0, 0, 5]
    assert alloc[1].tolist() == [4, 1, 0, 0]
    assert alloc[2].tolist() == [0, 4, 3, 0]
    for e in range(3, 8):                                   # all other experts stay home
        assert alloc[e].tolist() == [int(alloc[e].sum()) if d == e // 2 else 0 for d in range(4)]
    assert res.plans[0].experts_to_copy.tolist() == [[-1, -1], [1, -1], [2, -1], [0, -1]]
    assert [p.cu_seqlens.tolist() for p in res.plans] == [[4, 8, 8, 8], [4, 7, 8, 8],
                                                          [3, 5, 8, 8], [2, 3, 8, 8]]
    assert [p.remote_stats.tolist() for p in res.plans] == [[0, 2], [1, 1], [1, 0], [1, 0]]
    assert res.plans[0].dst.tolist() == [0, -5, 1, 8, 2, -6, 9, -13]
    assert res.plans[0].NvS == 8

    res4 = m.plan_all_ranks(worked_example, num_experts=8, token_padding=4)
    p3 = res4.plans[3]
    assert p3.NvS == 20
    assert p3.cu_seqlens.tolist() == [4, 8, 16, 16]
    assert p3.zero_fill_ranges.tolist() == [[2, 2], [5, 3], [13, 3], [0, 0]]


def _random_case(rng: random.Random, Rs=(1, 2, 3, 4, 8, 16, 64), max_epn=4, max_K=32,
                 max_s=12):
    R = rng.choice(Rs)
    E = R * rng.randint(1, max_epn)
    K = rng.randint(1, max_K)
    tp = rng.choice([1, 2, 3, 4, 8, 128])
    kind = rng.choice(KINDS)
    if kind in ("uniform", "zipf"):
        K = min(K, E)
    per_rank = rng.random() < 0.3
    s = [rng.randint(1, max_s) for _ in range(R)] if per_rank else rng.randint(1, max_s)
    tk = make_routing(kind, R, E, s, K, seed=rng.randrange(1 << 30), alpha=rng.choice([0.5, 1, 2]),
                      hot_factor=rng.choice([2.0, 11.0, 21.0]))
    return R, E, K, tp, tk


@pytest.mark.parametrize("chunk", range(4))
def test_matches_loop_reference(chunk):
    """The vectorised planner equals a plain loop transcription of the algorithm, bit for bit."""
    rng = random.Random(1000 + chunk)
    for _ in range(75):
        R, E, K, tp, tk = _random_case(rng, Rs=(1, 2, 3, 4, 8), max_K=8)
        res = m.plan_all_ranks(tk, E, tp)
        ref = reference_plan([t.reshape(-1).tolist() for t in tk], R, E, tp)
        assert res.group.alloc_ER.tolist() == ref["alloc"]
        assert res.plans[0].experts_to_copy.tolist() == ref["etc"]
        for r, p in enumerate(res.plans):
            assert p.cu_seqlens.tolist() == ref["cu"][r]
            assert p.zero_fill_ranges.tolist() == ref["zf"][r]
            assert p.remote_stats.tolist() == ref["stats"][r]
            assert p.dst.tolist() == encode_dst(ref["dest_loff"][r], K, p.NvS)


@pytest.mark.parametrize("policy", m.POLICIES)
@pytest.mark.parametrize("chunk", range(5))
def test_invariants_random(policy, chunk):
    """Thousands of seeded random and adversarial routings (both policies, 5 x 250 each)."""
    rng = random.Random(chunk * 7919 + (policy == "lean"))
    for _ in range(250):
        R, E, K, tp, tk = _random_case(rng)
        res = m.plan_all_ranks(tk, E, tp, policy=policy)
        errs = plan_violations(res, tk, E, tp)
        assert not errs, (R, E, K, tp, errs[:5])


def _adversarial():
    """Hand-built routings: ties everywhere, a single hot expert, cascading overshoot."""
    cases = []
    R, B, K = 4, 2, 4
    E = R * B
    # every rank sends every entry to rank 0's expert 0: one donor refills all
    cases.append(("one_expert", [torch.zeros(6, K, dtype=torch.int32) for _ in range(R)], E))
    # equal surpluses and deficits: pure tie-breaking
    tk = [torch.tensor([[0, 1, 2, 3]] * 3, dtype=torch.int32) for _ in range(R)]
    cases.append(("ties", tk, E))
    # cascading overshoot: group sizes chosen so the greedy donor goes negative twice
    R2, B2 = 8, 1
    counts = [30, 14, 6, 6, 6, 6, 6, 6]        # cap = 10 per rank
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))]
    cases.append(("overshoot", list(ids.view(R2, 10, 1)), R2 * B2))
    # K = 32 with every id duplicated inside the token
    cases.append(("k32_dups", make_routing("duplicates", 4, 8, 3, 32, seed=5), 8))
    # one rank sends nothing to its own experts, all to the last rank's group
    cases.append(("all_to_last", [torch.full((5, 2), 7, dtype=torch.int32)] * 4, 8))
    return cases


@pytest.mark.parametrize("policy", m.POLICIES)
@pytest.mark.parametrize("tp", [1, 4, 128])
def test_invariants_adversarial(policy, tp):
    for name, tk, E in _adversarial():
        res = m.plan_all_ranks(tk, E, tp, policy=policy)
        errs = plan_violations(res, tk, E, tp)
        assert not errs, (name, errs[:5])


@pytest.mark.parametrize("policy", m.POLICIES)
def test_nothing_moves_when_every_rank_has_its_cap(policy):
    for R, E, K in [(1, 4, 2), (4, 16, 4), (8, 64, 8), (64, 64, 3)]:
        for kind in ("balanced", "all_local"):
            tk = make_routing(kind, R, E, 5, K, seed=R)
            res = m.plan_all_ranks(tk, E, 4, policy=policy)
            assert int(res.group.z_RR.sum()) == 0
            assert (res.plans[0].experts_to_copy == -1).all()
            for r, p in enumerate(res.plans):      # every entry goes to its expert's home
                assert torch.equal(p.dest_rank, tk[r].reshape(-1).long() // (E // R))


@pytest.mark.parametrize("policy", m.POLICIES)
def test_deterministic(policy):
    tk = make_routing("zipf", 8, 64, 33, 8, seed=3, alpha=1.5)
    a = m.plan_all_ranks(tk, 64, 8, policy=policy)
    b = m.plan_all_ranks([t.clone() for t in tk], 64, 8, policy=policy)
    for pa, pb in zip(a.plans, b.plans):
        for x, y in zip(pa[:5], pb[:5]):
            assert torch.equal(x, y)


@pytest.mark.parametrize("policy", m.POLICIES)
@pytest.mark.parametrize("per_rank", [False, True])
def test_per_rank_op_equals_group_function(policy, per_rank):
    """The op each rank runs (gathered histogram + own top-k) agrees with plan_all_ranks."""
    R, E, K, S = 4, 16, 4, 9
    s = [1, 5, 9, 3] if per_rank else 7
    tk = make_routing("zipf", R, E, s, K, seed=11, alpha=1.2)
    group = m.plan_all_ranks(tk, E, 2, capacity=S, policy=policy)
    tpe = histogram(tk, E)
    total = sum(s) if per_rank else None
    for r in range(R):
        p = m.plan(tpe, tk[r], r, num_ranks=R, capacity=S, token_padding=2,
                   total_num_tokens=total, policy=policy)
        for x, y in zip(p[:5], group.plans[r][:5]):
            assert torch.equal(x, y)
        assert p.nvs_s == group.plans[r].nvs_s
        assert int(p.cu_seqlens[-1]) <= p.nvs_s <= p.NvS


def test_per_rank_caps_floor_ceil():
    """total*K not divisible by R: the first T mod R ranks receive one more copy."""
    R, E, K = 8, 16, 8
    s = [1, 5, 38, 64, 32, 3, 64, 2]            # total*K = 1672, 1672 mod 8 = 0 -> use K=3
    tk = make_routing("zipf", R, E, s, 3, seed=2)
    res = m.plan_all_ranks(tk, E, 4, capacity=64)
    T = sum(s) * 3
    recv = res.group.alloc_ER.sum(0).tolist()
    assert sorted(set(recv)) == sorted({T // R, -(-T // R)})
    assert recv == [T // R + (1 if r < T % R else 0) for r in range(R)]


def test_lean_never_worse_than_moonep():
    """lean: fewest replicated experts, then fewest moved copies; strictly better somewhere."""
    rng = random.Random(5)
    strictly_better = 0
    for _ in range(300):
        R, E, K, tp, tk = _random_case(rng, Rs=(2, 3, 4, 8, 16), max_s=40)
        tpe = histogram(tk, E)
        total = tpe.long().sum()
        costs = {}
        for policy in m.POLICIES:
            gp = plan_group(tpe, int(total), 1, policy)
            costs[policy] = tuple(int(x) for x in replication_cost(gp.alloc_ER))
        assert costs["lean"] <= costs["moonep"], costs
        strictly_better += costs["lean"] < costs["moonep"]
    assert strictly_better > 0


def test_geometry():
    g = Geometry(R=8, E=384, S=8192, K=8, token_padding=128)
    assert g.NvS == 77824
    g2 = Geometry(R=8, E=256, S=4096, K=8, token_padding=128)
    assert g2.NvS == 40960
    assert g2.nvs_s(4096) == 40960
    assert g2.nvs_s(1, total_num_tokens=8192) == 16384
    assert g2.nvs_s(1, total_num_tokens=1000) == 9216


# --------------------------------------------------------------------------------------------
# As a custom op
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", m.POLICIES)
def test_opcheck(policy):
    for kind, R, E, s, K, tp, total in [("zipf", 4, 16, 8, 4, 2, -1), ("one_expert", 2, 4, 3, 2, 1, -1),
                                        ("hot", 4, 8, [3, 1, 4, 2], 2, 4, 10)]:
        tk = make_routing(kind, R, E, s, K, seed=1)
        tpe = histogram(tk, E)
        S = max(t.shape[0] for t in tk)
        for r in range(R):
            torch.library.opcheck(torch.ops.moonep.plan.default,
                                  (tpe, tk[r], r, R, S, tp, total, policy))


def test_fake_shapes_only_from_ints():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        tpe = torch.empty(8, 384, dtype=torch.int32)
        tk = torch.empty(100, 8, dtype=torch.int32)
        out = torch.ops.moonep.plan(tpe, tk, 3, 8, 8192, 128, -1, "moonep")
    assert [tuple(o.shape) for o in out] == [(800,), (96,), (8, 48), (96, 2), (2,)]
    assert all(o.dtype == torch.int32 for o in out)


def test_compile_fullgraph_no_graph_breaks():
    R, E, K, S = 4, 16, 4, 12

    def f(tpe, tk):
        p = m.plan(tpe, tk, 2, num_ranks=R, capacity=S, token_padding=4)
        # downstream use of the plan in the same graph
        return p.dest_rank * 1000 + p.slot, p.cu_seqlens, p.my_experts_to_copy, p.is_primary

    counters.clear()
    cf = torch.compile(f, fullgraph=True)
    for seed, kind in enumerate(["zipf", "hot", "one_expert", "all_remote"]):
        tk = make_routing(kind, R, E, S, K, seed=seed)
        tpe = histogram(tk, E)
        for a, b in zip(cf(tpe, tk[2]), f(tpe, tk[2])):
            assert torch.equal(a, b)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


# --------------------------------------------------------------------------------------------
# Bad input: clear errors before any work
# --------------------------------------------------------------------------------------------


def _good():
    tk = make_routing("zipf", 4, 16, 6, 2, seed=0)
    return tk, histogram(tk, 16)


def _shift_one_count(tpe):
    """Same row sum, different histogram: move one count of rank 0 to another expert."""
    wrong = tpe.clone()
    src = int(wrong[0].nonzero()[0])
    wrong[0, src] -= 1
    wrong[0, (src + 1) % wrong.shape[1]] += 1
    return wrong


def test_bad_input_errors():
    tk, tpe = _good()
    kw = dict(num_ranks=4, capacity=8, token_padding=2)
    with pytest.raises(ValueError, match="divisible"):
        m.plan(tpe[:, :15].contiguous(), tk[0], 0, **{**kw, "num_ranks": 4})
    with pytest.raises(ValueError, match="divisible"):
        m.plan_all_ranks(tk, 15)
    bad = tk[0].clone()
    bad[0, 0] = 16
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, E=16\)"):
        m.plan(tpe, bad, 0, **kw)
    bad[0, 0] = -1
    with pytest.raises(ValueError, match="expert ids"):
        m.plan(tpe, bad, 0, **kw)
    with pytest.raises(ValueError, match="outside"):
        m.plan_all_ranks([bad] + tk[1:], 16)
    wrong = _shift_one_count(tpe)
    with pytest.raises(ValueError, match="disagrees with the histogram"):
        m.plan(wrong, tk[0], 0, **kw)
    with pytest.raises(ValueError, match=r"outside \[1, S=8\]"):
        m.plan(tpe, tk[0][:0], 0, **kw)                         # s = 0
    with pytest.raises(ValueError, match=r"outside \[1, S=4\]"):
        m.plan(tpe, tk[0], 0, **{**kw, "capacity": 4})         # s > S
    with pytest.raises(TypeError, match="int32"):
        m.plan(tpe, tk[0].long(), 0, **kw)
    with pytest.raises(TypeError, match="int32"):
        m.plan(tpe.float(), tk[0], 0, **kw)
    with pytest.raises(ValueError, match="must be 2-D"):
        m.plan(tpe, tk[0].view(-1), 0, **kw)
    with pytest.raises(ValueError, match=r"must be \[R, E\]"):
        m.plan(tpe[:3], tk[0], 0, **kw)
    with pytest.raises(ValueError, match="is on"):
        m.plan(tpe.to("meta"), tk[0], 0, **kw)
    with pytest.raises(ValueError, match="rank=4"):
        m.plan(tpe, tk[0], 4, **kw)
    with pytest.raises(ValueError, match="policy"):
        m.plan(tpe, tk[0], 0, policy="nope", **kw)
    with pytest.raises(ValueError, match="every rank must pass"):
        m.plan(histogram([tk[0][:5]] + tk[1:], 16), tk[1], 1, **kw)
    with pytest.raises(ValueError, match="total_num_tokens"):
        m.plan(tpe, tk[0], 0, total_num_tokens=25, **kw)
    with pytest.raises(ValueError, match=r"total_num_tokens=40 must lie"):
        m.plan(tpe, tk[0], 0, total_num_tokens=40, **kw)


def test_validation_can_be_disabled(monkeypatch):
    """MOONEP_VALIDATE=0 skips data checks (the CUDA default) but keeps shape checks."""
    tk, tpe = _good()
    wrong = _shift_one_count(tpe)
    monkeypatch.setenv("MOONEP_VALIDATE", "0")
    m.plan(wrong, tk[0], 0, num_ranks=4, capacity=8, token_padding=2)   # no data read
    with pytest.raises(TypeError):
        m.plan(tpe, tk[0].long(), 0, num_ranks=4, capacity=8, token_padding=2)


@pytest.mark.parametrize("policy", ["moonep", "lean"])
def test_plan_from_rows_off_cuda_is_the_torch_planner(policy):
    """planner.plan_from_rows (both data-plane backends' planner choice) on CPU rows: the
    torch planner's plan, reported as not made on the device; clamp_ids clamps ids that a
    histogram kernel flagged as bad (here: one id past E, counted as E-1 in the rows)."""
    import types

    from moonep_ops import planner as pdv
    R, E, s, K, tp = 4, 16, 9, 2, 8
    tk = make_routing("zipf", R, E, s, K, seed=3)
    buf = types.SimpleNamespace(R=R, E=E, S=s, token_padding=tp, policy=policy,
                                NvS=Geometry(R=R, E=E, S=s, K=K, token_padding=tp).NvS)
    err = torch.zeros(1, dtype=torch.int32)
    rows = make_hist_rx(histogram(tk, E), s)
    out, on_device = pdv.plan_from_rows(rows, tk[1], 1, buf, -1, err)
    ref = torch.ops.moonep.plan(rows[:, :E].contiguous(), tk[1], 1, R, s, tp, -1, policy)
    assert not on_device and all(torch.equal(a, b) for a, b in zip(out, ref))
    bad = tk[1].clone()
    bad[0, 0] = E + 5
    rows_c = make_hist_rx(histogram([t if r != 1 else bad.clamp(0, E - 1)
                                         for r, t in enumerate(tk)], E), s)
    with pytest.raises(ValueError, match="expert ids"):
        pdv.plan_from_rows(rows_c, bad, 1, buf, -1, err)
    out, _ = pdv.plan_from_rows(rows_c, bad, 1, buf, -1, err, clamp_ids=True)
    ref = torch.ops.moonep.plan(rows_c[:, :E].contiguous(), bad.clamp(0, E - 1), 1, R, s, tp, -1,
                                policy)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
