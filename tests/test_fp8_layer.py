"""The FP8 expert path end to end on real gloo ranks (CPU reference kernels): dispatch_fp8
against quantise-after-bf16-dispatch, the precision="fp8" layer against the bf16 layer,
torch.compile of the FP8 layer, and the bytes a token and an expert move (computed from the
tensors the Buffer really returns / allocates).

Tolerance of the layer comparison.  e4m3 keeps 3 mantissa bits: a quantised operand carries
~2.6 % RMS relative error, a GEMM with both operands quantised ~3.7 %, and the layer stacks
three of them plus the SwiGLU requantisation: ~6 % RMS on the output and on every grad against
the bf16 layer at these random weights (measured 5-8 %).  So the bound here is rel 1.2e-1 (Frobenius
norm of the difference over the bf16 value's), and a lower bound of 5e-3 proves the FP8 path
really ran.  The op-level exactness (reference == dequantise-then-matmul, fused == unfused
bitwise) is tests/test_fp8_ops.py's.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import moonep_ops  # noqa: F401
from moonep_ops.buffer import Buffer
from moonep_ops.nn.moe import MoEArgs, MoonEPMoE
from moonep_ops.testing.train_step import enable_backward_tracing, grads_with_and_without_input_grad
from moonep_ops.ops import quantize_fp8 as qf

try:
    from dist_harness import cached_runner, multi_rank_cases
except ImportError:                                    # imported as tests.test_fp8_layer
    from tests.dist_harness import cached_runner, multi_rank_cases

D, F, E, K, TP, S = 160, 144, 8, 3, 4, 12       # D, F: multiples of 16 ending in a cut-short tile
BF16 = torch.bfloat16
LAYER_TOL = 1.2e-1


def full_weights(seed=7):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, F, D, generator=g) * 0.1
    w3 = torch.randn(E, F, D, generator=g) * 0.1
    w2 = torch.randn(E, D, F, generator=g) * 0.1
    gate = torch.randn(E, D, generator=g) * 0.3
    gate[0, 0] += 2.0          # x[:, 0] is shifted below: expert 0 is hot -> redundant slots
    return w1, w3, w2, gate


def tokens(r, s, seed=11):
    g = torch.Generator().manual_seed(seed * 100 + r)
    x = torch.randn(s, D, generator=g)
    x[:, 0] += 2.0
    return x.to(BF16), torch.randn(s, D, generator=g)


def make_layer(buf, precision, **kw):
    B = E // buf.R
    w1, w3, w2, gate = full_weights()
    layer = MoonEPMoE.for_buffer(buf, F, precision=precision, **kw)
    with torch.no_grad():
        sl = slice(buf.rank * B, (buf.rank + 1) * B)
        layer.w1.copy_(w1[sl])
        layer.w3.copy_(w3[sl])
        layer.w2.copy_(w2[sl])
        layer.router.gate.weight.copy_(gate)
    return layer


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _route(x):
    _, _, _, gate = full_weights()
    scores = torch.softmax(x.float() @ gate.t(), -1)
    w, ids = torch.topk(scores, K, dim=-1)
    return ids.int().contiguous(), w.contiguous()


# ---------------------------------------------------------------------------------------------
# dispatch_fp8 == quantise(dispatch(x)) row by row
# ---------------------------------------------------------------------------------------------

def _dispatch_equivalence(ctx, sizes, pow2):
    R, r = ctx.R, ctx.rank
    total = sum(sizes) if len(set(sizes)) > 1 else None
    buf = Buffer(S, D, K, E, group=ctx.group, token_padding=TP, dtype=BF16)
    x, _ = tokens(r, sizes[r])
    ids, w = _route(x)
    h8, hs, w8, cu8, p8 = buf.dispatch_fp8(x, ids, w, total_num_tokens=total, pow2_scales=pow2)
    hb, wb, cub, pb = buf.dispatch(x, ids, w, total_num_tokens=total)
    # the same plan, slots and weights
    for a, b in ((cu8, cub), (p8.dst, pb.dst), (p8.experts_to_copy, pb.experts_to_copy),
                 (w8, wb)):
        assert torch.equal(a, b)
    assert h8.dtype == qf.FP8_DTYPE and hs.dtype == torch.float32
    assert h8.shape == hb.shape and hs.shape == (hb.shape[0], qf.scale_cols(D))
    # quantisation is row-local and dispatch copies rows bitwise: every slot row is the
    # quantisation of the bf16 row dispatch puts there
    qb, sb = qf.quantize_rows(hb, pow2)
    assert torch.equal(h8.view(torch.uint8), qb.view(torch.uint8))
    real = wb > 0                                  # softmax weights: every routed row is > 0
    assert torch.equal(hs[real], sb[real])
    assert torch.all(hs[~real] == 0), "padding rows carry zero scales"
    # the source rank quantised once: the scales of its own rows are those of x
    xq, xsc = qf.quantize_rows(x, pow2)
    if pow2:
        assert torch.all(torch.frexp(hs[real])[0] == 0.5), "pow2 scales are powers of two"
    # combine stays in the Buffer's dtype (bf16) with fp32 accumulation
    y8, _ = buf.combine(p8, qf.dequantize_rows(h8, hs).to(BF16))
    yb, _ = buf.combine(pb, qf.dequantize_rows(qb, sb).to(BF16))
    assert y8.dtype == BF16 and torch.equal(y8, yb)
    del xq, xsc


def case_dispatch_fp8_plan_equals_dispatch_plan_every_policy(ctx):
    """One Plan constructor for every precision: on the same routing, dispatch_fp8's plan equals
    dispatch's field by field (tensors and ints, slack_ppm included) under every policy."""
    from moonep_ops.planner import Plan
    r = ctx.rank
    for policy, kw in (("moonep", {}), ("lean", {}),
                       ("cost", dict(slack=0.25, expert_dim=64, replica_cost=3))):
        buf = Buffer(S, D, K, E, group=ctx.group, token_padding=TP, dtype=BF16, policy=policy,
                     **kw)
        try:
            x, _ = tokens(r, S)
            ids, w = _route(x)
            p8 = buf.dispatch_fp8(x, ids, w)[-1]
            pb = buf.dispatch(x, ids, w)[-1]
            assert p8.slack_ppm == buf.slack_ppm == (250_000 if policy == "cost" else 0)
            for name in Plan._fields:
                a, b = getattr(p8, name), getattr(pb, name)
                same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                assert same, (policy, name)
        finally:
            buf.destroy()


