"""The CUDA symmetric-memory data plane (moonep_ops/backends/symm.py, csrc/ep_kernels.cu).

R > 1 runs as virtual ranks on the one GPU (moonep_ops/testing/virtual_ranks.py); R = 1 also through
torch.distributed._symmetric_memory with a one-rank NCCL group.  References are the CPU planner
(plan_all_ranks) and the data-plane semantics the gloo tests pin (tests/test_data_plane.py), so
"bitwise equal to the CPU/gloo path" is checked entry by entry.  Skipped without a GPU or
without libmoonep_ep.so.
"""
from __future__ import annotations

import pytest
import torch

from moonep_ops import native
from moonep_ops.buffer import Buffer
from moonep_ops.planner import plan_all_ranks

from test_data_plane import SCATTER_CONFIGS, fixed_order_sum, routing, token_inputs, _random_table
from moonep_ops.testing.virtual_ranks import run_threads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or native.ep() is None,
                                reason="needs a CUDA device and libmoonep_ep.so")


def _setup(R, E=8, K=3, H=16, S=12, tp=1, kind="uniform", s=None, dtype=torch.bfloat16, seed=0,
           per_rank=False):
    if per_rank:
        sizes = tuple(max(1, S - 3 * r) if r % 2 == 0 else 1 + r for r in range(R))
    else:
        sizes = (s or S,) * R
    total = sum(sizes) if per_rank else None
    xs, ws, ts = [], [], []
    for r in range(R):
        x, w = token_inputs(r, sizes[r], H, K, dtype, seed)
        xs.append(x), ws.append(w), ts.append(routing(kind, r, R, sizes[r], K, E, seed))
    group = plan_all_ranks(ts, E, tp, capacity=S, total_num_tokens=total)
    c = dict(R=R, E=E, K=K, H=H, S=S, tp=tp, dtype=dtype, xs=xs, ws=ws, ts=ts, total=total,
             group=group)
    c["expected"] = [_expected_scatter(c, d) for d in range(R)]
    return c


