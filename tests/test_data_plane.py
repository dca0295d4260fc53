"""Data plane (dispatch / combine / prefetch_weight / reduce_grad) with real gloo ranks.

Every multi-rank case is a ``case_*`` function run inside one spawn per R (dist_harness.py);
each rank regenerates every rank's inputs from seeds, so references need no communication.
Single-process tests (R = 1 Buffer: opcheck, bad input, compile) are at the bottom.
"""
from __future__ import annotations

import functools
import itertools
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import moonep_ops  # noqa: F401
from moonep_ops.buffer import Buffer
from moonep_ops.planner import plan_all_ranks

try:
    from dist_harness import cached_runner, multi_rank_cases
except ImportError:                                    # imported as tests.test_data_plane
    from tests.dist_harness import cached_runner, multi_rank_cases

# ---------------------------------------------------------------------------------------------
# Inputs and references (pure functions of seeds: every rank can rebuild every rank's inputs)
# ---------------------------------------------------------------------------------------------


def routing(kind: str, r: int, R: int, s: int, K: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + r)
    epn = E // R
    if kind == "uniform":                                # K distinct experts per token
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(s)])
    elif kind == "zipf":                                 # skewed popularity, distinct per token
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.3
        ids = torch.multinomial(p.expand(s, E), K, replacement=False, generator=g)
    elif kind == "one_expert":                           # every entry to expert 1 (dups!)
        ids = torch.full((s, K), 1 % E)
    elif kind == "all_remote":                           # only experts of rank r+1
        home = (r + 1) % R
        ids = home * epn + torch.randint(0, epn, (s, K), generator=g)
    elif kind == "dup":                                  # duplicate ids inside tokens
        ids = torch.randint(0, E, (s, K), generator=g)
        ids[:, -1] = ids[:, 0]
        ids[::2, 1 % K] = ids[::2, 0]
    elif kind == "random":                               # with replacement
        ids = torch.randint(0, E, (s, K), generator=g)
    else:
        raise ValueError(kind)
    return ids.to(torch.int32).contiguous()


def token_inputs(r, s, H, K, dtype, seed):
    g = torch.Generator().manual_seed(seed * 7919 + r)
    x = torch.randn(s, H, generator=g).to(dtype)
    w = torch.rand(s, K, generator=g, dtype=torch.float32)
    return x, w


@functools.lru_cache(maxsize=None)
def _cfg_inputs(cfg):
    R, E, K, H, S, tp, kind, sizes, dtype, seed = cfg
    xs, ws, ts = [], [], []
    for r in range(R):
        x, w = token_inputs(r, sizes[r], H, K, dtype, seed)
        xs.append(x), ws.append(w), ts.append(routing(kind, r, R, sizes[r], K, E, seed))
    return xs, ws, ts


