"""The MoE layer's front door: MoEArgs, building unbound and binding later (or lazily), [..., D]
input, capacity and shape errors, checkpoints of the full [E, ...] experts in and out, sharing one
Buffer between layers (bind_moe), the shared-expert gate and a user router."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from moonep_ops import Buffer, MoEArgs, MoonEPMoE, bind_moe, registry
from moonep_ops.testing import reference_moe

from dist_harness import cached_runner, multi_rank_cases

D, F, E, K = 16, 8, 8, 2


def _args(**kw):
    base = dict(num_experts=E, top_k=K, capacity=32, token_padding=4)
    base.update(kw)
    return MoEArgs(**base)


def _dense(layer_full: MoonEPMoE, x_sD: torch.Tensor) -> torch.Tensor:
    """The unbound layer's function, computed densely from its full weights."""
    ids, w, _ = layer_full.router(x_sD)
    out = reference_moe(x_sD, ids, w, layer_full.w1, layer_full.w3, layer_full.w2)
    if layer_full.shared is not None:
        s = layer_full.shared(x_sD)
        if layer_full.shared_gate is not None:
            s = torch.sigmoid(layer_full.shared_gate(x_sD)) * s
        out = out + s
    return out.to(x_sD.dtype)


def test_unbound_layer_holds_every_expert_and_binds_later():
    torch.manual_seed(0)
    layer = MoonEPMoE(_args(num_shared_experts=1, shared_gate=True), D, F)
    assert layer.buffer is None and layer.num_local_experts == E
    assert tuple(layer.w1.shape) == (E, F, D) and tuple(layer.w2.shape) == (E, D, F)
    x = torch.randn(3, 5, D)
    want = _dense(layer, x.reshape(-1, D)).view(3, 5, D)
    got = layer(x)                                   # binds lazily to one rank
    assert layer.buffer is not None and layer.buffer.R == 1 and layer.owned_experts() == range(E)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_input_shape_dtype_and_capacity_errors_name_the_layer_shape():
    layer = MoonEPMoE(_args(capacity=8), D, F)
    layer.bind()
    with pytest.raises(ValueError, match=r"\[\.\.\., D=16\]"):
        layer(torch.randn(D))                        # 1-D: no token dim
    with pytest.raises(ValueError, match=r"\[\.\.\., D=16\].*\(4, 12\)"):
        layer(torch.randn(4, 12))                    # wrong model dim
    with pytest.raises(TypeError, match="float64"):
        layer(torch.randn(4, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="capacity S=8"):
        layer(torch.randn(3, 3, D))                  # 9 tokens > 8
    with pytest.raises(ValueError, match="capacity"):
        MoonEPMoE(_args(capacity=None), D, F).bind()
    with pytest.raises(RuntimeError, match="already bound"):
        layer.bind()


def test_meta_construction_then_bind_and_init():
    layer = MoonEPMoE(_args(), D, F, device="meta")
    assert layer.w1.is_meta
    layer.bind()
    assert not layer.w1.is_meta and layer.w1.device.type == "cpu"
    assert not any(p.is_meta for p in layer.parameters())
    layer.init_weights(0.1)
    assert float(layer.w1.std()) > 0.05
    out = layer(torch.randn(4, D))
    assert torch.isfinite(out).all()


def test_load_full_checkpoint_keeps_the_slice_and_full_state_dict_round_trips():
    torch.manual_seed(1)
    src = MoonEPMoE(_args(), D, F)
    full = src.state_dict()
    dst = MoonEPMoE(_args(), D, F)
    dst.bind()
    dst.load_state_dict(full)                       # full [E, ...] experts
    for k, v in dst.full_state_dict().items():
        assert torch.equal(v, full[k]), k
    assert list(dst.full_state_dict()) == list(full)


def test_bind_moe_shares_one_buffer_between_alike_layers():
    model = nn.Sequential(MoonEPMoE(_args(), D, F), MoonEPMoE(_args(), D, F),
                          MoonEPMoE(_args(token_padding=8), D, F))
    import gc
    gc.collect()                                     # earlier tests' dropped Buffers
    before = registry.live_count("pool")
    bufs = bind_moe(model)
    assert len(bufs) == 2
    assert model[0].buffer is model[1].buffer is bufs[0] and model[2].buffer is bufs[1]
    assert model[0].pool_name == model[1].pool_name
    assert registry.live_count("pool") == before + 2
    for b in bufs:
        b.destroy()
    assert registry.live_count("pool") == before


def test_bind_moe_overrides_args():
    model = nn.Sequential(MoonEPMoE(_args(capacity=None), D, F))
    (buf,) = bind_moe(model, capacity=12, token_padding=2, policy="lean")
    assert (buf.S, buf.token_padding, buf.policy) == (12, 2, "lean")


class _FixedRouter(nn.Module):
    """A user router: any module returning (ids int32 [s, K], weights fp32 [s, K], logits)."""

    def forward(self, x_sD):
        s = x_sD.shape[0]
        ids = (torch.arange(s * K).view(s, K) % E).to(torch.int32)
        logits = torch.zeros(s, E)
        return ids, torch.full((s, K), 0.5), logits


def test_user_router_and_given_routing():
    torch.manual_seed(2)
    layer = MoonEPMoE(_args(), D, F, router=_FixedRouter())
    x = torch.randn(6, D)
    ids, w, _ = layer.router(x)
    want = reference_moe(x, ids, w, layer.w1, layer.w3, layer.w2)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)
    # routing passed in: the router is not called
    ids2 = torch.zeros(6, K, dtype=torch.int32)
    w2 = torch.ones(6, K)
    got = layer(x, topk_ids=ids2, topk_weights=w2)
    torch.testing.assert_close(got, reference_moe(x, ids2, w2, layer.w1, layer.w3, layer.w2),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="both"):
        layer(x, topk_ids=ids2)