def _expected_scatter(c, rank, xs=None):
    xs = xs or c["xs"]
    p_me = c["group"].plans[rank]
    h = torch.zeros(p_me.nvs_s, c["H"], dtype=c["dtype"])
    w = torch.zeros(p_me.nvs_s)
    for r, p in enumerate(c["group"].plans):
        n = (p.dest_rank == rank).nonzero().squeeze(1)
        h[p.slot[n]] = xs[r][n // c["K"]]
        w[p.slot[n]] = c["ws"][r].reshape(-1)[n]
    return h, w


RANK_OPS_STAGES = ("dispatch", "combine", "scaled", "reuse", "autograd")


def rank_ops(c, buf, r, stop=None):
    """Every data-plane op of rank r, queued without reading anything on the host, so virtual
    ranks can all be queued from one thread (their barriers meet on the device).  Returns the
    device outputs for verify_rank; with stop (one of RANK_OPS_STAGES), only the stages up to
    that one (diagnostics/virtual_rank_timeouts.py; verify_rank needs them all)."""
    if stop is not None and stop not in RANK_OPS_STAGES:
        raise ValueError(f"stop must be one of {RANK_OPS_STAGES}, got {stop!r}")
    dt = c["dtype"]
    dev = buf.device
    x, w_in, t = c["xs"][r].to(dev), c["ws"][r].to(dev), c["ts"][r].to(dev)
    o = {}
    o["h"], o["w"], o["cu"], plan = buf.dispatch(x, t, w_in, total_num_tokens=c["total"])
    o["plan"] = plan
    if stop == "dispatch":
        return o
    o["y"], o["wk"] = buf.combine(plan, o["h"], o["w"])
    if stop == "combine":
        return o
    # per-row scaling, and the NvS-row form of combine, plain and weighted
    scale = (torch.arange(o["h"].shape[0], device=dev) % 5 + 1).float()
    hs = (o["h"].float() * scale[:, None]).to(dt)
    hfull = torch.cat([hs, hs.new_zeros(buf.NvS - hs.shape[0], c["H"])])
    o["ys"], o["none"] = buf.combine(plan, hfull)
    wfull = torch.cat([o["w"], o["w"].new_zeros(buf.NvS - o["w"].shape[0])])
    o["yw"], _ = buf.combine(plan, hfull, wfull, weighted=True)
    if stop == "scaled":
        return o
    # plan reuse
    x2 = (x.float() * 3 - 1).to(dt)
    o["h2"], o["w2"], _, _ = buf.dispatch(x2, route_weights_sK=w_in, plan=plan)
    if stop == "reuse":
        return o
    # autograd: dispatch backward = combine, combine backward = dispatch (both on the device)
    xg = x.clone().requires_grad_()
    wg = w_in.clone().requires_grad_()
    hh, ww, _, pl = buf.dispatch(xg, t, wg, total_num_tokens=c["total"])
    yy, wkk = buf.combine(pl, (hh.float() * 1.5).to(dt), ww)
    torch.autograd.backward([yy, wkk], [torch.ones_like(yy), torch.full_like(wkk, 2.0)])
    o["gx"], o["gw"] = xg.grad, wg.grad
    return o


def verify_rank(c, buf, r, o):
    """Every output of rank_ops against the CPU references (any SymmBackend heap)."""
    K, dt = c["K"], c["dtype"]
    buf.check_errors()
    ref, plan = c["group"].plans[r], o["plan"]
    for name, a, b in (("dst", plan.dst, ref.dst), ("cu_seqlens", o["cu"], ref.cu_seqlens),
                       ("experts_to_copy", plan.experts_to_copy, ref.experts_to_copy),
                       ("zero_fill", plan.zero_fill_ranges, ref.zero_fill_ranges),
                       ("remote_stats", plan.remote_stats, ref.remote_stats)):
        assert torch.equal(a.cpu(), b), f"rank {r}: {name} differs from the CPU planner"
    eh, ew = c["expected"][r]
    assert torch.equal(o["h"].cpu(), eh), f"rank {r}: dispatched rows differ"
    assert torch.equal(o["w"].cpu().view(torch.int32), ew.view(torch.int32)), f"rank {r}: weights"
    assert torch.equal(o["y"].cpu(), fixed_order_sum([c["xs"][r]] * K, dt)), f"rank {r}: combine"
    assert torch.equal(o["wk"].cpu(), c["ws"][r]), f"rank {r}: gathered weights"
    assert o["none"] is None
    # rows this rank's tokens landed in live on other ranks: rebuild from those ranks' scatter
    slot = ref.slot.view(-1, K)
    parts = []
    for k in range(K):
        rows = []
        for tok in range(c["xs"][r].shape[0]):
            d, sl = int(ref.dest_rank.view(-1, K)[tok, k]), int(slot[tok, k])
            rows.append((c["expected"][d][0][sl].float() * float(sl % 5 + 1)).to(dt))
        parts.append(torch.stack(rows))
    assert torch.equal(o["ys"].cpu(), fixed_order_sum(parts, dt)), f"rank {r}: scaled combine"
    assert torch.equal(o["yw"].cpu(), fixed_order_sum(parts, dt, c["ws"][r])), \
        f"rank {r}: weighted combine"
    eh2, _ = _expected_scatter(c, r, [(xx.float() * 3 - 1).to(dt) for xx in c["xs"]])
    assert torch.equal(o["h2"].cpu(), eh2) and torch.equal(o["w2"], o["w"]), f"rank {r}: reuse"
    gy = torch.ones(c["xs"][r].shape, dtype=dt)
    exp_gx = fixed_order_sum([(gy.float() * 1.5).to(dt)] * K, dt)
    assert torch.equal(o["gx"].cpu(), exp_gx), f"rank {r}: grad x"
    assert torch.equal(o["gw"].cpu(), torch.full_like(c["ws"][r], 2.0)), f"rank {r}: grad w"
    return True


def check_rank_buffer(c, buf, r):
    return verify_rank(c, buf, r, rank_ops(c, buf, r))


def _check_virtual(R, c, combine="auto"):
    """All virtual ranks queued from this thread, each on its own stream, then verified."""
    from moonep_ops.testing.virtual_ranks import VirtualGroup
    vg = VirtualGroup(R)
    bufs = [Buffer(c["S"], c["H"], c["K"], c["E"], token_padding=c["tp"], dtype=c["dtype"],
                   device=vg.device, backend=vg.backend(r, combine=combine)) for r in range(R)]
    for b in bufs:
        assert b.backend.direct == (combine != "stage" and R == 1)
    streams = [torch.cuda.Stream() for _ in range(R)]
    outs = []
    for r in range(R):
        with torch.cuda.stream(streams[r]):
            outs.append(rank_ops(c, bufs[r], r))
    torch.cuda.synchronize()
    for r in range(R):
        verify_rank(c, bufs[r], r, outs[r])


CONFIGS = dict(SCATTER_CONFIGS)
CONFIGS["skewed_large"] = dict(kind="zipf", E=32, K=8, H=256, S=64, tp=8)


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_virtual_dispatch_combine(R, name):
    """Default combine mode: direct (h read in place) at R = 1, staged for R > 1."""
    cfg = dict(CONFIGS[name])
    if cfg.get("E", 8) % R:         # e.g. k1's 4 experts at R = 8: same routing kind, epn 4
        cfg["E"] = 4 * R
    _check_virtual(R, _setup(R, **cfg))


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["dup", "per_rank_s", "larger_zipf_tp8", "uniform_fp32_tp4"])
def test_virtual_dispatch_combine_staged(R, name):
    """Staged combine forced, R = 1 included (the only mode of several ranks)."""
    _check_virtual(R, _setup(R, **CONFIGS[name]), combine="stage")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("combine", ["auto", "stage"])
