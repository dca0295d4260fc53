"""No silent corruption from bad input: memory overlap of written tensors, dtypes, devices,
contiguity and value ranges, checked before anything is written (single process, CPU).

Every bad call snapshots the tensors the op would write and asserts they are unchanged after
the error.  The multi-rank half (ranks whose Buffers disagree) is tests/test_group_mismatch.py.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moonep_ops  # noqa: F401  (registers the ops)
from moonep_ops import registry
from moonep_ops.backends import SingleRankBackend
from moonep_ops.buffer import Buffer
from moonep_ops.geometry import GroupSpec
from moonep_ops.ops import grouped_mm as gg
from moonep_ops.ops import swiglu as sw

ops = torch.ops.moonep
EPN = 4


def _buffer(**kw):
    """R = 1, E = 4: epn = 4 slots; an experts_to_copy of [1, 4] may name any expert (owner 0)."""
    args = dict(S=6, D=8, K=3, E=EPN, token_padding=2, dtype=torch.float32)
    args.update(kw)
    return Buffer(args.pop("S"), args.pop("D"), args.pop("K"), args.pop("E"), **args)


def _etc(*row):
    return torch.tensor([list(row)], dtype=torch.int32)


ETC = (2, 0, -1, 3)          # slot 0 <- expert 2, slot 1 <- expert 0, slot 3 <- expert 3


def _snap(ts):
    return [t.clone() for t in ts]


def _same(ts, snap):
    return all(torch.equal(a, b) for a, b in zip(ts, snap))


# ---------------------------------------------------------------------------------------------
# The overlap test itself
# ---------------------------------------------------------------------------------------------


def test_overlaps_compares_byte_ranges():
    from moonep_ops.ops.checks import overlaps
    base = torch.arange(48.).view(12, 4)
    assert overlaps(base[4:12], base[:8])                       # different starts, shared rows
    assert not overlaps(base[:6], base[6:])                     # adjacent, disjoint
    assert overlaps(base, base)
    raw = base.view(-1).view(torch.uint8)
    assert overlaps(raw[1:5], base[:1])                         # reinterpreted bytes
    assert not overlaps(raw[16:], base[:1])
    assert not overlaps(base[:, 0], base[:, 1])                 # interleaved columns
    assert overlaps(base[:, 1], base[3:5, 1:2])
    assert overlaps(base.t(), base[11:])                        # dense, permuted
    assert not overlaps(base[:0], base)                         # empty tensors never overlap
    assert not overlaps(base, base.clone())
    assert not overlaps(base.to("meta"), base.to("meta"))       # no storage: skipped
    with FakeTensorMode() as mode:
        f = mode.from_tensor(base)
        assert not overlaps(f, f)
    # strided read whose span covers a dense block without touching it
    s = torch.zeros(1000)
    x = s.as_strided((4, 3), (100, 1))
    assert not overlaps(x, s[10:16]) and overlaps(x, s[100:101])


# ---------------------------------------------------------------------------------------------
# prefetch_weight / reduce_grad: real overlap, every pair, repeated tensors
# ---------------------------------------------------------------------------------------------


def _prefetch_cases():
    base = torch.arange(18.).view(6, 3)
    b5 = torch.arange(15.).view(5, 3)
    big = torch.arange(52, dtype=torch.uint8)
    store = torch.full((12,), -1, dtype=torch.int32)
    a, b, c = (torch.randn(EPN, 3) for _ in range(3))
    return {
        # the case: different start addresses, four shared rows
        "shifted_views": ([base[0:4]], [base[2:6]], _etc(*ETC)),
        "slot_repeated": ([a, b], [c, c], _etc(*ETC)),
        "slot_overlaps_other_local": ([b5[0:4], a], [c, b5[1:5]], _etc(*ETC)),
        "reinterpreted_bytes": ([big[4:].view(torch.float32).view(EPN, 3),
                                 torch.zeros(EPN, 12, dtype=torch.uint8)],
                                [torch.zeros(EPN, 3), big[:48].view(EPN, 12)], _etc(*ETC)),
        "slot_overlaps_experts_to_copy": ([torch.ones(EPN, 2, dtype=torch.int32)],
                                          [store[:8].view(EPN, 2)], store[4:8].view(1, EPN)),
    }


@pytest.mark.parametrize("case", sorted(_prefetch_cases()))
def test_prefetch_overlap_raises_nothing_written(case):
    buf = _buffer()
    local, slots, etc = _prefetch_cases()[case]
    everything = local + slots + [etc]
    snap = _snap(everything)
    with pytest.raises(ValueError, match="overlap in memory"):
        ops.prefetch_weight(etc, local, slots, buf.name)
    with pytest.raises(ValueError, match="overlap in memory"):
        buf.prefetch_weight(_plan(buf, etc), local_weights=local, slot_weights=slots)
    assert _same(everything, snap)
    # no false positive: disjoint views of one storage work (and the op really writes)
    base = torch.randn(2 * EPN, 3)
    loc, sl = base[:EPN], base[EPN:]
    expect = sl.clone()
    for b, e in enumerate(ETC):
        if e >= 0:
            expect[b] = loc[e]
    ops.prefetch_weight(_etc(*ETC), [loc], [sl], buf.name)
    assert torch.equal(sl, expect)


def _plan(buf, etc):
    """A plan of this Buffer whose slot table is ``etc`` (R = 1)."""
    x = torch.randn(4, buf.D)
    t = torch.zeros(4, buf.K, dtype=torch.int32)
    *_, plan = buf.dispatch(x, t)
    return plan._replace(experts_to_copy=etc)


def _reduce_cases():
    base = torch.randn(6, 3)
    b5 = torch.randn(5, 3)
    g, s1, s2 = (torch.randn(EPN, 3) for _ in range(3))
    store = torch.zeros(12)            # fp32 zeros read as int32: experts_to_copy of zeros
    return {
        "shifted_views": ([base[0:4]], [base[2:6]], _etc(*ETC)),
        "local_repeated": ([g, g], [s1, s2], _etc(*ETC)),
        "slot_repeated": ([g, s1], [s2, s2], _etc(*ETC)),
        "local_overlaps_other_slot": ([b5[0:4], g], [s1, b5[1:5]], _etc(*ETC)),
        "slot_overlaps_experts_to_copy": ([torch.randn(EPN, 2)], [store[:8].view(EPN, 2)],
                                          store[4:8].view(torch.int32).view(1, EPN)),
    }


@pytest.mark.parametrize("case", sorted(_reduce_cases()))
def test_reduce_grad_overlap_raises_nothing_written(case):
    buf = _buffer()
    local, slots, etc = _reduce_cases()[case]
    everything = local + slots + [etc]
    snap = _snap(everything)
    with pytest.raises(ValueError, match="overlap in memory"):
        ops.reduce_grad(etc, local, slots, buf.name)
    with pytest.raises(ValueError, match="overlap in memory"):
        buf.reduce_grad(_plan(buf, etc), local_grads=local, slot_grads=slots)
    assert _same(everything, snap)
    # no false positive: disjoint views of one storage work
    base = torch.randn(2 * EPN, 3)
    loc, sl = base[:EPN], base[EPN:]
    expect = loc.clone()
    for b, e in enumerate(ETC):
        if e >= 0:
            expect[e] += sl[b]
    ops.reduce_grad(_etc(*ETC), [loc], [sl], buf.name)
    assert torch.equal(loc, expect) and bool((sl[[0, 1, 3]] == 0).all())


def test_experts_to_copy_contiguous_and_lists_checked():
    buf = _buffer()
    etc = torch.tensor([[2, 9, 0, 9, -1, 9, 3, 9]], dtype=torch.int32)[:, ::2]   # [1, 4]
    assert not etc.is_contiguous()
    local, slots = [torch.randn(EPN, 3)], [torch.zeros(EPN, 3)]
    grads = [torch.randn(EPN, 3)]
    snap = _snap(slots + grads)
    with pytest.raises(ValueError, match="experts_to_copy must be contiguous"):
        ops.prefetch_weight(etc, local, slots, buf.name)
    with pytest.raises(ValueError, match="experts_to_copy must be contiguous"):
        ops.reduce_grad(etc, grads, slots, buf.name)
    plan = _plan(buf, _etc(*ETC))
    # a bare [epn, epn] tensor would iterate into epn row tensors of [epn]: refused
    sq, sq_slots = torch.randn(EPN, EPN), torch.zeros(EPN, EPN)
    sq_snap = sq_slots.clone()
    with pytest.raises(TypeError, match="list or tuple"):
        buf.prefetch_weight(plan, local_weights=sq, slot_weights=sq_slots)
    with pytest.raises(TypeError, match="list or tuple"):
        buf.reduce_grad(plan, local_grads=sq, slot_grads=sq_slots)
    with pytest.raises(TypeError, match=r"local_weights\[1\] must be a tensor"):
        buf.prefetch_weight(plan, local_weights=[local[0], [1.0]], slot_weights=slots * 2)
    assert torch.equal(sq_slots, sq_snap) and _same(slots + grads, snap)


# ---------------------------------------------------------------------------------------------
# grouped_mm_wgrad_accumulate / grouped_mm_wgrad_into: grads vs inputs, local vs slot
# ---------------------------------------------------------------------------------------------

M, O, I, E_GMM = 6, 2, 3, 1           # epn = 1: G = 2 groups
CU = torch.tensor([2, 6], dtype=torch.int32)


def _wgrad_cases():
    n = E_GMM * O * I
    st = torch.randn(3 * n)
    dy, x = torch.randn(M, O), torch.randn(M, I)
    g1, g2 = torch.randn(E_GMM, O, I), torch.randn(E_GMM, O, I)
    xs = torch.randn(M * I + 2)
    dys = torch.randn(M * O + 3)
    cus = torch.zeros(n)
    return {
        "same_tensor": (dy, x, CU, g1, g1),
        "local_slot_shifted": (dy, x, CU, st[:n].view(E_GMM, O, I), st[2:2 + n].view(E_GMM, O, I)),
        "slot_overlaps_x": (dy, xs[2:].view(M, I), CU, g1, xs[:n].view(E_GMM, O, I)),
        "local_overlaps_dy": (dys[3:].view(M, O), x, CU, dys[:n].view(E_GMM, O, I), g2),
        "local_overlaps_cu": (dy, x, cus.view(torch.int32)[:2], cus.view(E_GMM, O, I), g2),
    }


@pytest.mark.parametrize("op", ["accumulate", "into"])
@pytest.mark.parametrize("case", sorted(_wgrad_cases()))
def test_wgrad_overlap_raises_nothing_written(case, op):
    dy, x, cu, gl, gs = _wgrad_cases()[case]
    everything = [dy, x, cu, gl, gs]
    snap = _snap(everything)
    fn = gg.grouped_mm_wgrad_accumulate if op == "accumulate" else gg.grouped_mm_wgrad_into
    with pytest.raises(ValueError, match="overlap in memory"):
        fn(dy, x, cu, gl, gs)
    assert _same(everything, snap)
    # no false positive: grads inside the span of a strided x that never touches them
    s = torch.zeros(1000)
    xs = s.as_strided((M, I), (100, 1))
    xs.copy_(torch.randn(M, I))
    gl, gs = s[10:16].view(1, O, I), s[20:26].view(1, O, I)
    dy = torch.randn(M, O)
    ref_l, ref_s = gg.grouped_mm_wgrad(dy, xs.clone(), CU, 1)
    fn(dy, xs, CU, gl, gs)
    torch.testing.assert_close(gl, ref_l)
    torch.testing.assert_close(gs, ref_s)


def test_wgrad_grads_not_3d_clear_error():
    dy, x = torch.randn(M, O), torch.randn(M, I)
    for fn in (gg.grouped_mm_wgrad_into, gg.grouped_mm_wgrad_accumulate):
        with pytest.raises(ValueError, match="grad_local must be 3-D"):
            fn(dy, x, CU, torch.zeros(()), torch.zeros(1, O, I))


def test_grouped_mm_backward_with_permuted_weights():
    """Dense but non-contiguous weights (a transposed parameter): the scratch slot grads of the
    backward are contiguous, so the write-once wgrad accepts them."""
    x = torch.randn(M, I, requires_grad=True)
    wl = torch.randn(1, I, O).transpose(1, 2).requires_grad_()          # [1, O, I], permuted
    ws = torch.randn(1, O, I)                                             # no grad wanted
    y = gg.grouped_mm(x, wl, ws, CU)
    y.sum().backward()
    ref = gg.grouped_mm_wgrad(torch.ones(M, O), x.detach(), CU, 1)[0]
    torch.testing.assert_close(wl.grad, ref)


# ---------------------------------------------------------------------------------------------
# moe_experts: everything checked before the pool's slots are written
# ---------------------------------------------------------------------------------------------

D_, F_ = 8, 4


def _experts(buf):
    pool = buf.expert_pool(D_, F_, torch.float32)
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(EPN, F_, D_, generator=g)
    w3 = torch.randn(EPN, F_, D_, generator=g)
    w2 = torch.randn(EPN, D_, F_, generator=g)
    h = torch.randn(10, D_, generator=g)
    cu = torch.tensor([2, 2, 4, 4, 6, 6, 8, 10], dtype=torch.int32)
    return pool, h, cu, w1, w3, w2


def test_moe_experts_overlap_with_pool_raises():
    buf = _buffer(D=D_)
    pool, h, cu, w1, w3, w2 = _experts(buf)
    etc = _etc(0, -1, -1, -1)                    # slot 0 stages expert 0: the op writes pool.w1
    h_in_pool = pool.w1.view(-1)[:10 * D_].view(10, D_)
    w1_in_pool = pool.w2.view(EPN, F_, D_)
    for args in ((h_in_pool, cu, etc, w1, w3, w2), (h, cu, etc, w1_in_pool, w3, w2)):
        snap = _snap(pool.tensors())
        with pytest.raises(ValueError, match="overlap in memory"):
            ops.moe_experts(*args, pool.name)
        assert _same(pool.tensors(), snap)


def test_moe_experts_bad_input_raises_before_staging():
    buf = _buffer(D=D_)
    pool, h, cu, w1, w3, w2 = _experts(buf)
    etc = _etc(0, -1, -1, -1)
    bad_cu = torch.tensor([2, 1, 4, 4, 6, 6, 8, 10], dtype=torch.int32)   # decreasing
    snap = _snap(pool.tensors())
    with pytest.raises(ValueError, match="non-decreasing"):
        ops.moe_experts(h, bad_cu, etc, w1, w3, w2, pool.name)
    assert _same(pool.tensors(), snap), "the slots were staged before cu_seqlens was checked"
    with pytest.raises(TypeError, match="w3"):
        ops.moe_experts(h, cu, etc, w1, w3.double(), w2, pool.name)
    with pytest.raises(ValueError, match="w2 must be contiguous"):
        ops.moe_experts(h, cu, etc, w1, w3, w2.transpose(1, 2).contiguous().transpose(1, 2),
                        pool.name)
    assert _same(pool.tensors(), snap)
    # backward: a dy of the wrong shape must fail before the re-staging writes the slots
    y, g, u = ops.moe_experts(h, cu, etc, w1, w3, w2, pool.name)
    for t in pool.tensors():
        t.zero_()
    snap = _snap(pool.tensors())
    with pytest.raises(ValueError, match="dy"):
        ops.moe_experts_backward(y[:-1], h, g, u, cu, etc, w1, w3, w2, pool.name)
    with pytest.raises(ValueError, match="dy"):
        ops.moe_experts_backward(y[:, :-1], h, g, u, cu, etc, w1, w3, w2, pool.name)
    assert _same(pool.tensors(), snap)


def test_moe_experts_fake_kernels_check():
    buf = _buffer(D=D_)
    pool, h, cu, w1, w3, w2 = _experts(buf)
    meta = lambda *ts: [t.to("meta") for t in ts]          # noqa: E731
    etc = _etc(0, -1, -1, -1)
    with pytest.raises(ValueError, match="w1, w3"):
        ops.moe_experts(*meta(h, cu, etc, w1, w3, w2[:, :, :-1]), pool.name)
    with pytest.raises(ValueError, match="length"):
        ops.moe_experts(*meta(h, cu[:-1], etc, w1, w3, w2), pool.name)
    y, g, u = ops.moe_experts(*meta(h, cu, etc, w1, w3, w2), pool.name)
    assert y.shape == h.shape and g.shape == (10, F_)
    with pytest.raises(ValueError, match="dy"):
        ops.moe_experts_backward(*meta(y[:-1], h, g, u, cu, etc, w1, w3, w2), pool.name)


# ---------------------------------------------------------------------------------------------
# swiglu: floating inputs of one dtype and device
# ---------------------------------------------------------------------------------------------


def test_swiglu_rejects_integer_and_mixed_inputs():
    g, u = torch.randn(5, 6), torch.randn(5, 6)
    bad = {
        "int32": ((g * 10).int(), (u * 10).int(), TypeError, "floating"),
        "int64_u": (g, (u * 10).long(), TypeError, "floating"),
        "fp32_fp64": (g, u.double(), TypeError, "share one dtype"),
        "fp64_fp32": (g.double(), u, TypeError, "share one dtype"),
    }
    for name, (a, b, exc, msg) in bad.items():
        da = torch.randn(5, 6, dtype=a.dtype) if a.dtype.is_floating_point else a
        with pytest.raises(exc, match=msg):
            ops.swiglu(a, b)
        with pytest.raises(exc, match=msg):
            sw.swiglu(a, b)
        with pytest.raises(exc, match=msg):
            ops.swiglu(a.to("meta"), b.to("meta"))                # the fake kernel
        with pytest.raises(exc, match=msg):
            ops.swiglu_backward(a, b, da)
        with pytest.raises(exc, match=msg):
            ops.swiglu_backward(a.to("meta"), b.to("meta"), da.to("meta"))
    with pytest.raises(TypeError, match="da"):
        ops.swiglu_backward(g, u, torch.randn(5, 6, dtype=torch.float64))
    with pytest.raises(TypeError, match="da"):
        ops.swiglu_backward(g, u, torch.ones(5, 6, dtype=torch.int32))
    with pytest.raises(ValueError, match="on meta"):
        sw.swiglu(g, u.to("meta"))


# ---------------------------------------------------------------------------------------------
# Devices: the same GPU, not just any GPU (fake CUDA tensors need no GPU)
# ---------------------------------------------------------------------------------------------


def test_fake_kernels_compare_device_index():
    be = SingleRankBackend(device="cuda:0")       # never allocated: only its spec is read
    be.spec = GroupSpec(R=1, E=EPN, S=6, K=2, token_padding=1, D=8, dtype=torch.float32,
                        backend="single")
    name = registry.register(be, "backend")
    try:
        with FakeTensorMode():
            for dev, ok in (("cuda:0", True), ("cuda:1", False)):
                x = torch.empty(4, 8, device=dev)
                t = torch.zeros(4, 2, dtype=torch.int32, device=dev)
                etc = torch.full((1, EPN), -1, dtype=torch.int32, device=dev)
                loc = [torch.empty(EPN, 3, device=dev)]
                slots = [torch.empty(EPN, 3, device=dev)]
                if ok:
                    ops.dispatch(x, t, None, name, -1)
                    ops.prefetch_weight(etc, loc, slots, name)
                    continue
                with pytest.raises(ValueError, match="cuda:1"):
                    ops.dispatch(x, t, None, name, -1)
                with pytest.raises(ValueError, match="cuda:1"):
                    ops.prefetch_weight(etc, loc, slots, name)
    finally:
        registry.unregister(name)


# ---------------------------------------------------------------------------------------------
# Buffer.expert_pool arguments
# ---------------------------------------------------------------------------------------------


def test_expert_pool_arguments():
    buf = _buffer()
    n = registry.live_count("pool")
    for D, F in ((0, 4), (8, -1), (8, True), (8.0, 4)):
        with pytest.raises(ValueError, match="positive int"):
            buf.expert_pool(D, F, torch.float32)
    with pytest.raises(TypeError, match="floating"):
        buf.expert_pool(8, 4, torch.int32)
    with pytest.raises(TypeError, match="floating"):
        buf.expert_pool(8, 4, "float32")
    assert registry.live_count("pool") == n
    assert buf.expert_pool(8, 4, torch.float32) is buf.expert_pool(8, 4, torch.float32)


# ---------------------------------------------------------------------------------------------
# NaN tokens are data: they travel to their slots and back, and touch nothing else
# ---------------------------------------------------------------------------------------------


def test_nan_tokens_are_just_data():
    buf = _buffer(S=6, K=3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, buf.D, generator=g)
    t = torch.tensor([[0, 1, 2], [3, 3, 0], [1, 2, 3], [0, 0, 0], [2, 1, 0]], dtype=torch.int32)
    w = torch.rand(5, 3, generator=g)
    x[1, 3] = float("nan")
    w[2, 1] = float("nan")
    h, wn, cu, plan = buf.dispatch(x, t, w)
    rows = plan.slot.view(5, 3)
    nan_rows = torch.isnan(h).any(1)
    assert set(nan_rows.nonzero().flatten().tolist()) == set(rows[1].tolist())
    assert torch.isnan(wn).sum() == 1 and torch.isnan(wn[rows[2, 1]])
    pad = torch.ones(h.shape[0], dtype=torch.bool)
    pad[rows.flatten()] = False
    assert bool((h[pad] == 0).all()) and bool((wn[pad] == 0).all())
    y, wk = buf.combine(plan, h, wn)
    assert torch.isnan(y[1]).sum() == 1 and not torch.isnan(y[[0, 2, 3, 4]]).any()
    ok = [0, 2, 3, 4]
    assert torch.equal(y[ok], x[ok] + x[ok] + x[ok])
    assert torch.isnan(wk[2, 1]) and torch.equal(wk[~torch.isnan(wk)], w[~torch.isnan(w)])


# ---------------------------------------------------------------------------------------------
# plan_all_ranks: one K for the group, a total that matches the ranks' tokens
# ---------------------------------------------------------------------------------------------


def test_plan_all_ranks_group_consistency():
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 8, (6, 2), generator=g, dtype=torch.int32)
    b = torch.randint(0, 8, (6, 3), generator=g, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"topk_per_rank\[1\] has K=3"):
        moonep_ops.plan_all_ranks([a, b], 8)
    with pytest.raises(ValueError, match="total_num_tokens=9"):
        moonep_ops.plan_all_ranks([a, a[:4]], 8, capacity=6, total_num_tokens=9)
    with pytest.raises(ValueError, match="total_num_tokens=11"):
        moonep_ops.plan_all_ranks([a, a], 8, total_num_tokens=11)
    res = moonep_ops.plan_all_ranks([a, a[:4]], 8, capacity=6, total_num_tokens=10)
    assert [p.s for p in res.plans] == [6, 4]
