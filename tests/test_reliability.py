"""Reliability under bad input: non-finite tokens on the FP8 path, meta tensors, ranks
that disagree on precision, use after destroy.  CPU; the multi-rank cases on real gloo ranks
(tests/dist_harness.py, R = 2; MOONEP_TEST_DIST=nccl runs them over NCCL, one GPU a rank) with
a short collective timeout, so a hang fails the case instead of the run, and every case ends
with a dispatch / combine round trip that proves the process group is still in step.

1. A NaN or an Inf in a token makes that token's FP8 tile NaN (tests/test_fp8_ops.py checks
   the quantisers), and the FP8 dispatch and the FP8 layer keep it to that token's rows and
   output: every other row and output is bitwise the clean run's, as on the bf16 path.
2. A meta tensor among real ones is refused with an error naming the argument and the rank,
   on every rank (the peers' error names the rank and its reason), nothing written; a call
   whose tensors are all meta is shape-only (meta outputs, nothing communicated).
3. Ranks whose layers differ in precision or pow2 scales raise the same ValueError when the
   layers bind (Buffer.expert_pool); direct dispatch / dispatch_fp8 / prefetch calls that
   disagree raise the same ValueError at the first exchange, never a gloo abort.
4. A destroyed Buffer's methods raise ValueError.
(The CUDA quantisers on non-finite input: tests/test_fp8_quant_cuda.py.)
"""
from __future__ import annotations

import pytest
import torch

import moonep_ops  # noqa: F401  (registers the ops)
from moonep_ops.buffer import Buffer
from moonep_ops.nn.moe import MoEArgs, MoonEPMoE
from moonep_ops.ops import quantize_fp8 as qf

try:
    from dist_harness import cached_runner, multi_rank_cases
except ImportError:                                    # imported as tests.test_reliability
    from tests.dist_harness import cached_runner, multi_rank_cases

ops = torch.ops.moonep
BF16 = torch.bfloat16
S, D, K, E, F, TP = 12, 160, 3, 8, 144, 4               # D, F: multiples of 16 (FP8 path)


def _buffer(group=None, **kw):
    a = dict(token_padding=TP, dtype=BF16)
    a.update(kw)
    return Buffer(S, D, K, E, group=group, **a)


def _inputs(rank, s=S, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(s, D, generator=g).to(BF16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)]).int()
    w = torch.softmax(torch.randn(s, K, generator=g), -1)
    return x.to(device), ids.to(device), w.to(device)


def _layer(buf, precision, pow2=False, seed=3, **settings):
    layer = MoonEPMoE.for_buffer(buf, F, precision=precision, fp8_pow2_scales=pow2, **settings)
    g = torch.Generator().manual_seed(seed)
    B, r = buf.epn, buf.rank
    with torch.no_grad():
        for w in (layer.w1, layer.w3, layer.w2):
            full = torch.randn(E, *w.shape[1:], generator=g) * 0.1
            w.copy_(full[r * B:(r + 1) * B])
    return layer


def _bits(t):
    return t.view({qf.FP8_DTYPE: torch.uint8, torch.float32: torch.int32,
                   BF16: torch.int16}.get(t.dtype, t.dtype))


def _bitwise(a, b):
    return a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# ---------------------------------------------------------------------------------------------
# 1. a non-finite token stays in its own rows and output (FP8 dispatch, FP8 layer)
# ---------------------------------------------------------------------------------------------