def test_weighted_combine_matches_cpu(dtype, combine):
    """Weighted combine (the MoE layer's route-weight step) on the symmetric backend against the
    CPU reference on a skewed routing, one rank, direct and staged: y bitwise; through autograd
    x's grad bitwise (dh = dtype(w * dy rows): moonep::scale_rows_backward for bf16), the
    route weights' within fp32 reassociation (sum_D fp32(h) * dy: another order on CUDA)."""
    from moonep_ops.testing import make_routing
    from moonep_ops.testing.virtual_ranks import VirtualGroup
    S, H, K, E, tp = 64, 256, 8, 32, 8
    vg = VirtualGroup(1)
    gpu = Buffer(S, H, K, E, token_padding=tp, dtype=dtype, device=vg.device,
                 backend=vg.backend(0, combine=combine))
    cpu = Buffer(S, H, K, E, token_padding=tp, dtype=dtype, device="cpu")
    for s, seed in ((S, 0), (37, 1), (1, 2)):
        t = make_routing("zipf", 1, E, s, K, seed=seed, alpha=1.5)[0]
        x, w = token_inputs(0, s, H, K, dtype, seed)
        gy = torch.randn(s, H, generator=torch.Generator().manual_seed(seed)).to(dtype)
        outs = []
        for buf in (gpu, cpu):
            dev = buf.device
            xg, wg = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
            h, wn, cu, plan = buf.dispatch(xg, t.to(dev), wg)
            scale = (torch.arange(h.shape[0], device=dev) % 7 + 1).float()   # rows differ
            y, _ = buf.combine(plan, (h.float() * scale[:, None]).to(dtype), wn, weighted=True)
            (y.float() * gy.to(dev).float()).sum().backward()
            outs.append((y.detach().cpu(), xg.grad.cpu(), wg.grad.cpu()))
        (yg, gxg, gwg), (yc, gxc, gwc) = outs
        assert torch.equal(yg, yc), f"s={s}: weighted combine differs from the CPU reference"
        assert torch.equal(gxg, gxc), f"s={s}: grad of x"
        torch.testing.assert_close(gwg, gwc, rtol=1e-5, atol=1e-5)
    gpu.check_errors()


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_prefetch_reduce_virtual(R):
    from moonep_ops.testing.virtual_ranks import VirtualGroup
    vg = VirtualGroup(R)
    fn = prefetch_reduce_case(R, lambda r, *a, **k: Buffer(*a, device=vg.device,
                                                           backend=vg.backend(r), **k))
    assert all(run_threads(R, fn))


