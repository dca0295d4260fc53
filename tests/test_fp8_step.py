"""The FP8 expert op with the weight cache and the FP8 wgrad, on real gloo ranks (CPU
reference kernels):

  * with an FP8WeightCache, moe_experts_fp8 and its backward give bitwise the results of the op
    that quantises on every call (R = 1, 2, 4: the slots are filled from the cache by prefetch),
    over several optimizer steps with several micro-batches each; every micro-batch after the
    first of a step reuses the cache, and a stale weight is never used after an update;
  * fp8_wgrad=True changes the weight grads only (dx and the route-weight grads bitwise those of
    the bf16-wgrad backward), which stay within the FP8 tolerance of the bf16 wgrads, and at
    R = 1 equal bitwise the recipe written out from the references (dw1 = q(dg)^T q(h), dw3 =
    q(du)^T q(h), dw2 = q(dy)^T q(a), every operand quantised along each group's tokens).
"""
from __future__ import annotations

import pytest
import torch

import moonep_ops  # noqa: F401
from moonep_ops.buffer import Buffer
from moonep_ops.ops import grouped_mm_fp8 as g8
from moonep_ops.ops import grouped_mm_fp8_wgrad as gw
from moonep_ops.ops import quantize_fp8 as qf
from moonep_ops.ops import quantize_fp8_tokens as qt
from moonep_ops.ops.fp8_weight_cache import FP8WeightCache
from moonep_ops.ops.swiglu import swiglu_backward

try:
    from dist_harness import cached_runner, multi_rank_cases
    from test_fp8_layer import BF16, D, E, F, K, S, TP, _rel, _route, make_layer, tokens
except ImportError:                                    # imported as tests.test_fp8_step
    from tests.dist_harness import cached_runner, multi_rank_cases
    from tests.test_fp8_layer import BF16, D, E, F, K, S, TP, _rel, _route, make_layer, tokens


def _run(layer, buf, x, w, ids, seed, pow2, cache="", fp8_wgrad=False):
    h, hs, wM, cu, plan = buf.dispatch_fp8(x, ids, w, pow2_scales=pow2)
    ws = (layer.w1, layer.w3, layer.w2)
    out = torch.ops.moonep.moe_experts_fp8(h, hs, wM, cu, plan.experts_to_copy, *ws,
                                           layer.pool_name, x, w, plan.dst,
                                           plan.total_num_tokens, pow2, cache, fp8_wgrad)
    z, y, g, u = out
    dz = torch.randn(z.shape, generator=torch.Generator().manual_seed(seed)).to(BF16)
    grads = torch.ops.moonep.moe_experts_fp8_backward(
        dz, h, hs, wM, y, g, u, cu, plan.experts_to_copy, *ws, layer.pool_name, plan.dst,
        plan.total_num_tokens, pow2, cache, fp8_wgrad)
    # grads[5]: the bias grads, [] here
    return [z, y, g, u], list(grads[:5]), (h, hs, wM, cu, plan, y, g, u)