class Setup:
    """One configuration: the Buffer of this rank plus every rank's inputs (CPU, for the
    references) and the group plan.  ``mine`` gives this rank's inputs on ctx.device."""

    def __init__(self, ctx, *, E=8, K=3, H=16, S=12, tp=1, kind="uniform", s=None, dtype=None,
                 seed=0, per_rank=False):
        R = ctx.R
        dtype = dtype or torch.bfloat16
        if per_rank:                                     # different s per rank
            sizes = tuple(max(1, S - 3 * r) if r % 2 == 0 else 1 + r for r in range(R))
        else:
            sizes = (s or S,) * R
        self.ctx, self.R, self.E, self.K, self.H, self.S, self.tp = ctx, R, E, K, H, S, tp
        self.sizes, self.dtype, self.dev = sizes, dtype, ctx.device
        self.total = sum(sizes) if per_rank else None
        self.xs, self.ws, self.ts = _cfg_inputs((R, E, K, H, S, tp, kind, sizes, dtype, seed))
        self.buf = Buffer(S, H, K, E, group=ctx.group, token_padding=tp, dtype=dtype,
                          device=ctx.device, backend="torch")   # collectives even at R = 1
        self.group = plan_all_ranks(self.ts, E, tp, capacity=S, total_num_tokens=self.total)

    @property
    def me(self):
        r = self.ctx.rank
        return self.xs[r], self.ws[r], self.ts[r]

    @property
    def mine(self):
        return tuple(t.to(self.dev) for t in self.me)

    def dispatch(self, weights=True):
        x, w, t = self.mine
        return self.buf.dispatch(x, t, w if weights else None, total_num_tokens=self.total)

    def expected_scatter(self, xs=None):
        """Every entry of every rank bound here: its row and weight at its slot; zeros elsewhere."""
        xs = xs or self.xs
        rank, p_me = self.ctx.rank, self.group.plans[self.ctx.rank]
        h = torch.zeros(p_me.nvs_s, self.H, dtype=self.dtype)
        w = torch.zeros(p_me.nvs_s)
        seen = torch.zeros(p_me.nvs_s, dtype=torch.int64)
        for r, p in enumerate(self.group.plans):
            n = (p.dest_rank == rank).nonzero().squeeze(1)
            sl = p.slot[n]
            h[sl] = xs[r][n // self.K]
            w[sl] = self.ws[r].reshape(-1)[n]
            seen.index_add_(0, sl, torch.ones_like(sl))
        assert int(seen.max()) <= 1, "two entries share a slot"
        return h, w, seen

    def segment_experts(self, cu):
        """Expert id of every received row (-1: padding / tail) from cu_seqlens + the table."""
        rank, epn = self.ctx.rank, self.buf.epn
        etc = self.group.plans[rank].experts_to_copy[rank].tolist()
        seg_e = [rank * epn + g for g in range(epn)] + etc
        out = torch.full((self.group.plans[rank].nvs_s,), -1, dtype=torch.long)
        start = 0
        for g, end in enumerate(cu.tolist()):
            out[start:end] = seg_e[g]
            start = end
        return out


def fixed_order_sum(rows_list, dtype, weights=None):
    """combine's formula: sum_k rows_list[k] in fp32 (fp64 for fp64), in k order, the first term
    starting the sum, rounded once; with ``weights`` [s, K] (weighted combine) each term is the
    row times weights[:, k] in that type."""
    acc_t = torch.promote_types(dtype, torch.float32)
    terms = [r.to(acc_t) if weights is None else r.to(acc_t) * weights[:, k, None].to(acc_t)
             for k, r in enumerate(rows_list)]
    acc = terms[0]
    for term in terms[1:]:
        acc = acc + term
    return acc.to(dtype)


# ---------------------------------------------------------------------------------------------
# Multi-rank cases
# ---------------------------------------------------------------------------------------------

SCATTER_CONFIGS = {
    "uniform_bf16": dict(kind="uniform"),
    "uniform_fp32_tp4": dict(kind="uniform", dtype=torch.float32, tp=4),
    "zipf_tp2": dict(kind="zipf", tp=2),
    "one_expert": dict(kind="one_expert", tp=3),
    "all_remote": dict(kind="all_remote"),
    "dup": dict(kind="dup", tp=2),
    "s1": dict(kind="random", s=1),
    "odd_s": dict(kind="zipf", s=7, tp=4, dtype=torch.float32),
    "per_rank_s": dict(kind="random", per_rank=True, tp=2),
    "k1": dict(kind="zipf", K=1, E=4),
    "larger_zipf_tp8": dict(kind="zipf", E=16, K=4, H=64, S=40, tp=8),
    "larger_random_fp32": dict(kind="random", E=16, K=6, H=32, S=33, dtype=torch.float32),
}


def _scatter_and_combine(ctx, **cfg):
    st = Setup(ctx, **cfg)
    x, w_in, t = st.me
    dev = st.dev
    st.buf.backend.recv_rows.fill_(7)                                 # garbage must not leak out
    h, w, cu, plan = st.dispatch()
    ref = st.group.plans[ctx.rank]
    assert torch.equal(plan.dst.cpu(), ref.dst) and torch.equal(cu.cpu(), ref.cu_seqlens)
    # every rank's dst, gathered over the group, is the one the references decode
    mine = torch.full((st.S * st.K,), -(2 ** 31), dtype=torch.int32, device=dev)
    mine[:plan.dst.numel()] = plan.dst
    all_dst = [torch.empty_like(mine) for _ in range(ctx.R)]
    dist.all_gather(all_dst, mine)
    for r, p in enumerate(st.group.plans):
        assert torch.equal(all_dst[r][:p.dst.numel()].cpu(), p.dst), f"rank {r}'s plan differs"
    assert torch.equal(plan.experts_to_copy.cpu(), ref.experts_to_copy)
    assert h.shape == (plan.nvs_s, st.H) and w.shape == (plan.nvs_s,) and w.dtype == torch.float32
    assert cu.dtype == torch.int32 and cu.shape == (st.buf.G,)
    assert h.device == w.device == cu.device == torch.device(dev)
    # receive buffer holds NvS rows (S*K plus padding slack), never R*S*K
    assert st.buf.backend.recv_rows.shape[0] == st.buf.NvS
    if st.tp == 1:
        assert st.buf.NvS == st.S * st.K                      # < R*S*K for R > 1
    assert st.buf.NvS == math.ceil((st.S * st.K + (st.tp - 1) * st.buf.G) / st.tp) * st.tp
    eh, ew, seen = st.expected_scatter()
    assert int(seen.sum()) == sum(int((p.dest_rank == ctx.rank).sum()) for p in st.group.plans)
    assert torch.equal(h.cpu(), eh), "dispatched rows differ from their source tokens"
    assert torch.equal(w.cpu().view(torch.int32), ew.view(torch.int32)), "route weights differ"
    assert int(cu[-1]) <= plan.nvs_s
    # combine(dispatch(x)) == sum_k x in fp32, fixed order (== K*x within bf16 rounding)
    y, wk = st.buf.combine(plan, h, w)
    y, wk = y.cpu(), wk.cpu()
    assert y.dtype == st.dtype and y.shape == x.shape
    assert torch.equal(y, fixed_order_sum([x] * st.K, st.dtype))
    torch.testing.assert_close(y.float(), st.K * x.float(), rtol=2 ** -7, atol=1e-6)
    assert torch.equal(wk, w_in), "gathered route weights differ"
    # per-segment scaling (expert id + 1) equals the fp32 fixed-order reference bitwise
    scale = (st.segment_experts(cu.cpu()) + 1).clamp(min=0).float().to(dev)
    hs = (h.float() * scale[:, None]).to(st.dtype)
    ys, none = st.buf.combine(plan, hs)
    assert none is None
    parts = [(x.float() * (t[:, k].float() + 1)[:, None]).to(st.dtype) for k in range(st.K)]
    assert torch.equal(ys.cpu(), fixed_order_sum(parts, st.dtype)), "per-segment scaled combine"
    # weighted: sum_k fp32(row) * w in k order, one rounding: bitwise the formula
    yw, wk2 = st.buf.combine(plan, hs, w, weighted=True)
    assert torch.equal(yw.cpu(), fixed_order_sum(parts, st.dtype, w_in)), "weighted combine"
    assert torch.equal(wk2.cpu(), w_in)
    # combine also accepts the full NvS rows
    hfull = torch.cat([hs, hs.new_zeros(st.buf.NvS - hs.shape[0], st.H)])
    assert torch.equal(st.buf.combine(plan, hfull)[0], ys)
    wfull = torch.cat([w, w.new_zeros(st.buf.NvS - w.shape[0])])
    assert torch.equal(st.buf.combine(plan, hfull, wfull, weighted=True)[0], yw)
    # plan reuse with new values reproduces the scatter
    xs2 = [(xx.float() * 3 - 1).to(st.dtype) for xx in st.xs]
    x2 = xs2[ctx.rank].to(dev)
    h2, w2, cu2, plan2 = st.buf.dispatch(x2, route_weights_sK=w_in.to(dev), plan=plan)
    assert plan2 is plan and cu2 is plan.cu_seqlens
    eh2, _, _ = st.expected_scatter(xs2)
    assert torch.equal(h2.cpu(), eh2) and torch.equal(w2, w)
    h3, w3, _, _ = st.buf.dispatch(x2, plan=plan)
    assert w3 is None and torch.equal(h3.cpu(), eh2)


def _make_scatter_case(name, cfg):
    def case(ctx):
        c = dict(cfg)
        if c.get("E", 8) % ctx.R:      # e.g. k1's 4 experts at R = 8: same routing kind, epn 4
            c["E"] = 4 * ctx.R
        _scatter_and_combine(ctx, **c)
    case.__name__ = f"case_scatter_{name}"
    return case


for _n, _c in SCATTER_CONFIGS.items():
    globals()[f"case_scatter_{_n}"] = _make_scatter_case(_n, _c)


def _mlp(h, w1, w2):
    return F.silu(h @ w1) @ w2


def _expert_weights(E, H, Fd, seed=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, H, Fd, generator=g) / math.sqrt(H),
            torch.randn(E, Fd, H, generator=g) / math.sqrt(Fd))