def case_dispatch_fp8_full(ctx):
    _dispatch_equivalence(ctx, [S] * ctx.R, False)


def case_dispatch_fp8_pow2_per_rank(ctx):
    _dispatch_equivalence(ctx, [(5, 12, 1, 9)[q % 4] for q in range(ctx.R)], True)


# ---------------------------------------------------------------------------------------------
# the precision="fp8" layer against the bf16 layer
# ---------------------------------------------------------------------------------------------

def _layer_vs_bf16(ctx, sizes, pow2=False):
    R, r = ctx.R, ctx.rank
    total = sum(sizes) if len(set(sizes)) > 1 else None
    buf = Buffer(S, D, K, E, group=ctx.group, token_padding=TP, dtype=BF16)
    got = {}
    for prec in ("bf16", "fp8"):
        layer = make_layer(buf, prec, fp8_pow2_scales=pow2 and prec == "fp8")
        x, gy = tokens(r, sizes[r])
        x.requires_grad_(True)
        out = layer(x, total_num_tokens=total)
        (out.float() * gy).sum().backward()
        layer.reduce_router_grad()
        got[prec] = {"out": out, "dx": x.grad, "router": layer.router.gate.weight.grad,
                     "w1": layer.w1.grad, "w3": layer.w3.grad, "w2": layer.w2.grad}
        assert out.dtype == BF16 and layer.w1.grad.dtype == BF16
    rel = {k: _rel(got["fp8"][k], got["bf16"][k]) for k in got["bf16"]}
    bad = {k: v for k, v in rel.items() if not 5e-3 < v < LAYER_TOL}
    assert not bad, (sizes, rel)
    if R > 1 and sizes[0] == S:          # the hot expert forced redundant slots: FP8 prefetch ran
        ids, _ = _route(tokens(r, sizes[r])[0])
        assert buf._pools, "no pool"
    return rel