def _ids(r, step):
    # every rank sends most tokens to experts 0..2 (rank 0's at R >= 2): redundant slots run
    g = torch.Generator().manual_seed(100 * step + r)
    ids = torch.randint(0, E, (S, K), generator=g, dtype=torch.int32)
    ids[: S * 2 // 3] = torch.tensor([0, 1, 2], dtype=torch.int32)
    return ids


def _cache_matches_no_cache(ctx, pow2):
    buf = Buffer(S, D, K, E, group=ctx.group, token_padding=TP, dtype=BF16)
    try:
        layer = make_layer(buf, "fp8", fp8_pow2_scales=pow2)
        B = layer.w1.shape[0]
        cache = FP8WeightCache(B, F, D, pow2_scales=pow2)
        cache.bind(layer.w1, layer.w3, layer.w2)
        for step in range(3):
            for mb in range(3):                              # gradient accumulation
                x, _ = tokens(ctx.rank, S, seed=10 * step + mb)
                _, w = _route(x)
                ids = _ids(ctx.rank, 10 * step + mb)
                # the same dispatch, plan and rows for both runs (R > 1: collective order)
                for fw in (False, True):
                    o0, g0, _ = _run(layer, buf, x, w, ids, mb, pow2, "", fw)
                    o1, g1, _ = _run(layer, buf, x, w, ids, mb, pow2, cache.name, fw)
                    for a, b in zip(o0 + g0, o1 + g1):
                        assert torch.equal(a, b), (step, mb, fw)
            # one quantisation per layout per step, whatever the micro-batches
            assert cache.refreshes == {"fwd": step + 1, "bwd": step + 1}, cache.refreshes
            with torch.no_grad():                            # the optimizer step
                for p in (layer.w1, layer.w3, layer.w2):
                    p.sub_(0.05 * torch.randn_like(p))
    finally:
        buf.destroy()


def case_cache_equals_no_cache(ctx):
    _cache_matches_no_cache(ctx, False)


def case_cache_equals_no_cache_pow2(ctx):
    _cache_matches_no_cache(ctx, True)


def case_fp8_wgrad_changes_only_the_weight_grads(ctx):
    buf = Buffer(S, D, K, E, group=ctx.group, token_padding=TP, dtype=BF16)
    try:
        layer = make_layer(buf, "fp8")
        x, _ = tokens(ctx.rank, S)
        _, w = _route(x)
        ids = _ids(ctx.rank, 0)
        _, gb, _ = _run(layer, buf, x, w, ids, 3 + ctx.rank, False, "", False)
        _, gf, st = _run(layer, buf, x, w, ids, 3 + ctx.rank, False, "", True)
        assert torch.equal(gb[0], gf[0]) and torch.equal(gb[1], gf[1])      # dx, d route w
        rel = [_rel(a, b) for a, b in zip(gf[2:], gb[2:])]
        assert all(5e-3 < r < 8e-2 for r in rel), rel
        if ctx.R == 1:                # the recipe written out (home experts only: no slots)
            h, hs, wM, cu, plan, y, g, u = st
            dz = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(BF16)
            dyb = (dz.float() * wM[:, None]).to(BF16)
            dq, ds = qf.quantize_rows(dyb)
            w2t = qf.quantize_blocks(layer.w2.detach(), False, True)
            da = g8.reference_fp8(dq, ds, *w2t, *w2t, cu)
            dg, du, a = swiglu_backward(g, u, da)
            tok = qt.quantize_tokens
            hT = tok(h, cu, hs)
            want = [gw.reference_fp8_wgrad(*tok(dg, cu), *hT, cu, E)[0],
                    gw.reference_fp8_wgrad(*tok(du, cu), *hT, cu, E)[0],
                    gw.reference_fp8_wgrad(*tok(dyb, cu), *tok(a, cu), cu, E)[0]]
            for got, ref in zip(gf[2:], want):
                assert torch.equal(got, ref)
    finally:
        buf.destroy()


MULTI_RANK = multi_rank_cases(globals(), ranks=(1, 2, 4))
_results = cached_runner(__name__, MULTI_RANK, timeout_s=600, pg_timeout_s=60)


@pytest.mark.parametrize("R,case", MULTI_RANK)
def test_multi_rank(R, case):
    res = _results(R)[case]
    assert res.ok, res.error


def test_cache_argument_errors():
    from moonep_ops.ops import moe_experts_fp8 as m8
    buf = Buffer(S, D, K, E, token_padding=TP, dtype=BF16)
    try:
        layer = make_layer(buf, "fp8")
        x, _ = tokens(0, S)
        ids, w = _route(x)
        h, hs, wM, cu, plan = buf.dispatch_fp8(x, ids, w)
        args = [h, hs, wM, cu, plan.experts_to_copy, layer.w1, layer.w3, layer.w2,
                layer.pool_name, x, w, plan.dst, plan.total_num_tokens, False]
        wrong = FP8WeightCache(E, F, 176)
        with pytest.raises(ValueError, match="weight cache holds"):
            torch.ops.moonep.moe_experts_fp8(*args, wrong.name, False)
        pow2 = FP8WeightCache(E, F, D, pow2_scales=True)
        with pytest.raises(ValueError, match="pow2_scales"):
            torch.ops.moonep.moe_experts_fp8(*args, pow2.name, False)
        with pytest.raises(ValueError, match="no live"):
            torch.ops.moonep.moe_experts_fp8(*args, "moonep_fp8cache_nope", False)
        assert m8  # the module is importable beside the ops
    finally:
        buf.destroy()


# ---------------------------------------------------------------------------------------------
# the layer: MoEArgs(precision="fp8", fp8_weight_cache=..., fp8_wgrad=...) (both opt-in for now)
# ---------------------------------------------------------------------------------------------

def _train(cache: bool, attach: bool = False, steps=3, micro=2):
    from moonep_ops.nn.moe import attach_fp8_weight_caches
    buf = Buffer(S, D, K, E, token_padding=TP, dtype=BF16)
    try:
        layer = make_layer(buf, "fp8", fp8_weight_cache=cache)
        opt = torch.optim.AdamW([layer.w1, layer.w3, layer.w2], lr=1e-2)
        if attach:
            attach_fp8_weight_caches(layer, opt)
        out = []
        for step in range(steps):
            for mb in range(micro):
                x, gy = tokens(0, S, seed=10 * step + mb)
                y = layer(x)
                (y.float() * gy).sum().backward()
                out.append(y.detach())
            out += [layer.w1.grad.clone(), layer.w2.grad.clone()]
            opt.step()
            opt.zero_grad()
        return out, layer.fp8_cache
    finally:
        buf.destroy()


def test_layer_defaults_and_training_never_reads_a_stale_weight():
    from moonep_ops.nn.moe import MoEArgs
    # off by default until the CUDA layer matches its CPU reference (tests/test_fp8_wgrad_cuda.py)
    assert not MoEArgs().fp8_weight_cache and not MoEArgs().fp8_wgrad
    ref, none = _train(cache=False)
    assert none is None
    got, cache = _train(cache=True)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)              # every step's outputs and grads: bitwise
    assert cache.refreshes == {"fwd": 3, "bwd": 3}   # once per step, not per micro-batch
    got2, cache2 = _train(cache=True, attach=True)
    for a, b in zip(got2, ref):
        assert torch.equal(a, b)
    # the first micro-batch computed it, the post-hook refreshed it after each of the 3 steps,
    # and no forward or backward recomputed it
    assert cache2.refreshes == {"fwd": 4, "bwd": 4}


def test_layer_cache_is_state_free_and_checked():
    from moonep_ops.nn.moe import MoEArgs, MoonEPMoE
    buf = Buffer(S, D, K, E, token_padding=TP, dtype=BF16)
    try:
        assert make_layer(buf, "fp8").fp8_cache is None          # opt-in
        layer = make_layer(buf, "fp8", fp8_weight_cache=True)
        assert isinstance(layer.fp8_cache, FP8WeightCache)
        assert not [k for k in layer.state_dict() if "fp8_cache" in k]
        assert layer.fp8_cache.nbytes() == sum(b.numel() * b.element_size()
                                               for n, b in layer.named_buffers()
                                               if n.startswith("fp8_cache."))
        assert make_layer(buf, "bf16").fp8_cache is None
        layer.refresh_fp8_weights()
        assert layer.fp8_cache.is_fresh(layer.w1, layer.w3, layer.w2, transpose=True)
        with pytest.raises(TypeError, match="fp8_wgrad"):
            MoonEPMoE(MoEArgs(num_experts=E, top_k=K, fp8_wgrad=1), D, F, dtype=BF16)
    finally:
        buf.destroy()