def _dense_layer(st, W1, W2):
    """Per-expert loop over every rank's tokens (no EP at all, CPU); y per rank and grads."""
    W1 = W1.clone().requires_grad_()
    W2 = W2.clone().requires_grad_()
    xs = [x.clone().requires_grad_() for x in st.xs]
    ws = [w.clone().requires_grad_() for w in st.ws]
    ys, loss = [], 0
    for r in range(st.R):
        y = torch.zeros_like(xs[r])
        for k in range(st.K):
            e = st.ts[r][:, k].long()
            out = torch.stack([_mlp(xs[r][i], W1[e[i]], W2[e[i]]) for i in range(len(e))])
            y = y + out * ws[r][:, k:k + 1]
        ys.append(y)
        loss = loss + (y * _grad_out(r, y.shape)).sum()
    loss.backward()
    return ys, xs, ws, W1.grad, W2.grad


def _grad_out(r, shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(99 + r))


def _naive_a2a_layer(ctx, st, W1, W2):
    """Classic EP without redundancy: every entry goes to its expert's home rank (all_to_all),
    the home loops over its experts, results come back and are weighted/summed on the source."""
    x, w, t = st.mine
    R, K, epn, dev = st.R, st.K, st.buf.epn, st.dev
    e = t.reshape(-1).long()
    home = e // epn
    order = torch.sort(home, stable=True).indices
    send_n = torch.bincount(home, minlength=R)
    recv_n = torch.empty_like(send_n)
    dist.all_to_all_single(recv_n, send_n)
    sn, rn = send_n.tolist(), recv_n.tolist()
    rows = x.repeat_interleave(K, 0)[order]
    rrows = torch.empty(sum(rn), st.H, dtype=x.dtype, device=dev)
    dist.all_to_all_single(rrows, rows, rn, sn)
    reid = torch.empty(sum(rn), dtype=torch.long, device=dev)
    dist.all_to_all_single(reid, e[order], rn, sn)
    out = torch.zeros_like(rrows)
    for le in range(epn):
        m = reid == ctx.rank * epn + le
        if m.any():
            out[m] = _mlp(rrows[m], W1[ctx.rank * epn + le], W2[ctx.rank * epn + le])
    back = torch.empty_like(rows)
    dist.all_to_all_single(back, out, sn, rn)
    per = torch.empty_like(back)
    per[order] = back
    return (per.view(-1, K, st.H) * w[:, :, None]).sum(1)


