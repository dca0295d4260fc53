"""The MoE layer: equivalence with a dense reference on real gloo ranks, compile, interface pins."""
from __future__ import annotations

import expecttest
import pytest
import torch
from torch._dynamo.utils import counters

import moonep_ops  # noqa: F401
from moonep_ops.buffer import Buffer
from moonep_ops.nn.moe import MoEArgs, MoonEPMoE, check_backend_dims
from moonep_ops.testing import reference_moe
from moonep_ops.planner import plan_all_ranks
from moonep_ops.testing.train_step import (enable_backward_tracing,
                                           grads_with_and_without_input_grad, sgd_step)

try:
    from dist_harness import cached_runner, multi_rank_cases
except ImportError:                                    # imported as tests.test_moe
    from tests.dist_harness import cached_runner, multi_rank_cases

D, F, E, K, TP = 32, 16, 8, 3, 4


def full_weights(seed=7):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, F, D, generator=g) * 0.2
    w3 = torch.randn(E, F, D, generator=g) * 0.2
    w2 = torch.randn(E, D, F, generator=g) * 0.2
    gate = torch.randn(E, D, generator=g) * 0.3
    gate[0, 0] += 2.0          # x[:, 0] is shifted below: expert 0 is hot -> redundancy
    return w1, w3, w2, gate


def tokens(r, s, dtype, seed=11):
    g = torch.Generator().manual_seed(seed * 100 + r)
    x = torch.randn(s, D, generator=g)
    x[:, 0] += 2.0
    return x.to(dtype), torch.randn(s, D, generator=g)


def make_layer(buf, rank, dtype):
    B = E // buf.R
    w1, w3, w2, gate = full_weights()
    layer = MoonEPMoE.for_buffer(buf, F)
    with torch.no_grad():
        sl = slice(rank * B, (rank + 1) * B)
        layer.w1.copy_(w1[sl])
        layer.w3.copy_(w3[sl])
        layer.w2.copy_(w2[sl])
        layer.router.gate.weight.copy_(gate)
    return layer


def _rel(a, b):
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _equivalence(ctx, sizes, dtype, tol, expect_redundancy=False, **buffer_kw):
    R, r = ctx.R, ctx.rank
    S = 12
    per_rank = len(set(sizes)) > 1
    total = sum(sizes) if per_rank else None
    buf = Buffer(S, D, K, E, group=ctx.group, token_padding=TP, dtype=dtype, **buffer_kw)
    layer = make_layer(buf, r, dtype)
    x, gy = (t.to(buf.device) for t in tokens(r, sizes[r], dtype))   # NCCL ranks: cuda:rank
    x.requires_grad_(True)
    out = layer(x, total_num_tokens=total)
    (out.float() * gy).sum().backward()
    layer.reduce_router_grad()

    # dense single-process reference over every rank's tokens, fp32
    w1, w3, w2, gate = (t.clone().requires_grad_(True) for t in full_weights())
    if dtype == torch.bfloat16:       # the layer's weights are bf16: reference uses the same values
        with torch.no_grad():
            for t in (w1, w3, w2):
                t.copy_(t.bfloat16().float())
    xs, gys = zip(*(tokens(q, sizes[q], dtype) for q in range(R)))
    X = torch.cat(xs).float().requires_grad_(True)
    scores = torch.softmax(X @ gate.t(), -1)
    ids = torch.topk(scores.detach(), K, dim=-1).indices
    ref = reference_moe(X, ids, scores.gather(1, ids), w1, w3, w2)
    (ref * torch.cat(gys)).sum().backward()

    lo = sum(sizes[:r])
    rows = slice(lo, lo + sizes[r])
    B = E // R
    sl = slice(r * B, (r + 1) * B)
    checks = {"out": (out, ref[rows]), "dx": (x.grad, X.grad[rows]),
              "router": (layer.router.gate.weight.grad, gate.grad),
              "w1": (layer.w1.grad, w1.grad[sl]), "w3": (layer.w3.grad, w3.grad[sl]),
              "w2": (layer.w2.grad, w2.grad[sl])}
    bad = {k: _rel(a, b) for k, (a, b) in checks.items() if _rel(a, b) > tol}
    assert not bad, (dtype, sizes, bad)
    # with s = S the hot expert forces redundant slots (R > 1): the slot paths really ran
    if expect_redundancy and R > 1:
        kw = dict(policy=buf.policy, slack_ppm=buf.slack_ppm, replica_cost=buf.replica_cost)
        plans = plan_all_ranks([i.int() for i in ids.split(list(sizes))], E, TP, **kw)
        assert (plans.plans[0].experts_to_copy >= 0).any()


def _sizes(R, kind):
    return {"full": [12] * R, "one": [1] * R, "odd": [7] * R,
            "per_rank": [(5, 12, 1, 9)[q % 4] for q in range(R)]}[kind]