def case_layer_fp8_full(ctx):
    _layer_vs_bf16(ctx, [S] * ctx.R)


def case_layer_fp8_per_rank_pow2(ctx):
    _layer_vs_bf16(ctx, [(5, 12, 1, 9)[q % 4] for q in range(ctx.R)], pow2=True)


def case_layer_fp8_compile(ctx):
    """fullgraph compile of the fp8 layer, forward and backward: no graph break, no recompile on
    new routing.  aot_eager (the captured graph run op by op): bitwise eager.  inductor fuses
    the bf16 glue around the ops (router, route-weight multiply) and may round an intermediate
    differently; one bf16 ulp can move an e4m3 rounding by 2^-3 of its value, so inductor is
    held to rel 3e-2 (norm) against eager instead."""
    enable_backward_tracing()
    buf = Buffer(S, D, K, E, group=ctx.group, token_padding=TP, dtype=BF16)
    layer = make_layer(buf, "fp8")
    for backend, tol in (("aot_eager", 0.0), ("inductor", 3e-2)):
        counters.clear()
        torch._dynamo.reset()
        cl = torch.compile(layer, fullgraph=True, backend=backend)
        for seed in range(2):
            x, gy = tokens(ctx.rank, S, seed=seed)
            res = []
            for fn in (cl, layer):
                xr = x.clone().requires_grad_(True)
                out = fn(xr)
                (out.float() * gy).sum().backward()
                res.append((out.detach(), xr.grad))
            for a, b in zip(*res):
                if tol == 0.0:
                    assert torch.equal(a, b), backend
                else:
                    assert _rel(a, b) < tol, (backend, _rel(a, b))
            if seed == 0:
                torch.compiler.set_stance("fail_on_recompile")
        torch.compiler.set_stance("default")
        assert not counters["graph_break"], dict(counters["graph_break"])
    layer.zero_grad()


def _backward_with_transposes(dz, h, hs, wM, y, g, u, cu, etc, w1, w3, w2, pool, dst, total,
                              pow2):
    """The FP8 backward as it was written before the transposed quantiser: weights quantised
    in their own layout, pushed into the slots as they are, grouped_mm_fp8_dgrad (which reads
    W_g, not W_g^T)."""
    from moonep_ops.ops import moe_experts_fp8 as m8
    from moonep_ops.ops.swiglu import swiglu_backward
    p = m8._pool(pool)
    q1, s1, q3, s3, q2, s2 = m8.quantised_weights(w1, w3, w2, pow2)
    m8._prefetch(p, etc, [q1, s1, q3, s3, q2, s2])
    dzf = dz.float()
    dy = (dzf * wM[:, None]).to(BF16)
    d_rows = (dzf * y.float()).sum(-1)
    quant, dgrad = torch.ops.moonep.quantize_fp8_rows, torch.ops.moonep.grouped_mm_fp8_dgrad
    da = dgrad(*quant(dy, pow2), q2, s2, p.w2, p.s2, cu)
    dg, du, a = swiglu_backward(g, u, da)
    dh = dgrad(*quant(dg, pow2), q1, s1, p.w1, p.s1, cu) \
        + dgrad(*quant(du, pow2), q3, s3, p.w3, p.s3, cu)
    h_bf = qf.dequantize_rows(h, hs).to(BF16)
    d1, d3, d2 = (torch.empty_like(w) for w in (w1, w3, w2))
    torch.ops.moonep.grouped_mm_wgrad_into(dg, h_bf, cu, d1, p.g1)
    torch.ops.moonep.grouped_mm_wgrad_into(du, h_bf, cu, d3, p.g3)
    torch.ops.moonep.grouped_mm_wgrad_into(dy, a, cu, d2, p.g2)
    torch.ops.moonep.reduce_grad(etc, [d1, d3, d2], [p.g1, p.g3, p.g2], p.backend_name)
    dx, drw = torch.ops.moonep.combine(dh, d_rows, dst, p.backend_name, total)
    return dx, drw, d1, d3, d2