def _layer_case(ctx, **cfg):
    st = Setup(ctx, dtype=torch.float32, **cfg)
    Fd, epn, rank, dev = 8, st.buf.epn, ctx.rank, st.dev
    W1, W2 = _expert_weights(st.E, st.H, Fd)
    W1d, W2d = W1.to(dev), W2.to(dev)
    x0, w0, t = st.mine
    x, w_in = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    h, w, cu, plan = st.buf.dispatch(x, t, w_in, total_num_tokens=st.total)
    loc = [W1d[rank * epn:(rank + 1) * epn].clone(), W2d[rank * epn:(rank + 1) * epn].clone()]
    slots = [torch.full_like(loc[0], float("nan")), torch.full_like(loc[1], float("nan"))]
    st.buf.prefetch_weight(plan, local_weights=loc, slot_weights=slots)
    etc = plan.experts_to_copy.cpu()
    for b, e in enumerate(etc[rank].tolist()):            # prefetch: owner's weights, bitwise
        if e >= 0:
            assert torch.equal(slots[0][b], W1d[e]) and torch.equal(slots[1][b], W2d[e])
        else:
            assert torch.isnan(slots[0][b]).all()
    loc = [p.requires_grad_() for p in loc]
    slots = [p.requires_grad_() for p in slots]
    outs, start = [], 0
    for g, end in enumerate(cu.tolist()):
        ws_ = (loc[0][g], loc[1][g]) if g < epn else (slots[0][g - epn], slots[1][g - epn])
        outs.append(_mlp(h[start:end], *ws_))
        start = end
    outs.append(h[start:] * 0)
    z = torch.cat(outs) * w[:, None]
    y, _ = st.buf.combine(plan, z)
    (y * _grad_out(rank, y.shape).to(dev)).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dev.type == "cpu" else dict(rtol=2e-3, atol=2e-3)  # tf32
    # reference 1: naive all-to-all EP, same routing
    y_naive = _naive_a2a_layer(ctx, st, W1d, W2d)
    torch.testing.assert_close(y.detach(), y_naive, **tol)
    # reference 2: dense loop + autograd (CPU)
    ys, xs, ws, gW1, gW2 = _dense_layer(st, W1, W2)
    torch.testing.assert_close(y.detach().cpu(), ys[rank].detach(), **tol)
    torch.testing.assert_close(x.grad.cpu(), xs[rank].grad, **tol)
    torch.testing.assert_close(w_in.grad.cpu(), ws[rank].grad, **tol)
    # weight grads: local + reduce of every rank's slot grads == dense grads of the home experts
    lg = [loc[0].grad, loc[1].grad]
    sg = [slots[0].grad, slots[1].grad]
    unused = [b for b, e in enumerate(etc[rank].tolist()) if e < 0]
    for g_ in sg:
        g_[unused] = 7.0                                   # must stay untouched
    st.buf.reduce_grad(plan, local_grads=lg, slot_grads=sg)
    sl = slice(rank * epn, (rank + 1) * epn)
    torch.testing.assert_close(lg[0].cpu(), gW1[sl], **tol)
    torch.testing.assert_close(lg[1].cpu(), gW2[sl], **tol)
    for b, e in enumerate(etc[rank].tolist()):
        for g_ in sg:
            assert bool((g_[b] == (0.0 if e >= 0 else 7.0)).all()), f"slot {b} (expert {e})"


def case_layer_zipf(ctx):
    _layer_case(ctx, kind="zipf", tp=2, S=10)


def case_layer_per_rank_dup(ctx):
    _layer_case(ctx, kind="dup", per_rank=True, S=9)


def _weighted_grad_case(ctx, dtype, tol_x):
    """Weighted combine's autograd (into x and the route weights, through dispatch) against
    torch's autograd of the explicit formula on this rank's tokens: y[t] = sum_k in k order of
    fp32(dtype(x[t] * (e[t, k] + 1))) * w[t, k], one rounding (y bitwise: the same ops)."""
    st = Setup(ctx, kind="dup", tp=2, dtype=dtype, per_rank=True)
    x0, w0, t = st.mine
    x, w_in = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    h, w, cu, plan = st.buf.dispatch(x, t, w_in, total_num_tokens=st.total)
    scale = (st.segment_experts(cu.cpu()) + 1).clamp(min=0).float().to(st.dev)
    y, _ = st.buf.combine(plan, (h.float() * scale[:, None]).to(dtype), w, weighted=True)
    gy = _grad_out(ctx.rank, y.shape).to(dtype)
    (y.float() * gy.to(st.dev).float()).sum().backward()
    xr, wr = x0.cpu().clone().requires_grad_(), w0.cpu().clone().requires_grad_()
    parts = [(xr.float() * (t[:, k].cpu().float() + 1)[:, None]).to(dtype) for k in range(st.K)]
    yr = fixed_order_sum(parts, dtype, wr)
    (yr.float() * gy.float()).sum().backward()
    assert torch.equal(y.detach().cpu(), yr.detach()), "weighted combine differs from its formula"
    torch.testing.assert_close(x.grad.cpu(), xr.grad, rtol=tol_x, atol=tol_x)
    torch.testing.assert_close(w_in.grad.cpu(), wr.grad, rtol=1e-5, atol=1e-5)


def case_weighted_grad_fp32(ctx):
    _weighted_grad_case(ctx, torch.float32, 1e-5)


def case_weighted_grad_bf16(ctx):
    # x's grad: the library rounds dh = bf16(w * dy rows) per slot and sums the K slots in
    # fp32; torch's autograd adds the K bf16 grads in bf16
    _weighted_grad_case(ctx, torch.bfloat16, 2e-2)


def case_weighted_without_weights_one_rank(ctx):
    """weighted=True without route weights on one rank: every rank raises before any row
    moves, and the group stays usable."""
    st = Setup(ctx, kind="uniform")
    h, w, cu, plan = st.dispatch()
    bad = ctx.rank == ctx.R - 1
    with pytest.raises(ValueError, match="weighted|rejected"):
        st.buf.combine(plan, h, None if bad else w, weighted=True)
    y, _ = st.buf.combine(plan, h, w, weighted=True)
    assert torch.equal(y.cpu(), fixed_order_sum([st.me[0]] * st.K, st.dtype, st.me[1]))