def case_equiv_fp32_full(ctx):
    _equivalence(ctx, _sizes(ctx.R, "full"), torch.float32, 1e-5, expect_redundancy=True)


def case_equiv_fp32_one(ctx):
    _equivalence(ctx, _sizes(ctx.R, "one"), torch.float32, 1e-5)


def case_equiv_fp32_odd(ctx):
    _equivalence(ctx, _sizes(ctx.R, "odd"), torch.float32, 1e-5)


def case_equiv_fp32_per_rank(ctx):
    _equivalence(ctx, _sizes(ctx.R, "per_rank"), torch.float32, 1e-5)


def case_equiv_fp32_cost(ctx):
    """Policy "cost" (a 25 % slack, a replica worth 3 copies: slots and slack both used)."""
    _equivalence(ctx, _sizes(ctx.R, "full"), torch.float32, 1e-5, expect_redundancy=True,
                 policy="cost", slack=0.25, replica_cost=3)


def case_equiv_fp32_cost_per_rank(ctx):
    _equivalence(ctx, _sizes(ctx.R, "per_rank"), torch.float32, 1e-5, policy="cost",
                 slack=0.1, expert_dim=F)


def case_equiv_bf16_full(ctx):
    _equivalence(ctx, _sizes(ctx.R, "full"), torch.bfloat16, 2e-2, expect_redundancy=True)


def case_equiv_bf16_per_rank(ctx):
    _equivalence(ctx, _sizes(ctx.R, "per_rank"), torch.bfloat16, 2e-2)


def case_compile_layer_and_step(ctx):
    """fullgraph compile of the layer and of a whole training step: no breaks, no recompiles."""
    enable_backward_tracing()
    r = ctx.rank
    buf = Buffer(12, D, K, E, group=ctx.group, token_padding=TP, dtype=torch.float32)
    layer = make_layer(buf, r, torch.float32)
    counters.clear()
    cl = torch.compile(layer, fullgraph=True)
    for seed in range(3):
        x = tokens(r, 12, torch.float32, seed=seed)[0].to(buf.device)
        torch.testing.assert_close(cl(x), layer(x), rtol=1e-5, atol=1e-6)
        if seed == 0:
            torch.compiler.set_stance("fail_on_recompile")
    torch.compiler.set_stance("default")
    assert not counters["graph_break"], dict(counters["graph_break"])

    params = list(layer.parameters())
    start = [p.detach().clone() for p in params]

    # plain SGD written out (moonep_ops/testing/train_step.py says why)
    step = sgd_step(layer, params, 1e-3)

    batches = [tuple(t.to(buf.device) for t in tokens(r, 12, torch.float32, seed=20 + i))
               for i in range(4)]
    eager = [step(*b) for b in batches]
    after_eager = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, s in zip(params, start):
            p.copy_(s)
    torch._dynamo.reset()
    counters.clear()
    cs = torch.compile(step, fullgraph=True)
    compiled = []
    for i, b in enumerate(batches):
        compiled.append(cs(*b))
        if i == 0:
            torch.compiler.set_stance("fail_on_recompile")     # new routing every step
    torch.compiler.set_stance("default")
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(torch.stack(compiled), torch.stack(eager), rtol=1e-5, atol=1e-5)
    for p, q in zip(params, after_eager):
        torch.testing.assert_close(p.detach(), q, rtol=1e-4, atol=1e-5)


MULTI_RANK = multi_rank_cases(globals(), only_at={"case_compile_layer_and_step": (2,),
                                                  "case_bad_config": (2, 4)})
_results = cached_runner(__name__, MULTI_RANK, timeout_s=600, pg_timeout_s=60)


@pytest.mark.parametrize("R,case", MULTI_RANK)
def test_multi_rank(R, case):
    res = _results(R)[case]
    assert res.ok, res.error


# --------------------------------------------------------------------------------------------
# Single process: bad configuration, interface pins
# --------------------------------------------------------------------------------------------


def case_bad_config(ctx):
    with pytest.raises(ValueError, match="divisible"):
        Buffer(4, D, 2, 2 * ctx.R + 1, group=ctx.group, dtype=torch.float32)


def test_bad_configuration():
    with pytest.raises(ValueError, match="top_k=9 > num_experts=8"):
        MoonEPMoE(MoEArgs(num_experts=8, top_k=9), D, F)
    with pytest.raises(ValueError, match="hidden_dim"):
        MoonEPMoE.for_buffer(Buffer(4, D, 2, 8, dtype=torch.float32), 0)
    with pytest.raises(TypeError, match="Buffer"):
        MoonEPMoE.for_buffer("not a buffer", F)
    with pytest.raises(TypeError, match="MoEArgs"):
        MoonEPMoE(dict(num_experts=8), D, F)
    # the CUDA grouped GEMM backends need 16-byte rows; checked at construction
    with pytest.raises(ValueError, match="multiples of 8"):
        check_backend_dims("cuda", torch.bfloat16, 36, 12)
    check_backend_dims("cpu", torch.bfloat16, 36, 12)