def test_group_limited_biased_scaled_router_matches_its_definition():
    torch.manual_seed(3)
    args = _args(num_experts=8, top_k=2, score_func="sigmoid", route_norm=True,
                 route_norm_eps=1e-20, route_scale=2.5, num_expert_groups=4, num_limited_groups=2,
                 sorted_topk=False)
    layer = MoonEPMoE(args, D, F)
    r = layer.router
    r.expert_bias.copy_(torch.randn(E))
    x = torch.randn(10, D)
    ids, w, logits = r(x)
    s = torch.sigmoid(x @ r.gate.weight.t())
    choice = s + r.expert_bias
    groups = choice.view(10, 4, 2).topk(2, -1).values.sum(-1)
    keep = groups.topk(2, -1).indices
    allowed = torch.zeros(10, 4, dtype=torch.bool).scatter_(1, keep, True).repeat_interleave(2, 1)
    for t in range(10):
        assert allowed[t, ids[t].long()].all()                  # only experts of kept groups
        ref = choice[t].masked_fill(~allowed[t], -float("inf")).topk(2).indices
        assert set(ids[t].tolist()) == set(ref.tolist())
    ww = s.gather(1, ids.long())
    torch.testing.assert_close(w, ww / (ww.sum(-1, keepdim=True) + 1e-20) * 2.5)
    torch.testing.assert_close(logits, x @ r.gate.weight.t())


def test_router_in_the_layer_dtype_rounds_weights():
    args = _args(router_dtype=None, round_weights=True, route_norm=True)
    layer = MoonEPMoE(args, D, F, dtype=torch.bfloat16)
    assert layer.router.gate.weight.dtype == torch.bfloat16
    _, w, logits = layer.router(torch.randn(5, D, dtype=torch.bfloat16))
    assert logits.dtype == torch.bfloat16 and w.dtype == torch.float32
    assert torch.equal(w, w.to(torch.bfloat16).float())


# ---------------------------------------------------------------------------------------------
# R > 1 over gloo: the same model converted on every rank, full checkpoints in and out
# ---------------------------------------------------------------------------------------------


def case_bound_layers_equal_the_unbound_model(ctx):
    torch.manual_seed(5)                         # same full weights on every rank
    args = _args(num_experts=4 * ctx.R, num_shared_experts=1, shared_gate=True, capacity=24)
    full = MoonEPMoE(args, D, F)
    layer = MoonEPMoE(args, D, F)
    layer.load_state_dict(full.state_dict())
    layer.bind(group=ctx.group)
    B = args.num_experts // ctx.R
    assert layer.owned_experts() == range(ctx.rank * B, (ctx.rank + 1) * B)
    assert torch.equal(layer.w2, full.w2[ctx.rank * B:(ctx.rank + 1) * B])
    g = torch.Generator().manual_seed(100 + ctx.rank)
    x = torch.randn(4, 6, D, generator=g, requires_grad=True)   # this rank's own batch
    want = _dense(full, x.detach().reshape(-1, D)).view(4, 6, D)
    got = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    sd = layer.full_state_dict()
    ref = full.state_dict()
    assert list(sd) == list(ref)
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k
    # a full checkpoint loads into a bound layer too (each rank keeps its slice)
    other = MoonEPMoE(args, D, F)
    other.bind(layer.buffer)
    other.load_state_dict(sd)
    assert torch.equal(other.w1, layer.w1)
    layer.buffer.destroy()


MULTI_RANK = multi_rank_cases(globals(), ranks=(1, 2, 4))
_results = cached_runner(__name__, MULTI_RANK, timeout_s=300)


@pytest.mark.parametrize("R,case", MULTI_RANK)
def test_multi_rank(R, case):
    res = _results(R)[case]
    assert res.ok, res.error