def _backward_equivalence(ctx, pow2):
    """moe_experts_fp8_backward (transposed quantisation, slots viewed transposed, forward GEMM
    on W^T, the fused elementwise ops) gives bitwise the gradients of the dgrad formulation
    with the torch elementwise passes (dz.float(), dequantize_rows(...).to(bf16)) on the
    reference path, and leaves the slots holding bitwise the transposes of what that
    formulation pushes."""
    buf = Buffer(S, D, K, E, group=ctx.group, token_padding=TP, dtype=BF16)
    try:
        layer = make_layer(buf, "fp8", fp8_pow2_scales=pow2)
        x, _ = tokens(ctx.rank, S)
        _, w = _route(x)
        # every token to experts 0, 1, 2 (rank 0's at R = 2, 4): the plan must spill rank 0's
        # load into redundant slots, so the slot half of every GEMM runs
        ids = torch.tensor([[0, 1, 2]] * S, dtype=torch.int32)
        h, hs, wM, cu, plan = buf.dispatch_fp8(x, ids, w, pow2_scales=pow2)
        ws = (layer.w1.detach(), layer.w3.detach(), layer.w2.detach())
        z, y, g, u = torch.ops.moonep.moe_experts_fp8(
            h, hs, wM, cu, plan.experts_to_copy, *ws, layer.pool_name, x, w, plan.dst,
            plan.total_num_tokens, pow2)
        # z of the fused moonep::scale_rows: bitwise the torch formulation it replaced
        assert torch.equal(z, (y.float() * wM[:, None]).to(BF16))
        dz = torch.randn(z.shape, generator=torch.Generator().manual_seed(5 + ctx.rank)).to(BF16)
        args = (dz, h, hs, wM, y, g, u, cu, plan.experts_to_copy, *ws, layer.pool_name,
                plan.dst, plan.total_num_tokens, pow2)
        old = _backward_with_transposes(*args)
        from moonep_ops.ops import moe_experts_fp8 as m8
        p = m8._pool(layer.pool_name)
        slots_old = [t.clone() for t in p.slot_weights()]
        new = torch.ops.moonep.moe_experts_fp8_backward(*args)
        for a, b in zip(new, old):
            assert a.dtype == b.dtype and torch.equal(a, b)
        for t_new, t_old in zip(p.slot_weights(transposed=True), slots_old):
            if t_old.dtype == qf.FP8_DTYPE:
                t_new, t_old = t_new.view(torch.uint8), t_old.view(torch.uint8)
            assert torch.equal(t_new, t_old.mT)
        if ctx.R > 1:
            assert (plan.experts_to_copy >= 0).any(), "no redundant slot: the slot path idle"
    finally:
        buf.destroy()


def case_backward_transposed_equals_dgrad(ctx):
    _backward_equivalence(ctx, False)


def case_backward_transposed_equals_dgrad_pow2(ctx):
    _backward_equivalence(ctx, True)


MULTI_RANK = multi_rank_cases(globals(), only_at={"case_layer_fp8_compile": (2,)},
                              ranks=(1, 2, 4))
_results = cached_runner(__name__, MULTI_RANK, timeout_s=600, pg_timeout_s=60)


@pytest.mark.parametrize("R,case", MULTI_RANK)
def test_multi_rank(R, case):
    res = _results(R)[case]
    assert res.ok, res.error


# ---------------------------------------------------------------------------------------------
# single process: bytes, configuration
# ---------------------------------------------------------------------------------------------