@pytest.mark.parametrize("variant", [{}, dict(expert_bias=True, activation="swiglu_clamped")])
def test_input_without_grad_skips_its_dgrads(variant):
    """A batch that needs no grad (a first layer, frozen inputs): the experts' backward runs no
    dgrad into the dispatched rows (1 dgrad instead of 3: only da's), and every parameter's grad
    is bitwise the one the same step gives when x requires grad."""
    torch.manual_seed(0)
    buf = Buffer(16, D, K, E, token_padding=TP, dtype=torch.float32)
    try:
        layer = MoonEPMoE.for_buffer(buf, F, **variant)
        counts, grads = grads_with_and_without_input_grad(
            layer, torch.randn(16, D), lambda out: (out ** 2).sum(), "moonep::grouped_mm_dgrad")
        assert counts == [3, 1], counts
        for n in grads[0]:
            assert torch.equal(grads[0][n], grads[1][n]), n
    finally:
        buf.destroy()


def _graph_ops(layer, x):
    ops = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function":
                t = node.target
                ops.append(str(t) if isinstance(t, torch._ops.OpOverloadPacket | torch._ops.OpOverload)
                           else getattr(t, "__name__", str(t)))
            elif node.op == "call_method":
                ops.append("." + node.target)
        return gm

    torch._dynamo.reset()
    torch.compile(layer, backend=backend, fullgraph=True)(x)
    return ops


class TestInterface(expecttest.TestCase):
    def test_op_schemas(self):
        names = ["plan", "dispatch", "dispatch_with_plan", "combine", "prefetch_weight",
                 "reduce_grad", "grouped_mm", "grouped_mm_dgrad", "grouped_mm_wgrad",
                 "grouped_mm_wgrad_accumulate", "moe_experts", "moe_experts_backward"]
        text = "\n".join(str(getattr(torch.ops.moonep, n).default._schema) for n in names)
        self.assertExpectedInline(text, """\
moonep::plan(Tensor tpe_RE, Tensor topk_sK, int rank, int R, int S, int token_padding, int total_num_tokens, str policy, int slack_ppm=0, int replica_cost=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)
moonep::dispatch(Tensor x, Tensor topk_ids, Tensor? route_weights, str buffer, int total_num_tokens) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)
moonep::dispatch_with_plan(Tensor x, Tensor? route_weights, Tensor dst, str buffer, int total_num_tokens) -> (Tensor, Tensor)
moonep::combine(Tensor h, Tensor? route_weights, Tensor dst, str buffer, int total_num_tokens, bool weighted=False) -> (Tensor, Tensor)
moonep::prefetch_weight(Tensor experts_to_copy, Tensor[] local_weights, Tensor(a2!)[] slot_weights, str buffer) -> ()
moonep::reduce_grad(Tensor experts_to_copy, Tensor(a1!)[] local_grads, Tensor(a2!)[] slot_grads, str buffer) -> ()
moonep::grouped_mm(Tensor x, Tensor w_local, Tensor w_slot, Tensor cu_seqlens, int config=-1, bool zero_tail=True) -> Tensor
moonep::grouped_mm_dgrad(Tensor dy, Tensor w_local, Tensor w_slot, Tensor cu_seqlens, int config=-1, bool zero_tail=True) -> Tensor
moonep::grouped_mm_wgrad(Tensor dy, Tensor x, Tensor cu_seqlens, int epn, int config=-1, ScalarType? out_dtype=None) -> (Tensor, Tensor)
moonep::grouped_mm_wgrad_accumulate(Tensor dy, Tensor x, Tensor cu_seqlens, Tensor(a!) grad_local, Tensor(b!) grad_slot, int config=-1) -> ()
moonep::moe_experts(Tensor h, Tensor cu_seqlens, Tensor experts_to_copy, Tensor w1, Tensor w3, Tensor w2, str pool) -> (Tensor, Tensor, Tensor)
moonep::moe_experts_backward(Tensor dy, Tensor h, Tensor g, Tensor u, Tensor cu_seqlens, Tensor experts_to_copy, Tensor w1, Tensor w3, Tensor w2, str pool, bool need_dh=True) -> (Tensor, Tensor, Tensor, Tensor)""")

    def test_captured_layer_graph(self):
        torch.manual_seed(0)
        buf = Buffer(8, D, K, E, token_padding=TP, dtype=torch.float32)
        layer = MoonEPMoE.for_buffer(buf, F)
        self.assertExpectedInline(" ".join(_graph_ops(layer, torch.randn(8, D))), """.reshape .to linear .float softmax .detach add topk getitem .gather .to .detach moonep.dispatch getitem getitem getitem getitem getitem .detach moonep.moe_experts getitem moonep.combine getitem .view""")