def _random_table(R, epn, seed):
    """experts_to_copy with holes, an expert in several slots, self- and remote owners."""
    g = torch.Generator().manual_seed(seed)
    E = R * epn
    etc = torch.randint(-1, E, (R, epn), generator=g)
    etc[0, 0] = E - 1                                      # the last expert twice (if epn > 1)
    etc[-1, -1] = E - 1
    if R > 1:
        etc[1] = -1                                        # an empty rank
    return etc.to(torch.int32)


def _owner_tensor(o, epn, shape, dtype, tag):
    g = torch.Generator().manual_seed(1000 * tag + o)
    return torch.randn(epn, *shape, generator=g).mul(20).to(dtype)


def case_prefetch_random_table(ctx):
    R, epn, dev = ctx.R, 3, ctx.device
    buf = Buffer(4, 8, 2, R * epn, group=ctx.group, device=dev, backend="torch")
    for seed in range(3):
        etc = _random_table(R, epn, seed)
        shapes = [((5, 4), torch.bfloat16), ((3,), torch.float32), ((2, 2), torch.int8)]
        local = [_owner_tensor(ctx.rank, epn, sh, dt, i).to(dev)
                 for i, (sh, dt) in enumerate(shapes)]
        slots = [torch.full_like(t, 3) for t in local]
        torch.ops.moonep.prefetch_weight(etc.to(dev), local, slots, buf.name)
        for b, e in enumerate(etc[ctx.rank].tolist()):
            for i, (sh, dt) in enumerate(shapes):
                got = slots[i][b].cpu()
                if e >= 0:
                    own = _owner_tensor(e // epn, epn, sh, dt, i)
                    assert torch.equal(got, own[e % epn]), (seed, b, e, i)
                else:
                    assert bool((got == 3).all()), "a -1 slot was written"


def case_reduce_grad_random_table(ctx):
    R, epn, rank, dev = ctx.R, 3, ctx.rank, ctx.device
    buf = Buffer(4, 8, 2, R * epn, group=ctx.group, device=dev, backend="torch")
    shape = (4, 5)
    for seed, dt in itertools.product(range(3), (torch.float32, torch.bfloat16)):
        etc = _random_table(R, epn, seed + 10)

        def slot_of(r):
            g = torch.Generator().manual_seed(50 + r + seed)
            return torch.randn(epn, *shape, generator=g).to(dt)
        local = torch.randn(epn, *shape, generator=torch.Generator().manual_seed(7 + rank)).to(dt)
        # fp32 sum, rounded once at the end.  A copy: for fp32, .float() is local itself, and
        # the sum below would then also update local before the op runs (on CPU ranks the check
        # compared local with itself; over NCCL the op added the slots a second time).
        expect = local.float().clone()
        for src in range(R):                               # ascending (src, b): the fixed order
            for b, e in enumerate(etc[src].tolist()):
                if e >= 0 and e // epn == rank:
                    expect[e % epn] = expect[e % epn] + slot_of(src)[b].float()
        local, slots = local.to(dev), slot_of(rank).to(dev)
        before = slots.clone()
        torch.ops.moonep.reduce_grad(etc.to(dev), [local], [slots], buf.name)
        assert torch.equal(local.cpu(), expect.to(dt)), f"not the fixed-order fp32 sum ({dt})"
        for b, e in enumerate(etc[rank].tolist()):
            assert torch.equal(slots[b], torch.zeros_like(slots[b]) if e >= 0 else before[b])


def case_bad_expert_id_one_rank(ctx):
    """A bad id on one rank makes EVERY rank raise (histogram all-gather carries a flag)."""
    st = Setup(ctx, kind="uniform")
    x, w, t = st.mine
    t = t.clone()
    if ctx.rank == ctx.R - 1:
        t[0, 0] = st.E
    st.buf.backend.recv_rows.fill_(3)
    st.buf.backend.recv_meta.fill_(3)
    old = os.environ.get("MOONEP_VALIDATE")
    os.environ["MOONEP_VALIDATE"] = "1"               # value checks are CPU-only by default
    try:
        with pytest.raises(ValueError, match="expert ids|rejected its input"):
            st.buf.dispatch(x, t, w)
    finally:
        if old is None:
            os.environ.pop("MOONEP_VALIDATE")
        else:
            os.environ["MOONEP_VALIDATE"] = old
    assert bool((st.buf.backend.recv_rows == 3).all()) and bool((st.buf.backend.recv_meta == 3).all())
    # the group is still usable afterwards
    _, _, _, plan = st.dispatch()
    assert torch.equal(plan.dst.cpu(), st.group.plans[ctx.rank].dst)


def case_bad_total_num_tokens(ctx):
    st = Setup(ctx, kind="uniform", s=4)
    x, w, t = st.mine
    bad_total = 4 * ctx.R - (1 if ctx.rank == 0 and ctx.R > 1 else 0)
    if ctx.R > 1:
        with pytest.raises(ValueError, match="total_num_tokens"):
            st.buf.dispatch(x, t, w, total_num_tokens=bad_total)
    st.dispatch()


def case_compile_fullgraph(ctx):
    import torch._dynamo
    from torch._dynamo.utils import counters
    st = Setup(ctx, kind="zipf", tp=2, dtype=torch.bfloat16)
    x, w, t = st.mine
    buf = st.buf

    def block(x, t, w):
        h, wn, cu, plan = buf.dispatch(x, t, w)
        z = (h.float() * wn[:, None]).to(h.dtype)
        y, _ = buf.combine(plan, z)
        return y

    torch._dynamo.reset()
    counters.clear()
    cf = torch.compile(block, backend="aot_eager", fullgraph=True)
    got = cf(x, t, w)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert torch.equal(got, block(x, t, w))


def case_opcheck_dist(ctx):
    st = Setup(ctx, kind="dup", tp=2, dtype=torch.float32, S=6)
    _opcheck_all(st.buf, *st.mine, total=-1)


# case_opcheck_dist is expensive: one gloo world is enough
MULTI_RANK = multi_rank_cases(globals(), only_at={"case_opcheck_dist": (2,),
                                                  "case_weighted_grad_fp32": (1, 2, 4),
                                                  "case_weighted_grad_bf16": (1, 2, 4)})
_results = cached_runner(__name__, MULTI_RANK, timeout_s=400, pg_timeout_s=30)


@pytest.mark.parametrize("R,case", MULTI_RANK)
def test_multi_rank(R, case):
    res = _results(R)[case]
    assert res.ok, res.error


# ---------------------------------------------------------------------------------------------
# Single process (R = 1 Buffer): opcheck, bad input, compile
# ---------------------------------------------------------------------------------------------


def _opcheck_all(buf, x, w, t, total=-1):
    from torch.library import opcheck
    ops = torch.ops.moonep
    name = buf.name
    xs = [x, x.clone().requires_grad_()]
    for xx in xs:
        for ww in (None, w.clone().requires_grad_(xx.requires_grad)):
            opcheck(ops.dispatch.default, (xx, t, ww, name, total))
    h, wn, cu, dst, etc, zf, stats = ops.dispatch(x, t, w, name, total)
    for xx in xs:
        opcheck(ops.dispatch_with_plan.default, (xx, w.clone().requires_grad_(xx.requires_grad),
                                                 dst, name, total))
        opcheck(ops.dispatch_with_plan.default, (xx, None, dst, name, total))
    for hh in (h, h.clone().requires_grad_()):
        opcheck(ops.combine.default, (hh, wn.clone().requires_grad_(hh.requires_grad), dst,
                                      name, total))
        opcheck(ops.combine.default, (hh, None, dst, name, total))
        for w_grad in (False, hh.requires_grad):        # weighted: grads of h and w (or h)
            opcheck(ops.combine.default, (hh, wn.clone().requires_grad_(w_grad), dst, name,
                                          total, True))
    epn, dev = buf.epn, x.device
    loc = [torch.randn(epn, 3, 2, device=dev), torch.randn(epn, 4, device=dev).bfloat16()]
    opcheck(ops.prefetch_weight.default, (etc, loc, [torch.zeros_like(v) for v in loc], name))
    grads = [torch.randn(epn, 3, 2, device=dev), torch.randn(epn, 5, device=dev)]
    opcheck(ops.reduce_grad.default, (etc, [g.clone() for g in grads],
                                      [torch.randn_like(g) for g in grads], name))


def _single(S=6, H=8, K=3, E=4, tp=2, dtype=torch.float32, s=5, kind="dup"):
    buf = Buffer(S, H, K, E, token_padding=tp, dtype=dtype)
    x, w = token_inputs(0, s, H, K, dtype, 3)
    t = routing(kind, 0, 1, s, K, E, 3)
    return buf, x, w, t


def test_opcheck_single_rank():
    buf, x, w, t = _single()
    _opcheck_all(buf, x, w, t)


def test_opcheck_weighted_combine_bf16():
    """The bf16 weighted combine, whose backward runs moonep::scale_rows_backward."""
    from torch.library import opcheck
    buf, x, w, t = _single(dtype=torch.bfloat16)
    h, wn, cu, plan = buf.dispatch(x, t, w)
    opcheck(torch.ops.moonep.combine.default, (h.clone().requires_grad_(),
                                               wn.clone().requires_grad_(), plan.dst, buf.name,
                                               -1, True))


def test_schemas():
    assert str(torch.ops.moonep.dispatch.default._schema) == (
        "moonep::dispatch(Tensor x, Tensor topk_ids, Tensor? route_weights, str buffer, "
        "int total_num_tokens) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
    assert str(torch.ops.moonep.combine.default._schema) == (
        "moonep::combine(Tensor h, Tensor? route_weights, Tensor dst, str buffer, "
        "int total_num_tokens, bool weighted=False) -> (Tensor, Tensor)")
    assert "Tensor(a2!)[] slot_weights" in str(torch.ops.moonep.prefetch_weight.default._schema)
    sch = str(torch.ops.moonep.reduce_grad.default._schema)
    assert "Tensor(a1!)[] local_grads" in sch and "Tensor(a2!)[] slot_grads" in sch
    # capturable on the CUDA backend: no cudagraph_unsafe tag (the host backends refuse capture)
    for op in ("dispatch", "dispatch_with_plan", "combine", "prefetch_weight", "reduce_grad"):
        assert torch.Tag.cudagraph_unsafe not in getattr(torch.ops.moonep, op).default.tags


def test_fake_shapes_meta():
    """Fake kernels: shapes from Python ints only (meta tensors, no data)."""
    buf, x, w, t = _single(S=9, tp=4, s=7)
    h, wn, cu, dst, etc, zf, st = torch.ops.moonep.dispatch(
        x.to("meta"), t.to("meta"), w.to("meta"), buf.name, -1)
    assert h.shape == (buf.nvs_s(7), 8) and wn.shape == (buf.nvs_s(7),)
    assert cu.shape == (buf.G,) and dst.shape == (21,) and etc.shape == (1, buf.epn)
    assert zf.shape == (buf.G, 2) and st.shape == (2,)


def test_compile_single_rank_inductor():
    import torch._dynamo
    from torch._dynamo.utils import counters
    buf, x, w, t = _single(dtype=torch.float32, kind="zipf")

    def block(x, t, w):
        h, wn, cu, plan = buf.dispatch(x, t, w)
        y, wk = buf.combine(plan, h * wn[:, None] * 2, wn)
        return y, wk, buf.combine(plan, h * 2, wn, weighted=True)[0]

    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(block, fullgraph=True)(x, t, w)
    assert not counters["graph_break"]
    ref = block(x, t, w)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_compile_autograd_single_rank():
    import torch._dynamo
    from torch._dynamo.utils import counters
    buf, x, w, t = _single(dtype=torch.float32, kind="dup")

    def block(x, t, w):
        h, wn, cu, plan = buf.dispatch(x, t, w)
        y, _ = buf.combine(plan, h * wn[:, None])
        return y

    torch._dynamo.reset()
    counters.clear()
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ws = [w.clone().requires_grad_() for _ in range(2)]
    y0 = torch.compile(block, backend="aot_eager", fullgraph=True)(xs[0], t, ws[0])
    y1 = block(xs[1], t, ws[1])
    assert not counters["graph_break"]
    y0.sum().backward()
    y1.sum().backward()
    assert torch.equal(y0, y1) and torch.equal(xs[0].grad, xs[1].grad)
    assert torch.equal(ws[0].grad, ws[1].grad)


def test_gradcheck_fp64():
    buf, x, w, t = _single(dtype=torch.float64, kind="dup", s=3)
    x = x.clone().requires_grad_()
    scale = torch.rand(buf.nvs_s(3), 1, dtype=torch.float64)

    def f(x):                          # route weights are fp32 by contract: checked elsewhere
        h, wn, cu, plan = buf.dispatch(x, t, w)
        y, wk = buf.combine(plan, h * (wn[:, None] + scale))
        return y

    torch.autograd.gradcheck(f, (x,))

    def g(x, w_M):                     # weighted: fp64 rows times fp32 weights, in fp64
        h, _, cu, plan = buf.dispatch(x, t, w)
        return buf.combine(plan, h * (scale + 1), w_M, weighted=True)[0]

    w_M = buf.dispatch(x, t, w)[1].detach().requires_grad_()
    torch.autograd.gradcheck(g, (x, w_M), eps=1e-3, atol=1e-4)


# -- bad input: clear errors before anything is written ----------------------------------------


def _snapshot(buf):
    return buf.backend.recv_rows.clone(), buf.backend.recv_meta.clone(), buf.backend.recv_weights.clone()


def _unchanged(buf, snap):
    return all(torch.equal(a, b) for a, b in zip(_snapshot(buf), snap))


BAD_DISPATCH = {
    "x_dtype": (TypeError, lambda x, t, w: (x.double(), t, w)),
    "x_hidden": (ValueError, lambda x, t, w: (x[:, :4].contiguous(), t, w)),
    "x_noncontig": (ValueError, lambda x, t, w: (x.t().contiguous().t(), t, w)),
    "x_3d": (ValueError, lambda x, t, w: (x[None], t, w)),
    "topk_int64": (TypeError, lambda x, t, w: (x, t.long(), w)),
    "topk_rows": (ValueError, lambda x, t, w: (x, t[:-1].contiguous(), w)),
    "topk_K": (ValueError, lambda x, t, w: (x, t[:, :2].contiguous(), w[:, :2].contiguous())),
    "expert_id_E": (ValueError, lambda x, t, w: (x, t.clone().fill_(4), w)),
    "expert_id_neg": (ValueError, lambda x, t, w: (x, t.clone().fill_(-1), w)),
    "weights_dtype": (TypeError, lambda x, t, w: (x, t, w.double())),
    "weights_shape": (ValueError, lambda x, t, w: (x, t, w[:-1].contiguous())),
    "weights_noncontig": (ValueError, lambda x, t, w: (x, t, w.t().contiguous().t())),
    "s_above_S": (ValueError, lambda x, t, w: (torch.cat([x, x]), torch.cat([t, t]),
                                               torch.cat([w, w]))),
    "s_zero": (ValueError, lambda x, t, w: (x[:0], t[:0], w[:0])),
}


@pytest.mark.parametrize("case", sorted(BAD_DISPATCH))
def test_bad_dispatch(case):
    exc, make = BAD_DISPATCH[case]
    buf, x, w, t = _single()
    snap = _snapshot(buf)
    with pytest.raises(exc):
        buf.dispatch(*make(x, t, w))
    with pytest.raises(exc):                       # the op itself checks too
        torch.ops.moonep.dispatch(*make(x, t, w), buf.name, -1)
    assert _unchanged(buf, snap)
    buf.dispatch(x, t, w)                          # and the good call still works


def test_bad_total_num_tokens_single():
    buf, x, w, t = _single()
    with pytest.raises(ValueError, match="total_num_tokens"):
        buf.dispatch(x, t, w, total_num_tokens=x.shape[0] - 1)
    with pytest.raises(TypeError):
        buf.dispatch(x, t, w, total_num_tokens=2.5)


def test_bad_plan_reuse_and_combine():
    buf, x, w, t = _single()
    h, wn, cu, plan = buf.dispatch(x, t, w)
    snap = _snapshot(buf)
    with pytest.raises(ValueError, match="same s"):
        buf.dispatch(x[:-1].contiguous(), plan=plan)
    with pytest.raises(ValueError, match="same number of tokens"):
        torch.ops.moonep.dispatch_with_plan(x[:-1].contiguous(), None, plan.dst, buf.name, -1)
    with pytest.raises(ValueError, match="nvs_s"):
        buf.combine(plan, h[:-1])
    with pytest.raises(ValueError, match="rows"):
        buf.combine(plan, h, wn[:-1])
    with pytest.raises(TypeError):
        buf.combine(plan, h.double())
    with pytest.raises(TypeError):
        buf.combine(plan._asdict(), h)
    with pytest.raises(ValueError, match="contiguous"):
        buf.combine(plan, h.t().contiguous().t())
    with pytest.raises(ValueError, match="weighted=True"):          # weights required
        buf.combine(plan, h, weighted=True)
    for hh, dst in ((h, plan.dst), (h.to("meta"), plan.dst.to("meta"))):   # kernel and fake
        with pytest.raises(ValueError, match="weighted=True"):
            torch.ops.moonep.combine(hh, None, dst, buf.name, -1, True)
    with pytest.raises(TypeError, match="bool"):
        buf.combine(plan, h, wn, weighted=1)
    assert _unchanged(buf, snap)
    # a plan of another token count / another Buffer
    _, _, _, plan3 = buf.dispatch(x[:3].contiguous(), t[:3].contiguous())
    snap = _snapshot(buf)
    with pytest.raises(ValueError):
        buf.combine(plan3, h)
    other = Buffer(6, 8, 3, 8, token_padding=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="another Buffer"):
        other.combine(plan, h)
    with pytest.raises(ValueError, match="plan"):   # dst naming rows past nvs_s (corrupt plan)
        torch.ops.moonep.combine(h, None, plan.dst.clone().fill_(buf.NvS - 1), buf.name, -1)
    assert _unchanged(buf, snap)
    with pytest.raises(ValueError, match="no live moonep"):
        torch.ops.moonep.combine(h, None, plan.dst, "nope", -1)


def test_bad_prefetch_reduce_nothing_written():
    buf, x, w, t = _single()
    *_, plan = buf.dispatch(x, t, w)
    epn = buf.epn
    loc = [torch.randn(epn, 3)]
    slots = [torch.full((epn, 3), 5.0)]
    bad = {
        "len": dict(local_weights=loc, slot_weights=slots + slots),
        "rows": dict(local_weights=[torch.randn(epn + 1, 3)],
                     slot_weights=[torch.zeros(epn + 1, 3)]),
        "shape": dict(local_weights=loc, slot_weights=[torch.zeros(epn, 4)]),
        "dtype": dict(local_weights=[loc[0].double()], slot_weights=slots),
        "noncontig": dict(local_weights=[torch.randn(3, epn).t()], slot_weights=slots),
        "alias": dict(local_weights=slots, slot_weights=slots),
    }
    for name, kw in bad.items():
        with pytest.raises((ValueError, TypeError)):
            buf.prefetch_weight(plan, **kw)
        assert bool((slots[0] == 5).all()), name
    g = [torch.randn(epn, 3)]
    g0 = g[0].clone()
    with pytest.raises(TypeError, match="float32"):
        buf.reduce_grad(plan, local_grads=[g[0].double()],
                        slot_grads=[torch.zeros(epn, 3).double()])
    with pytest.raises(ValueError):
        buf.reduce_grad(plan, local_grads=g, slot_grads=[torch.zeros(epn, 2)])
    with pytest.raises(ValueError, match="experts_to_copy"):
        torch.ops.moonep.reduce_grad(plan.experts_to_copy.clone().fill_(buf.E), g,
                                     [torch.ones(epn, 3)], buf.name)
    with pytest.raises(ValueError, match="experts_to_copy"):
        torch.ops.moonep.reduce_grad(plan.experts_to_copy[:, :1].contiguous(), g,
                                     [torch.ones(epn, 3)], buf.name)
    assert torch.equal(g[0], g0)


def test_buffer_geometry_and_registry():
    buf = Buffer(64, 32, 4, 8, token_padding=8, dtype=torch.bfloat16)
    assert buf.backend.recv_rows.shape == (buf.NvS, 32) and buf.NvS == 64 * 4 + 7 * 16
    assert buf.nvs_s(64) == buf.NvS and buf.nvs_s(1) == 8 + 7 * 16
    from moonep_ops import registry
    from moonep_ops.backends import Backend
    assert registry.lookup(buf.name, Backend) is buf.backend
    name = buf.name
    buf.destroy()
    with pytest.raises(ValueError, match="no live moonep Backend"):
        registry.lookup(name, Backend)
    with pytest.raises(ValueError):
        Buffer(4, 8, 2, 4, policy="nope")
    with pytest.raises(ValueError):
        Buffer(4, 0, 2, 4)
    with pytest.raises(TypeError):
        Buffer(4, 8, 2, 4, dtype=torch.int32)
