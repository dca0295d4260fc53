"""The FP8 weight cache (moonep_ops/ops/fp8_weight_cache.py) on CPU: its layouts are the
quantisers' bitwise, it is reused while the parameters are unchanged, and a stale cached weight
is never returned after an update, whatever the update (optimizer steps, in-place ops,
load_state_dict, a new parameter object, new storage), eagerly and from a custom op's body under
torch.compile (which is where the FP8 expert op reads it).  The one blind spot, writes through
``p.data``, is shown and covered by ``invalidate``."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import moonep_ops  # noqa: F401
from moonep_ops.ops import quantize_fp8 as qf
from moonep_ops.ops.fp8_weight_cache import FP8WeightCache, cache_nbytes

B, F, D = 2, 144, 160


class Experts(nn.Module):
    def __init__(self, pow2=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(B, F, D, generator=g).bfloat16())
        self.w3 = nn.Parameter(torch.randn(B, F, D, generator=g).bfloat16())
        self.w2 = nn.Parameter(torch.randn(B, D, F, generator=g).bfloat16())
        self.cache = FP8WeightCache(B, F, D, pow2_scales=pow2)
        self.cache.bind(self.w1, self.w3, self.w2)

    def ws(self):
        return self.w1, self.w3, self.w2


def expected(ws, transpose, pow2=False):
    out = []
    for w in ws:
        out += list(qf.quantize_blocks(w.detach(), pow2, transpose))
    return out


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32)


def same(a, b):
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def assert_fresh(m, pow2=False):
    for tr in (False, True):
        assert same(m.cache.weights(*m.ws(), transpose=tr), expected(m.ws(), tr, pow2))


@pytest.mark.parametrize("pow2", [False, True])
def test_layouts_are_the_quantisers(pow2):
    m = Experts(pow2)
    assert_fresh(m, pow2)
    fwd, bwd = m.cache.tensors(False), m.cache.tensors(True)
    for i in (0, 2, 4):                   # the backward layout is the forward one transposed
        assert torch.equal(bits(bwd[i]), bits(fwd[i]).transpose(-2, -1))
        assert torch.equal(bwd[i + 1], fwd[i + 1].transpose(-2, -1))


def test_reused_while_unchanged():
    """Gradient accumulation: many micro-batches, one quantisation per layout."""
    m = Experts()
    for _ in range(5):
        m.cache.weights(*m.ws())
        m.cache.weights(*m.ws(), transpose=True)
    assert m.cache.refreshes == {"fwd": 1, "bwd": 1}


def _updates():
    def no_grad_inplace(m):
        with torch.no_grad():
            m.w2.mul_(1.5)

    def optimizer(cls, **kw):
        def f(m):
            opt = cls(m.parameters(), lr=0.5, **kw)
            for p in m.parameters():
                p.grad = torch.ones_like(p)
            opt.step()
        return f

    def load(m):
        sd = {k: v * 2 for k, v in m.state_dict().items()}
        m.load_state_dict(sd)

    def new_param(m):
        m.w3 = nn.Parameter(m.w3.detach() * -1)

    def new_storage(m):
        m.w1.data = m.w1.detach() + 1          # new storage: the pointer changes

    return {"no_grad_inplace": no_grad_inplace,
            "sgd_foreach": optimizer(torch.optim.SGD, foreach=True),
            "sgd_loop": optimizer(torch.optim.SGD, foreach=False),
            "adamw": optimizer(torch.optim.AdamW),
            "load_state_dict": load, "new_param": new_param, "new_storage": new_storage}


@pytest.mark.parametrize("update", sorted(_updates()))
def test_stale_weight_never_returned_after_an_update(update):
    m = Experts()
    assert_fresh(m)
    before = [t.clone() for t in m.cache.tensors(False)]
    _updates()[update](m)
    assert_fresh(m)                                     # recomputed, equal to a fresh one
    assert not same(m.cache.tensors(False), before)     # and the update did change them


def test_data_writes_bypass_the_version_counter_invalidate_covers_them():
    m = Experts()
    assert_fresh(m)
    m.w2.data.mul_(3)                 # torch does not count this write (autograd does not see it)
    assert m.cache.is_fresh(*m.ws())  # the blind spot, documented
    m.cache.invalidate()
    assert_fresh(m)


def test_dead_weak_reference_is_never_fresh():
    m = Experts()
    m.cache.weights(*m.ws())
    w1 = m.w1.detach().clone()        # another object, even with equal data and version 0
    assert not m.cache.is_fresh(w1, m.w3, m.w2)


# A consumer as the FP8 expert op is one: a custom op whose body reads the cache.
@torch.library.custom_op("moonep_test::cache_consumer", mutates_args=())
def _consumer(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
              name: str) -> torch.Tensor:
    from moonep_ops import registry
    cache = registry.lookup(name, FP8WeightCache)
    q1, s1 = cache.weights(w1, w3, w2)[:2]
    return x @ qf.dequantize_blocks(q1, s1)[0].t()


@_consumer.register_fake
def _(x, w1, w3, w2, name):
    return x.new_empty(x.shape[0], w1.shape[1])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_consumer_sees_every_update(backend):
    torch._dynamo.reset()
    m = Experts()
    x = torch.randn(3, D)

    def f(x):
        with torch.no_grad():       # (the test consumer has no autograd formula)
            return _consumer(x, m.w1, m.w3, m.w2, m.cache.name)

    cf = torch.compile(f, fullgraph=True, backend=backend)
    for step in range(3):
        want = x @ qf.dequantize_blocks(*qf.quantize_blocks(m.w1.detach()))[0].t()
        assert torch.equal(cf(x), want), step
        assert torch.equal(cf(x), want)               # a second micro-batch: a cache hit
        with torch.no_grad():
            m.w1.add_(torch.randn_like(m.w1))
    assert m.cache.refreshes["fwd"] == 3


def test_attach_refreshes_after_every_optimizer_step():
    m = Experts()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.cache.attach(opt, *m.ws())
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert m.cache.refreshes == {"fwd": 1, "bwd": 1}
    assert m.cache.is_fresh(*m.ws()) and m.cache.is_fresh(*m.ws(), transpose=True)
    assert_fresh(m)
    assert m.cache.refreshes == {"fwd": 1, "bwd": 1}   # the forward and backward reuse it


def test_refresh_from_intermediates_is_a_step_refresh():
    """The refresh of a compiled step sees the update's intermediates, not the parameters: the
    cache marks it, and an eager call recomputes (correct; the captured case trusts it)."""
    m = Experts()
    m.cache.refresh(*(w.detach() * 1 for w in m.ws()))
    assert m.cache._keys["fwd"] == ("step",) and not m.cache.is_fresh(*m.ws())
    assert_fresh(m)
    m.cache.refresh(*m.ws())
    assert m.cache.is_fresh(*m.ws(), transpose=True)


def test_refresh_op_opcheck_and_errors():
    from torch.library import opcheck
    m = Experts()
    args = (m.w1.detach(), m.w3.detach(), m.w2.detach(),
            m.cache.tensors(False) + m.cache.tensors(True), m.cache.name, False)
    opcheck(torch.ops.moonep.fp8_weight_cache_refresh.default, args,
            test_utils=("test_faketensor", "test_aot_dispatch_static",
                        "test_aot_dispatch_dynamic"))
    with pytest.raises(ValueError, match="12 tensors"):
        torch.ops.moonep.fp8_weight_cache_refresh(*args[:3], args[3][:6], m.cache.name, False)
    with pytest.raises(ValueError, match="pow2_scales"):
        torch.ops.moonep.fp8_weight_cache_refresh(*args[:5], True)
    with pytest.raises(ValueError, match=r"\[2, 144, 160\]"):
        m.cache.weights(m.w2, m.w3, m.w1)


def test_memory_is_stated():
    c = FP8WeightCache(3, 2048, 7168)
    assert c.nbytes() == cache_nbytes(3, 2048, 7168) == 2 * (3 * 3 * 2048 * 7168
                                                             + 12 * 3 * 16 * 56)
    assert not c.state_dict()                    # non-persistent: never in a checkpoint
    # DeepSeek-V3: 84.02 MiB an expert (the bf16 weights' 84.0, + 0.03 %)
    assert abs(cache_nbytes(1, 2048, 7168) / 2**20 - 84.02) < 0.005