POISON = {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf")}


@pytest.mark.parametrize("kind", list(POISON))
@pytest.mark.parametrize("pow2", [False, True])
def test_dispatch_fp8_keeps_a_nonfinite_token_in_its_rows(kind, pow2):
    buf = _buffer()
    x, ids, w = _inputs(0)
    t, col = 4, 150                                    # token 4, its second 1 x 128 tile
    xp = x.clone()
    xp[t, col] = POISON[kind]
    h0, hs0, _, _, plan = buf.dispatch_fp8(x, ids, w, pow2_scales=pow2)
    h, hs, _, _, plan_p = buf.dispatch_fp8(xp, ids, w, pow2_scales=pow2)
    assert torch.equal(plan.dst, plan_p.dst)
    rows = plan.slot.view(S, K)[t].long()              # the token's K copies
    mine = torch.zeros(h.shape[0], dtype=torch.bool)
    mine[rows] = True
    # the poisoned tile of each copy: scale NaN, elements e4m3 NaN; its other tile as clean
    assert bool(hs[rows, 1].isnan().all()) and bool((_bits(h[rows, 128:]) == 0x7F).all())
    assert _bitwise(h[rows, :128], h0[rows, :128]) and _bitwise(hs[rows, 0], hs0[rows, 0])
    assert bool(qf.dequantize_rows(h[rows], hs[rows])[:, 128:].isnan().all())
    # every other row (other tokens, padding) bitwise the clean dispatch's
    assert _bitwise(h[~mine], h0[~mine]) and _bitwise(hs[~mine], hs0[~mine])
    buf.destroy()


@pytest.mark.parametrize("precision,pow2", [("bf16", False), ("fp8", False), ("fp8", True)])
def test_layer_keeps_a_nonfinite_token_in_its_output(precision, pow2):
    """The FP8 layer behaves as the bf16 one: the poisoned token's output row is non-finite,
    every other row is bitwise the clean forward's (before the fix, pow2 scales made an Inf
    token finite garbage)."""
    buf = _buffer()
    layer = _layer(buf, precision, pow2)
    x, ids, w = _inputs(0, seed=1)
    with torch.no_grad():
        clean = layer(x, topk_ids=ids, topk_weights=w)
        for t, val in ((2, float("inf")), (7, float("nan")), (9, -float("inf"))):
            xp = x.clone()
            xp[t, 5] = val
            out = layer(xp, topk_ids=ids, topk_weights=w)
            assert not bool(out[t].isfinite().any()), (t, val)
            others = torch.arange(S) != t
            assert _bitwise(out[others], clean[others]), (t, val)
    buf.destroy()


# ---------------------------------------------------------------------------------------------
# 2. meta tensors (one process): mixed calls refused, all-meta calls shape-only
# ---------------------------------------------------------------------------------------------

def _setup_single():
    buf = _buffer()
    x, ids, w = _inputs(0)
    h, wn, cu, plan = buf.dispatch(x, ids, w)
    return buf, x, ids, w, h, wn, cu, plan


def test_meta_among_real_tensors_is_refused_naming_argument_and_rank():
    buf, x, ids, w, h, wn, cu, plan = _setup_single()
    m = lambda t: t.to("meta")                         # noqa: E731
    cases = [
        ("topk_ids", lambda: buf.dispatch(x, m(ids), w)),
        ("route_weights", lambda: buf.dispatch(x, ids, m(w))),
        ("x", lambda: buf.dispatch(m(x), ids, w)),
        ("topk_ids", lambda: buf.dispatch_fp8(x, m(ids), w)),
        ("route_weights", lambda: buf.dispatch(x, route_weights_sK=m(w), plan=plan)),
        ("plan.dst", lambda: ops.dispatch_with_plan(x, w, m(plan.dst), buf.name, -1)),
        ("route_weights", lambda: buf.combine(plan, h, m(wn))),
        ("plan.dst", lambda: ops.combine(h, wn, m(plan.dst), buf.name, -1)),
    ]
    for arg, call in cases:
        with pytest.raises(ValueError, match=rf"{arg}.* on (meta|cpu).*rank 0"):
            call()
    # prefetch_weight / reduce_grad: nothing written (before, the meta call returned without
    # doing anything: stale slots, a grad never added)
    etc = plan.experts_to_copy
    loc = [torch.randn(buf.epn, 5), torch.randn(buf.epn, 7)]
    slots = [torch.full((buf.epn, 5), 3.0), torch.full((buf.epn, 7), 3.0)]
    snap = [t.clone() for t in loc + slots]
    with pytest.raises(ValueError, match=r"local_weights\[1\] is on meta .*rank 0"):
        buf.prefetch_weight(plan, local_weights=[loc[0], m(loc[1])], slot_weights=slots)
    with pytest.raises(ValueError, match=r"slot_grads\[0\] is on meta .*rank 0"):
        buf.reduce_grad(plan, local_grads=loc, slot_grads=[m(slots[0]), slots[1]])
    with pytest.raises(ValueError, match=r"experts_to_copy.* on (meta|cpu).*rank 0"):
        ops.prefetch_weight(m(etc), loc, slots, buf.name)
    assert all(torch.equal(a, b) for a, b in zip(loc + slots, snap))
    # the expert ops: refused before the pool's slots are staged
    pool = buf.expert_pool(D, F, BF16)
    w1 = torch.randn(buf.epn, F, D).to(BF16)
    w2 = torch.randn(buf.epn, D, F).to(BF16)
    before = [t.clone() for t in pool.tensors()]
    with pytest.raises(ValueError, match=r"moe_experts: w3 is on meta .*rank 0"):
        ops.moe_experts(h, cu, etc, w1, m(w1), w2, pool.name)
    assert all(torch.equal(a, b) for a, b in zip(pool.tensors(), before))
    buf.destroy()


def test_all_meta_calls_are_shape_only():
    """Every tensor on meta: the fake kernels answer with meta tensors of the real shapes,
    nothing is computed, written or communicated (documented: docs/api.md)."""
    buf, x, ids, w, h, wn, cu, plan = _setup_single()
    m = lambda t: t.to("meta")                         # noqa: E731
    hm, wm, cum, dst, etc, zf, st = ops.dispatch(m(x), m(ids), m(w), buf.name, -1)
    assert hm.is_meta and hm.shape == h.shape and dst.shape == plan.dst.shape
    y, wk = ops.combine(m(h), m(wn), m(plan.dst), buf.name, -1)
    assert y.is_meta and y.shape == x.shape and wk.shape == w.shape
    hq, hs, *_ = ops.dispatch_fp8(m(x), m(ids), m(w), buf.name, -1, True)
    assert hq.is_meta and hq.dtype == qf.FP8_DTYPE and hs.shape == (h.shape[0], 2)
    loc, slots = [torch.empty(buf.epn, 5, device="meta")], [torch.empty(buf.epn, 5, device="meta")]
    assert ops.prefetch_weight(m(plan.experts_to_copy), loc, slots, buf.name) is None
    buf.destroy()


# ---------------------------------------------------------------------------------------------
# 4. use after destroy
# ---------------------------------------------------------------------------------------------

def test_use_after_destroy_raises_value_error():
    buf, x, ids, w, h, wn, cu, plan = _setup_single()
    name = buf.name
    buf.destroy()
    buf.destroy()                                      # idempotent
    loc = [torch.zeros(buf.epn, 4)]
    calls = {
        "dispatch": lambda: buf.dispatch(x, ids, w),
        "dispatch_fp8": lambda: buf.dispatch_fp8(x, ids, w),
        "combine": lambda: buf.combine(plan, h),
        "prefetch_weight": lambda: buf.prefetch_weight(plan, local_weights=loc, slot_weights=loc),
        "reduce_grad": lambda: buf.reduce_grad(plan, local_grads=loc, slot_grads=loc),
        "expert_pool": lambda: buf.expert_pool(D, F, BF16),
        "symmetric_zeros": lambda: buf.symmetric_zeros((2, 2), torch.float32),
    }
    for op, call in calls.items():
        with pytest.raises(ValueError, match=rf"Buffer.{op}: .*\(rank 0\) was destroyed"):
            call()
    with pytest.raises(ValueError, match="no live moonep"):   # the ops, by the stale name
        ops.dispatch(x, ids, w, name, -1)


# ---------------------------------------------------------------------------------------------
# 2 and 3 on gloo ranks
# ---------------------------------------------------------------------------------------------

def _round_trip(ctx):
    """The group is still in step: a fresh Buffer, dispatch, combine (K copies added)."""
    buf = _buffer(ctx.group, dtype=torch.float32, device=ctx.device)
    x, ids, w = _inputs(ctx.rank, seed=9, device=ctx.device)
    x = x.float()
    h, _, _, plan = buf.dispatch(x, ids, w)
    y, _ = buf.combine(plan, h)
    assert torch.equal(y, x + x + x)
    buf.destroy()


def _every_rank_raises(ctx, call_bad, call_good, own, peers, exc=ValueError):
    """The last rank runs ``call_bad``, the others ``call_good``: the last rank raises ``exc``
    matching ``own``, every other rank a ValueError matching ``peers``."""
    last = ctx.rank == ctx.R - 1
    if last:
        with pytest.raises(exc, match=own):
            call_bad()
    else:
        with pytest.raises(ValueError, match=peers):
            call_good()


def _group_setup(ctx):
    buf = _buffer(ctx.group, backend="torch", device=ctx.device)
    x, ids, w = _inputs(ctx.rank, device=ctx.device)
    return buf, x, ids, w


DEV = r"(cpu|cuda:\d+)"           # the cases run on gloo (CPU) or NCCL (MOONEP_TEST_DIST=nccl)


def case_meta_topk_ids_on_one_rank(ctx):
    buf, x, ids, w = _group_setup(ctx)
    r = ctx.R - 1
    _every_rank_raises(ctx, lambda: buf.dispatch(x, ids.to("meta"), w),
                       lambda: buf.dispatch(x, ids, w),
                       rf"topk_ids \[s, K\] is on meta .*\(moonep dispatch, rank {r}\)",
                       rf"moonep dispatch: rank {r} rejected its input \(ValueError: topk_ids")
    _round_trip(ctx)


def case_meta_route_weights_on_one_rank(ctx):
    buf, x, ids, w = _group_setup(ctx)
    r = ctx.R - 1
    _every_rank_raises(ctx, lambda: buf.dispatch_fp8(x, ids, w.to("meta")),
                       lambda: buf.dispatch_fp8(x, ids, w),
                       rf"route_weights \[s, K\] is on meta .*rank {r}",
                       rf"moonep dispatch_fp8: rank {r} rejected its input .*route_weights")
    _round_trip(ctx)


def case_meta_in_combine_and_plan_reuse(ctx):
    buf, x, ids, w = _group_setup(ctx)
    r = ctx.R - 1
    h, wn, cu, plan = buf.dispatch(x, ids, w)
    _every_rank_raises(ctx, lambda: buf.combine(plan, h.to("meta"), wn),
                       lambda: buf.combine(plan, h, wn),
                       rf"is on {DEV} but h is on meta.*rank {r}",
                       rf"moonep combine: rank {r} rejected its input")
    _every_rank_raises(ctx, lambda: buf.dispatch(x.to("meta"), route_weights_sK=w, plan=plan),
                       lambda: buf.dispatch(x, route_weights_sK=w, plan=plan),
                       rf"on ({DEV}|meta) .* x is on meta.*rank {r}",
                       rf"moonep dispatch_with_plan: rank {r} rejected its input")
    y, _ = buf.combine(plan, h, wn)                    # the Buffer itself still works
    assert y.shape == x.shape
    _round_trip(ctx)


def case_meta_weights_in_prefetch_and_reduce(ctx):
    """prefetch_weight with meta local weights and reduce_grad with meta slot grads on one
    rank: every rank raises, no rank's slots or grads change."""
    buf, x, ids, w = _group_setup(ctx)
    r = ctx.R - 1
    last = ctx.rank == r
    _, _, _, plan = buf.dispatch(x, ids, w)
    dev = ctx.device
    loc = [torch.randn(buf.epn, 6, device=dev), torch.randn(buf.epn, 2, 3, device=dev)]
    slots = [torch.full((buf.epn, 6), 5.0, device=dev),
             torch.full((buf.epn, 2, 3), 5.0, device=dev)]
    snap = [t.clone() for t in loc + slots]
    bad_loc = [loc[0].to("meta"), loc[1]] if last else loc
    _every_rank_raises(ctx,
                       lambda: buf.prefetch_weight(plan, local_weights=bad_loc, slot_weights=slots),
                       lambda: buf.prefetch_weight(plan, local_weights=loc, slot_weights=slots),
                       rf"local_weights\[0\] is on meta .*rank {r}",
                       rf"moonep prefetch_weight: rank {r} rejected its input .*local_weights")
    bad_slots = [slots[0], slots[1].to("meta")] if last else slots
    _every_rank_raises(ctx,
                       lambda: buf.reduce_grad(plan, local_grads=loc, slot_grads=bad_slots),
                       lambda: buf.reduce_grad(plan, local_grads=loc, slot_grads=slots),
                       rf"slot_grads\[1\] is on meta .*rank {r}",
                       rf"moonep reduce_grad: rank {r} rejected its input .*slot_grads")
    assert all(torch.equal(a, b) for a, b in zip(loc + slots, snap)), "nothing written"
    buf.prefetch_weight(plan, local_weights=loc, slot_weights=slots)    # still in step
    _round_trip(ctx)


def case_meta_weight_in_the_expert_op(ctx):
    buf, x, ids, w = _group_setup(ctx)
    r = ctx.R - 1
    layer = _layer(buf, "bf16")
    h, wn, cu, plan = buf.dispatch(x, ids, w)
    ws = [layer.w1.detach(), layer.w3.detach(), layer.w2.detach()]
    bad = [ws[0].to("meta")] + ws[1:]
    _every_rank_raises(ctx, lambda: ops.moe_experts(h, cu, plan.experts_to_copy, *bad,
                                                    layer.pool_name),
                       lambda: ops.moe_experts(h, cu, plan.experts_to_copy, *ws, layer.pool_name),
                       rf"moe_experts: w1 is on meta .*\(moonep moe_experts, rank {r}\)",
                       rf"moonep prefetch_weight: rank {r} rejected its input .*w1 is on meta")
    y, _, _ = ops.moe_experts(h, cu, plan.experts_to_copy, *ws, layer.pool_name)
    assert y.shape == h.shape
    _round_trip(ctx)


def case_other_argument_errors_reach_every_rank(ctx):
    """Not only devices: a wrong dtype in the op, a wrong type in the Buffer method."""
    buf, x, ids, w = _group_setup(ctx)
    r = ctx.R - 1
    _every_rank_raises(ctx, lambda: buf.dispatch(x, ids.long(), w),
                       lambda: buf.dispatch(x, ids, w),
                       rf"topk_ids \[s, K\] must be torch.int32.*rank {r}",
                       rf"rank {r} rejected its input \(TypeError: topk_ids", exc=TypeError)
    _every_rank_raises(ctx, lambda: buf.dispatch(x, ids, w, total_num_tokens="all"),
                       lambda: buf.dispatch(x, ids, w),
                       rf"total_num_tokens must be an int.*rank {r}",
                       rf"rank {r} rejected its input \(TypeError: total_num_tokens",
                       exc=TypeError)
    _round_trip(ctx)


def case_layers_differ_in_precision(ctx):
    """One misconfigured launch: rank 0 builds its layer in fp8, the others in bf16.  Every
    rank raises the same ValueError when the layer binds (before: the first dispatch aborted
    the process inside gloo)."""
    buf = _buffer(ctx.group, backend="torch", device=ctx.device)
    want = r"the ranks disagree on precision \(rank 0: fp8, rank 1: bf16"
    with pytest.raises(ValueError, match=want):
        _layer(buf, "fp8" if ctx.rank == 0 else "bf16")
    with pytest.raises(ValueError, match=r"disagree on pow2_scales \(rank 0: True, rank 1: False"):
        _layer(buf, "fp8", pow2=ctx.rank == 0)
    layer = _layer(buf, "fp8")                         # agreeing layers bind and run
    x, ids, w = _inputs(ctx.rank, device=ctx.device)
    with torch.no_grad():
        assert layer(x, topk_ids=ids, topk_weights=w).shape == x.shape
    _round_trip(ctx)


def case_layers_differ_in_expert_settings(ctx):
    """Expert biases on rank 0 only (its prefetch_weight would move 3 more tensors: the exchange
    hangs or aborts), fp8_wgrad or the clamp on one rank (slot grads of other math summed into
    their owners'): every rank raises the same ValueError when the layer binds."""
    buf = _buffer(ctx.group, backend="torch", device=ctx.device)
    want = r"the ranks disagree on expert settings \(expert_bias, activation, swiglu_alpha, " \
           r"swiglu_limit, fp8_wgrad\) \(rank 0: \(%s"
    with pytest.raises(ValueError, match=want % r"True, 'swiglu', None, None, False\), rank 1: "
                       r"\(False, 'swiglu'"):
        _layer(buf, "bf16", expert_bias=ctx.rank == 0)
    with pytest.raises(ValueError, match=want % r"False, 'swiglu', None, None, True\)"):
        _layer(buf, "fp8", fp8_wgrad=ctx.rank == 0)
    clamped = dict(activation="swiglu_clamped", swiglu_limit=7.0 if ctx.rank == 0 else 5.0)
    with pytest.raises(ValueError, match=want % r"False, 'swiglu_clamped', 1.702, 7.0, False"):
        _layer(buf, "bf16", **clamped)
    # an alpha the plain SwiGLU does not read is no disagreement
    layer = _layer(buf, "bf16", swiglu_alpha=1.0 if ctx.rank == 0 else 2.0)
    x, ids, w = _inputs(ctx.rank, device=ctx.device)
    with torch.no_grad():
        assert layer(x, topk_ids=ids, topk_weights=w).shape == x.shape
    _round_trip(ctx)


def case_layer_invalid_on_one_rank(ctx):
    """A rank whose layer fails a local check when it binds (its top-k is not the Buffer's)
    still takes part in the pools' exchange: it raises its own error, its peers one naming
    it."""
    buf = _buffer(ctx.group, backend="torch", device=ctx.device)
    r = ctx.R - 1

    def bind(k):
        layer = MoonEPMoE(MoEArgs(num_experts=E, top_k=k), D, F, dtype=BF16)
        return layer.bind(buf)

    _every_rank_raises(ctx, lambda: bind(K + 1), lambda: bind(K),
                       r"the Buffer has \(D, K, E, dtype\)",
                       rf"rank {r} rejected its expert pool arguments \(ValueError: the Buffer has")
    _round_trip(ctx)


def case_dispatch_rows_differ_in_format(ctx):
    """Direct Buffer calls: dispatch_fp8 on one rank and dispatch on another, or pow2 scales
    on one rank only: the same ValueError on every rank at the histogram exchange."""
    buf, x, ids, w = _group_setup(ctx)
    with pytest.raises(ValueError, match=r"disagree on the rows' format \(rank 0: FP8 rows "
                                         r"\(dispatch_fp8\), rank 1: rows in the Buffer's dtype"):
        if ctx.rank == 0:
            buf.dispatch_fp8(x, ids, w)
        else:
            buf.dispatch(x, ids, w)
    with pytest.raises(ValueError, match=r"disagree on the rows' format \(rank 0: FP8 rows with "
                                         r"pow2 scales"):
        buf.dispatch_fp8(x, ids, w, pow2_scales=ctx.rank == 0)
    h, hs, _, _, plan = buf.dispatch_fp8(x, ids, w, pow2_scales=True)     # agreeing calls run
    assert h.dtype == qf.FP8_DTYPE
    _round_trip(ctx)


def case_prefetch_tensors_differ(ctx):
    """prefetch_weight of an fp8 pool's six tensors on rank 0, a bf16 pool's three elsewhere:
    the same ValueError on every rank before the all-to-all."""
    buf, x, ids, w = _group_setup(ctx)
    _, _, _, plan = buf.dispatch(x, ids, w)
    n = 6 if ctx.rank == 0 else 3
    loc = [torch.randn(buf.epn, 4, device=ctx.device) for _ in range(n)]
    slots = [torch.zeros(buf.epn, 4, device=ctx.device) for _ in range(n)]
    with pytest.raises(ValueError, match=r"prefetch_weight: the ranks disagree on the call and "
                                         r"its tensors .*rank 0: prefetch_weight, 6 tensors"):
        buf.prefetch_weight(plan, local_weights=loc, slot_weights=slots)
    assert all(bool((t == 0).all()) for t in slots), "nothing written"
    _round_trip(ctx)


def case_fp8_layer_nonfinite_token_on_one_rank(ctx):
    """1. over gloo: an Inf in a token of the last rank (pow2 scales: the case that became
    finite garbage before); every output row of every rank but that token's is bitwise the
    clean forward's."""
    buf = _buffer(ctx.group, backend="torch", device=ctx.device)
    layer = _layer(buf, "fp8", pow2=True)
    x, ids, w = _inputs(ctx.rank, seed=2, device=ctx.device)
    with torch.no_grad():
        clean = layer(x, topk_ids=ids, topk_weights=w)
        xp = x.clone()
        if ctx.rank == ctx.R - 1:
            xp[3, 140] = float("inf")
        out = layer(xp, topk_ids=ids, topk_weights=w)
    keep = torch.ones(S, dtype=torch.bool, device=ctx.device)
    if ctx.rank == ctx.R - 1:
        keep[3] = False
        assert not bool(out[3].isfinite().any())
    assert _bitwise(out[keep], clean[keep])
    _round_trip(ctx)


MULTI_RANK = multi_rank_cases(globals(), ranks=(2,))
# A hang shows as a timeout of the whole spawn: a short collective timeout, a deadline.
_results = cached_runner(__name__, MULTI_RANK, timeout_s=400, pg_timeout_s=30)


@pytest.mark.parametrize("R,case", MULTI_RANK)
def test_multi_rank(R, case):
    res = _results(R)[case]
    assert res.ok, res.error