def prefetch_reduce_case(R, make_buffer):
    """rank_fn(r) checking prefetch_weight / reduce_grad bitwise on a random table, with more
    tensors than one launch takes (10 weights, 9 grads: an FP8 expert with biases pushes 9)."""
    E, epn = 4 * R, 4
    etc = _random_table(R, epn, seed=R)
    kinds = [((3, 5), torch.bfloat16), ((7,), torch.float32)] * 5

    def owner(o, shape, dtype, tag):
        g = torch.Generator().manual_seed(1000 * tag + o)
        return torch.randn(epn, *shape, generator=g).to(dtype)

    def rank_fn(r):
        buf = make_buffer(r, 8, 16, 2, E, dtype=torch.bfloat16)
        dev = buf.device
        local = [owner(r, shape, dt, i + 1).to(dev) for i, (shape, dt) in enumerate(kinds)]
        slots = [buf.symmetric_zeros((epn, *shape), dt) for shape, dt in kinds]
        for t in slots[::2]:
            t.fill_(-3)
        torch.ops.moonep.prefetch_weight(etc.to(dev), local, slots, buf.name)
        for b in range(epn):
            e = int(etc[r, b])
            for i, (shape, dt) in enumerate(kinds):
                got = slots[i][b].cpu()
                if e < 0:
                    exp = torch.full(shape, -3.0 if i % 2 == 0 else 0.0, dtype=dt)
                else:
                    exp = owner(e // epn, shape, dt, i + 1)[e % epn]
                assert torch.equal(got, exp), f"rank {r} slot {b} tensor {i}"
        # reduce_grad: fixed order, fp32 sum (bf16: rounded once), consumed slots zeroed
        for dt in (torch.float32, torch.bfloat16):
            tags = range(20, 29)
            lg = [owner(r, (6,), dt, t).to(dev) for t in tags]
            sg = [buf.symmetric_zeros((epn, 6), dt) for _ in tags]
            for g, t in zip(sg, tags):
                g.copy_(owner(r, (6,), dt, t + 10).to(dev))
            torch.ops.moonep.reduce_grad(etc.to(dev), lg, sg, buf.name)
            for j, t in enumerate(tags):
                exp = owner(r, (6,), dt, t).float()
                for src in range(R):
                    for b in range(epn):
                        e = int(etc[src, b])
                        if e >= 0 and e // epn == r:
                            exp[e % epn] += owner(src, (6,), dt, t + 10)[b].float()
                assert torch.equal(lg[j].cpu(), exp.to(dt)), f"rank {r}: reduced grads {j} ({dt})"
                mine = owner(r, (6,), dt, t + 10)
                for b in range(epn):
                    exp_slot = torch.zeros(6, dtype=dt) if int(etc[r, b]) >= 0 else mine[b]
                    assert torch.equal(sg[j][b].cpu(), exp_slot), \
                        f"rank {r}: slot {b} of grad {j} after reduce"
        with pytest.raises(ValueError, match="symmetric_zeros"):
            torch.ops.moonep.prefetch_weight(etc.to(dev), local, [torch.zeros_like(t) for t in local],
                                             buf.name)
        buf.check_errors()
        return True

    return rank_fn


def _step_inputs(R, s, H, K, E, seed, skew):
    xs, ws, ts = [], [], []
    for r in range(R):
        x, w = token_inputs(r, s, H, K, torch.bfloat16, seed)
        xs.append(x), ws.append(w), ts.append(routing("zipf" if skew else "uniform", r, R, s, K, E, seed))
    return xs, ws, ts


@pytest.mark.parametrize("R", [1, 2])
def test_no_host_sync_and_cuda_graph_replay(R):
    """A whole dispatch -> combine forward + backward of every virtual rank is queued from ONE
    thread under sync_debug_mode("error"); then captured in CUDA graphs and replayed with new
    routing copied into the static inputs, with correct results each time."""
    from moonep_ops.testing.virtual_ranks import VirtualGroup
    S, H, K, E, tp = 32, 64, 4, 8 * R, 4
    vg = VirtualGroup(R)
    bufs = [Buffer(S, H, K, E, token_padding=tp, dtype=torch.bfloat16, device=vg.device,
                   backend=vg.backend(r)) for r in range(R)]
    dev = bufs[0].device
    streams = [torch.cuda.Stream() for _ in range(R)]
    xs_s = [torch.zeros(S, H, dtype=torch.bfloat16, device=dev, requires_grad=True) for _ in range(R)]
    ws_s = [torch.zeros(S, K, device=dev) for _ in range(R)]
    ts_s = [torch.zeros(S, K, dtype=torch.int32, device=dev) for _ in range(R)]
    gy_s = [torch.zeros(S, H, dtype=torch.bfloat16, device=dev) for _ in range(R)]

    def step(r):
        h, w, cu, plan = bufs[r].dispatch(xs_s[r], ts_s[r], ws_s[r])
        z = (h.float() * w[:, None]).to(torch.bfloat16)
        y, _ = bufs[r].combine(plan, z)
        gx, = torch.autograd.grad(y, xs_s[r], gy_s[r])
        return y, gx, cu

    def load(seed, skew):
        xs, ws, ts = _step_inputs(R, S, H, K, E, seed, skew)
        with torch.no_grad():
            for r in range(R):
                xs_s[r].copy_(xs[r]), ws_s[r].copy_(ws[r]), ts_s[r].copy_(ts[r])
                gy_s[r].copy_(torch.ones(S, H) * (r + 1))
        torch.cuda.synchronize()
        return xs, ws, ts

    def expected(xs, ws, ts):
        grp = plan_all_ranks(ts, E, tp, capacity=S)
        out = []
        for r in range(R):
            p = grp.plans[r]
            parts = [(xs[r].float() * ws[r][:, k:k + 1]).to(torch.bfloat16) for k in range(K)]
            y = fixed_order_sum(parts, torch.bfloat16)
            gparts = [(gy_s[r].cpu().float() * ws[r][:, k:k + 1]).to(torch.bfloat16) for k in range(K)]
            out.append((y, fixed_order_sum(gparts, torch.bfloat16), p.cu_seqlens))
        return out

    # 1) eager, every rank queued from this thread, no host sync allowed
    xs, ws, ts = load(0, skew=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = []
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                outs.append(step(r))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for r, ((y, gx, cu), (ey, egx, ecu)) in enumerate(zip(outs, expected(xs, ws, ts))):
        assert torch.equal(y.cpu(), ey) and torch.equal(gx.cpu(), egx) and torch.equal(cu.cpu(), ecu)
    # 2) capture every rank's step in its own graph (thread-local capture mode), replay
    graphs = [torch.cuda.CUDAGraph() for _ in range(R)]
    static = [None] * R
    for r in range(R):               # warm-up on the side streams (allocator pools)
        with torch.cuda.stream(streams[r]):
            step(r)
    torch.cuda.synchronize()
    for r in range(R):
        with torch.cuda.graph(graphs[r], stream=streams[r]):
            static[r] = step(r)
    torch.cuda.synchronize()
    for seed, skew in ((1, False), (2, True), (3, True)):
        xs, ws, ts = load(seed, skew)
        for r in range(R):
            with torch.cuda.stream(streams[r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        for r, ((y, gx, cu), (ey, egx, ecu)) in enumerate(zip(static, expected(xs, ws, ts))):
            assert torch.equal(cu.cpu(), ecu), f"replay {seed} rank {r}: cu_seqlens"
            assert torch.equal(y.cpu(), ey), f"replay {seed} rank {r}: y"
            assert torch.equal(gx.cpu(), egx), f"replay {seed} rank {r}: grad x"
    for b in bufs:
        b.check_errors()


def test_barrier_timeout_sets_flag_without_hanging():
    from moonep_ops.testing.virtual_ranks import VirtualGroup
    vg = VirtualGroup(2)
    b0 = Buffer(4, 8, 2, 4, dtype=torch.float32, device=vg.device, backend=vg.backend(0, timeout_s=0.2))
    Buffer(4, 8, 2, 4, dtype=torch.float32, device=vg.device, backend=vg.backend(1))  # never calls
    b0.check_errors()
    b0.backend.barrier("staged")     # rank 1 never arrives
    torch.cuda.synchronize()
    with pytest.raises(TimeoutError, match="timed out"):
        b0.check_errors()
    # the group is broken now: later ops return quickly with zeros instead of hanging
    x = torch.randn(4, 8, device=vg.device)
    t = torch.zeros(4, 2, dtype=torch.int32, device=vg.device)
    h, w, cu, plan = b0.dispatch(x, t)
    torch.cuda.synchronize()
    assert not h.any()


def test_a_rank_that_stops_mid_step_is_named_within_the_timeout():
    """Fault test: rank 1 of 2 virtual ranks runs the first op of a step (dispatch) with rank 0
    and then stops calling.  Rank 0's combine times out; check_errors raises a TimeoutError that
    names the op and the missing rank, within the configured timeout; the process can build a
    new Buffer and run a clean step afterwards."""
    import time
    from moonep_ops import native
    from moonep_ops.testing.virtual_ranks import VirtualGroup
    timeout = 0.5
    vg = VirtualGroup(2)
    bufs = [Buffer(8, 16, 2, 4, dtype=torch.float32, device=vg.device,
                   backend=vg.backend(r, timeout_s=timeout)) for r in range(2)]
    xs = [torch.randn(8, 16, device=vg.device) for _ in range(2)]
    ts = [torch.randint(0, 4, (8, 2), dtype=torch.int32, device=vg.device) for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for r in range(2):                                  # both ranks dispatch
        with torch.cuda.stream(streams[r]):
            outs.append(bufs[r].dispatch(xs[r], ts[r]))
    t0 = time.perf_counter()
    with torch.cuda.stream(streams[0]):                 # only rank 0 combines
        h, _, _, plan = outs[0]
        bufs[0].combine(plan, h)
        with pytest.raises(native.DataPlaneTimeout) as info:
            bufs[0].check_errors()
    elapsed = time.perf_counter() - t0
    e = info.value
    assert e.missing_rank == 1 and e.op.startswith("combine"), str(e)
    assert "rank 1" in str(e) and "combine" in str(e)
    assert elapsed < timeout + 5.0, f"the timeout took {elapsed:.1f} s"
    bufs[1].check_errors()                              # rank 1 itself saw no error
    torch.cuda.synchronize()
    # a new group works
    vg2 = VirtualGroup(1)
    b = Buffer(8, 16, 2, 4, dtype=torch.float32, device=vg2.device, backend=vg2.backend(0))
    x = torch.randn(8, 16, device=vg2.device)
    h, _, _, plan = b.dispatch(x, torch.randint(0, 4, (8, 2), dtype=torch.int32, device=vg2.device))
    y, _ = b.combine(plan, h)
    b.check_errors()
    torch.testing.assert_close(y, 2 * x)


def test_bad_ids_flag_on_device(monkeypatch):
    from moonep_ops.testing.virtual_ranks import VirtualGroup
    vg = VirtualGroup(1)
    buf = Buffer(4, 8, 2, 4, dtype=torch.float32, device=vg.device, backend=vg.backend(0))
    x = torch.randn(4, 8, device=vg.device)
    t = torch.tensor([[0, 1], [2, 9], [1, 1], [3, 0]], dtype=torch.int32, device=vg.device)
    monkeypatch.setenv("MOONEP_VALIDATE", "1")       # host check: clear error, nothing runs
    with pytest.raises(ValueError, match="expert ids"):
        buf.dispatch(x, t)
    buf.check_errors()
    monkeypatch.setenv("MOONEP_VALIDATE", "auto")    # CUDA default: checked on the device
    h, w, cu, plan = buf.dispatch(x, t, torch.rand(4, 2, device=vg.device))
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="expert ids outside"):
        buf.check_errors()
    assert not h.any() and not w.any()


def test_device_planner_refuses_other_policies_before_any_kernel():
    """planner='device' plans the device planner's policies only ('moonep', 'cost'): another
    policy is a ValueError raised before the histogram kernel runs (the error word and the
    peers' histogram rows stay untouched)."""
    from moonep_ops.testing.virtual_ranks import VirtualGroup
    vg = VirtualGroup(1)
    be = vg.backend(0, planner="device")
    buf = Buffer(4, 8, 2, 4, dtype=torch.float32, device=vg.device, backend=be, policy="lean")
    x = torch.randn(4, 8, device=vg.device)
    t = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 0]], dtype=torch.int32, device=vg.device)
    be.hist.fill_(-7)
    with pytest.raises(ValueError, match=r"planner='device' plans the policies \('moonep', 'cost'\)"):
        buf.dispatch(x, t)
    torch.cuda.synchronize()
    assert (be.hist == -7).all() and not be.err.any()
    # the same buffer with the torch planner plans policy 'lean' on the device tensors
    be.planner = "torch"
    h, w, cu, plan = buf.dispatch(x, t, torch.rand(4, 2, device=vg.device))
    buf.check_errors()


def test_torch_symmetric_memory_r1_matches_cpu(nccl_world):
    """R = 1 through torch.distributed._symmetric_memory (the multi-GPU heap), chosen by
    backend="auto" on a CUDA device, bitwise equal to the CPU single-rank path."""
    from moonep_ops.backends import SymmBackend, TorchSymmetricHeap
    S, H, K, E, tp = 64, 256, 4, 8, 8
    gpu = Buffer(S, H, K, E, group=nccl_world, token_padding=tp, dtype=torch.bfloat16, device="cuda")
    assert isinstance(gpu.backend, SymmBackend) and isinstance(gpu.backend.heap, TorchSymmetricHeap)
    assert gpu.capturable
    cpu = Buffer(S, H, K, E, token_padding=tp, dtype=torch.bfloat16, device="cpu")
    for s in (1, 37, S):
        x, w = token_inputs(0, s, H, K, torch.bfloat16, s)
        t = routing("dup", 0, 1, s, K, E, s)
        hg, wg, cug, pg = gpu.dispatch(x.cuda(), t.cuda(), w.cuda())
        hc, wc, cuc, pc = cpu.dispatch(x, t, w)
        assert torch.equal(hg.cpu(), hc) and torch.equal(wg.cpu(), wc)
        assert torch.equal(cug.cpu(), cuc) and torch.equal(pg.dst.cpu(), pc.dst)
        z = (hg.float() * 1.5).to(torch.bfloat16)
        yg, wkg = gpu.combine(pg, z, wg)
        yc, wkc = cpu.combine(pc, z.cpu(), wc)
        assert torch.equal(yg.cpu(), yc) and torch.equal(wkg.cpu(), wkc)
    gpu.check_errors()