def test_bytes_per_token_and_per_expert_at_deepseek_v3_sizes():
    """D = 7168, F = 2048 (DeepSeek-V3's routed experts).  Bytes of the tensors the Buffer
    returns (a dispatched row) and allocates (an expert's slot weights)."""
    Dv, Fv = 7168, 2048
    buf = Buffer(8, Dv, 2, 1, dtype=BF16)           # one rank, one expert: epn = 1
    try:
        x = torch.randn(8, Dv).to(BF16)
        ids = torch.zeros(8, 2, dtype=torch.int32)
        ids[:, 1] = 0
        w = torch.full((8, 2), 0.5)
        h8, hs, _, _, _ = buf.dispatch_fp8(x, ids, w)
        hb, _, _, _ = buf.dispatch(x, ids, w)
        fp8_row = (h8.nbytes + hs.nbytes) / h8.shape[0]
        bf16_row = hb.nbytes / hb.shape[0]
        assert fp8_row == Dv + 4 * (Dv // 128) and bf16_row == 2 * Dv
        assert fp8_row / bf16_row <= 0.55, fp8_row / bf16_row          # 0.5156
        p8 = buf.expert_pool(Dv, Fv, BF16, precision="fp8")
        pb = buf.expert_pool(Dv, Fv, BF16)
        w8 = sum(t.nbytes for t in p8.slot_weights())
        wb = sum(t.nbytes for t in pb.slot_weights())
        assert w8 == 3 * Dv * Fv + 3 * 4 * (Dv // 128) * (Fv // 128)
        assert w8 / wb <= 0.55, w8 / wb                                 # 0.5001
        # reduce_grad stays in the weights' dtype
        assert all(t.dtype == BF16 for t in (p8.g1, p8.g3, p8.g2))
        assert sum(t.nbytes for t in (p8.g1, p8.g3, p8.g2)) == \
            sum(t.nbytes for t in (pb.g1, pb.g3, pb.g2))
    finally:
        buf.destroy()


@pytest.mark.parametrize("fp8_wgrad", [False, True])
def test_input_without_grad_skips_its_dgrads(fp8_wgrad):
    """x needs no grad: the FP8 backward runs no dgrad into h (1 FP8 GEMM dgrad of da instead
    of 3) and every parameter's grad is bitwise the one the step gives when x requires grad."""
    buf = Buffer(S, D, K, E, token_padding=TP, dtype=BF16)
    try:
        layer = make_layer(buf, "fp8", fp8_wgrad=fp8_wgrad)
        x, gy = tokens(0, S)
        counts, grads = grads_with_and_without_input_grad(
            layer, x, lambda out: (out.float() * gy).sum(), "moonep::grouped_mm_fp8")
        assert counts == [3, 1], counts
        for n in grads[0]:
            assert torch.equal(grads[0][n], grads[1][n]), n
    finally:
        buf.destroy()


def test_fp8_precision_config():
    MoEArgs()  # default
    assert MoEArgs().precision == "bf16"
    with pytest.raises(ValueError, match="precision must be one of"):
        MoonEPMoE(MoEArgs(num_experts=E, top_k=K, precision="fp4"), D, F, dtype=BF16)
    with pytest.raises(ValueError, match="bfloat16"):
        MoonEPMoE(MoEArgs(num_experts=E, top_k=K, precision="fp8"), D, F, dtype=torch.float32)
    with pytest.raises(ValueError, match="multiples of 16"):
        MoonEPMoE(MoEArgs(num_experts=E, top_k=K, precision="fp8"), D + 8, F, dtype=BF16)


def test_dispatch_fp8_bad_input():
    buf = Buffer(S, D, K, E, dtype=BF16)
    try:
        x, _ = tokens(0, 4)
        ids, w = _route(x)
        with pytest.raises(ValueError, match="bfloat16"):              # wrong dtype
            buf.dispatch_fp8(x.float(), ids, w)
        with pytest.raises(ValueError, match="topk_ids"):
            buf.dispatch_fp8(x, ids[:, :2].contiguous(), w)
        with pytest.raises(ValueError, match="pow2_scales must be a bool"):
            buf.dispatch_fp8(x, ids, w, pow2_scales=1)
    finally:
        buf.destroy()


def test_fp8_layer_forward_is_the_recipe():
    """One rank, explicit routing: the layer's output against the recipe written out from the
    quantisers and fp64 matmuls (the e4m3 values are the same; only the order of fp32 / fp64
    sums and the bf16 roundings of g, u, y, z differ: rel < 1e-2, ~5x tighter than the
    distance to the bf16 layer)."""
    buf = Buffer(S, D, K, E, token_padding=TP, dtype=BF16)
    try:
        layer = make_layer(buf, "fp8")
        x, _ = tokens(0, S)
        ids, w = _route(x)
        out = layer(x, topk_ids=ids, topk_weights=w)
        xd = qf.dequantize_rows(*qf.quantize_rows(x)).double()
        deq = [qf.dequantize_blocks(*qf.quantize_blocks(t.detach())).double()
               for t in (layer.w1, layer.w3, layer.w2)]
        ref = torch.zeros(S, D, dtype=torch.float64)
        for t in range(S):
            for k in range(K):
                e = int(ids[t, k])
                g = (deq[0][e] @ xd[t]).to(BF16)
                u = (deq[1][e] @ xd[t]).to(BF16)
                aq, asc = qf.swiglu_quantize(g[None], u[None])
                y = (deq[2][e] @ qf.dequantize_rows(aq, asc)[0].double()).to(BF16)
                ref[t] += (y.float() * w[t, k]).to(BF16).double()
        assert _rel(out, ref) < 1e-2, _rel(out, ref)
    finally:
        buf.destroy()


def test_opcheck_dispatch_fp8_and_moe_experts_fp8():
    """opcheck of the two ops that need a Buffer (one rank).  Ops with e4m3 inputs skip
    opcheck's test_schema (torch.allclose has no e4m3 kernel; test_fp8_ops.py says more) and
    get a bitwise no-mutation check instead."""
    from torch.library import opcheck
    e4m3_checks = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    buf = Buffer(S, D, K, E, token_padding=TP, dtype=BF16)
    try:
        x, _ = tokens(0, S)
        ids, w = _route(x)
        for pow2 in (False, True):
            opcheck(torch.ops.moonep.dispatch_fp8.default, (x, ids, w, buf.name, -1, pow2))
            opcheck(torch.ops.moonep.dispatch_fp8.default, (x, ids, None, buf.name, -1, pow2))
        layer = make_layer(buf, "fp8")
        h, hs, wM, cu, plan = buf.dispatch_fp8(x, ids, w)
        args = (h, hs, wM, cu, plan.experts_to_copy, layer.w1.detach(), layer.w3.detach(),
                layer.w2.detach(), layer.pool_name, x, w, plan.dst, plan.total_num_tokens, False)
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        for rg in (False, True):
            a = list(args)
            for i in (5, 6, 7, 9, 10):
                a[i] = a[i].clone().requires_grad_(rg)
            opcheck(torch.ops.moonep.moe_experts_fp8.default, tuple(a), test_utils=e4m3_checks)
        z, y, g, u = torch.ops.moonep.moe_experts_fp8(*args)
        bargs = (torch.randn_like(z), h, hs, wM, y, g, u, cu, plan.experts_to_copy,
                 *args[5:8], layer.pool_name, plan.dst, plan.total_num_tokens, False)
        opcheck(torch.ops.moonep.moe_experts_fp8_backward.default, bargs, test_utils=e4m3_checks)
        for a, b in zip(args, before):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a.view(torch.uint8) if a.dtype == qf.FP8_DTYPE else a,
                                   b.view(torch.uint8) if b.dtype == qf.FP8_DTYPE else b)
    finally:
        buf.destroy()


def test_fp8_dispatch_capability_is_declared():
    from types import SimpleNamespace

    from moonep_ops.backends import Backend, CollectiveBackend, SymmBackend
    from moonep_ops.ops.dispatch import check_fp8_dispatch
    assert CollectiveBackend.supports_fp8_dispatch and SymmBackend.supports_fp8_dispatch
    assert Backend.supports_fp8_dispatch is False
    with pytest.raises(NotImplementedError, match="supports_fp8_dispatch"):
        check_fp8_dispatch(SimpleNamespace(supports_fp8_dispatch=False), False)
    with pytest.raises(NotImplementedError, match="supports_fp8_dispatch"):
        Backend.dispatch_fp8(SimpleNamespace(), None, None, None, None, -1, "")
    # the symm backend's staging rows (D * sizeof(dtype) bytes) hold a packed FP8 row
    for Dv in (16, 160, 7168):
        assert qf.fp8_row_bytes(Dv) == Dv + 4 * qf.scale_cols(Dv) <= 2 * Dv
