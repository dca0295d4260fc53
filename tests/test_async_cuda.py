"""The async (comm-stream) mode of the CUDA data plane (moonep_ops/comm_stream.py).

Every async result is checked bitwise against the CPU references that the synchronous path is
checked against in tests/test_symm_cuda.py (and, for dispatch/combine, against the synchronous
path itself).  Virtual ranks (R > 1 on one GPU) are all queued from ONE thread, each on its own
stream, with its own comm stream.  Also: the kernels run on the comm stream and overlap a matmul
on the current stream (profiler timestamps), inputs and outputs survive the caching allocator
across streams, no host sync, and CUDA-graph capture with the comm stream forked and joined.
Skipped without a GPU or without libmoonep_ep.so.  Argument errors: tests/test_async_args.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from moonep_ops import native
from moonep_ops.buffer import Buffer
from moonep_ops.comm_stream import EventHandle
from moonep_ops.planner import Plan, plan_all_ranks

from test_data_plane import fixed_order_sum, routing, token_inputs, _random_table
from test_symm_cuda import CONFIGS, _setup, _step_inputs, rank_ops, verify_rank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or native.ep() is None,
                                reason="needs a CUDA device and libmoonep_ep.so")

BF16 = torch.bfloat16


def _virtual_buffers(R, S, H, K, E, tp=1, dtype=BF16, comm_stream=None):
    """comm_stream: None (lazy), True, or "explicit" (a torch.cuda.Stream per virtual rank: the
    ranks must not share one, a rank's barrier would block its peers' ops queued behind it)."""
    from moonep_ops.testing.virtual_ranks import VirtualGroup
    vg = VirtualGroup(R)
    return [Buffer(S, H, K, E, token_padding=tp, dtype=dtype, device=vg.device,
                   backend=vg.backend(r),
                   comm_stream=(torch.cuda.Stream(device=vg.device) if comm_stream == "explicit"
                                else comm_stream)) for r in range(R)]


# ---------------------------------------------------------------------------------------------
# dispatch / combine, async, bitwise
# ---------------------------------------------------------------------------------------------


def rank_ops_async(c, buf, r):
    """rank_ops of test_symm_cuda with every data-plane call async (plus one synchronous call
    mixed in), queued without host reads.  Same output dict, so verify_rank applies."""
    dt, dev = c["dtype"], buf.device
    x, w_in, t = c["xs"][r].to(dev), c["ws"][r].to(dev), c["ts"][r].to(dev)
    o, pending = {}, []
    o["h"], o["w"], o["cu"], plan, ev = buf.dispatch(x, t, w_in, total_num_tokens=c["total"],
                                                     async_op=True)
    assert isinstance(ev, EventHandle)
    o["plan"] = plan
    # straight from dispatch's outputs: the same comm stream, nothing to wait for
    o["y"], o["wk"], ev2 = buf.combine(plan, o["h"], o["w"], async_op=True)
    pending.append(ev2)
    ev.wait()                                    # the current stream reads h below
    scale = (torch.arange(o["h"].shape[0], device=dev) % 5 + 1).float()
    hs = (o["h"].float() * scale[:, None]).to(dt)
    hfull = torch.cat([hs, hs.new_zeros(buf.NvS - hs.shape[0], c["H"])])
    o["ys"], o["none"], ev3 = buf.combine(plan, hfull, async_op=True)   # waits the current stream
    wfull = torch.cat([o["w"], o["w"].new_zeros(buf.NvS - o["w"].shape[0])])
    o["yw"], _, ev3w = buf.combine(plan, hfull, wfull, weighted=True, async_op=True)
    pending += [ev3, ev3w]
    del hs, hfull, wfull                         # freed while the comm stream may still read them
    x2 = (x.float() * 3 - 1).to(dt)
    o["h2"], o["w2"], _, _, ev4 = buf.dispatch(x2, route_weights_sK=w_in, plan=plan,
                                               async_op=True, previous_event=buf.capture())
    pending.append(ev4)
    # autograd: async dispatch (its backward, a combine, runs on the comm stream), then a
    # synchronous combine on the current stream, then backward
    xg = x.clone().requires_grad_()
    wg = w_in.clone().requires_grad_()
    hh, ww, _, pl, ev5 = buf.dispatch(xg, t, wg, total_num_tokens=c["total"], async_op=True)
    ev5.wait()
    yy, wkk = buf.combine(pl, (hh.float() * 1.5).to(dt), ww)
    torch.autograd.backward([yy, wkk], [torch.ones_like(yy), torch.full_like(wkk, 2.0)])
    o["gx"], o["gw"] = xg.grad, wg.grad
    for e in pending:
        e.wait()
    return o


def _compare_sync_async(R, c):
    sync_bufs = _virtual_buffers(R, c["S"], c["H"], c["K"], c["E"], c["tp"], c["dtype"])
    async_bufs = _virtual_buffers(R, c["S"], c["H"], c["K"], c["E"], c["tp"], c["dtype"])
    streams = [torch.cuda.Stream() for _ in range(R)]
    outs_sync, outs_async = [], []
    for r in range(R):
        with torch.cuda.stream(streams[r]):
            outs_sync.append(rank_ops(c, sync_bufs[r], r))
    for r in range(R):
        with torch.cuda.stream(streams[r]):
            outs_async.append(rank_ops_async(c, async_bufs[r], r))
    torch.cuda.synchronize()
    for r in range(R):
        assert async_bufs[r].comm_stream is not None
        assert async_bufs[r].comm_stream != streams[r]
        verify_rank(c, async_bufs[r], r, outs_async[r])
        a, s = outs_async[r], outs_sync[r]
        for key in ("h", "w", "cu", "y", "wk", "ys", "yw", "h2", "w2", "gx", "gw"):
            assert torch.equal(a[key], s[key]), f"rank {r}: async {key} differs from sync"
        for name in ("dst", "experts_to_copy", "zero_fill_ranges", "remote_stats"):
            assert torch.equal(getattr(a["plan"], name), getattr(s["plan"], name)), name


@pytest.mark.parametrize("R", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["dup", "per_rank_s", "uniform_fp32_tp4", "skewed_large"])
def test_async_dispatch_combine_virtual(R, name):
    cfg = dict(CONFIGS[name])
    if cfg.get("E", 8) % R:         # e.g. k1's 4 experts at R = 8: same routing kind, epn 4
        cfg["E"] = 4 * R
    _compare_sync_async(R, _setup(R, **cfg))


def test_async_torch_symmetric_memory_r1(nccl_world):
    """R = 1 on torch symmetric memory (the multi-GPU heap): async == CPU single-rank path."""
    from moonep_ops.backends import SymmBackend, TorchSymmetricHeap
    S, H, K, E, tp = 64, 256, 4, 8, 8
    gpu = Buffer(S, H, K, E, group=nccl_world, token_padding=tp, dtype=BF16, device="cuda",
                 comm_stream=True)
    assert isinstance(gpu.backend, SymmBackend) and isinstance(gpu.backend.heap, TorchSymmetricHeap)
    assert gpu.comm_stream is not None
    cpu = Buffer(S, H, K, E, token_padding=tp, dtype=BF16, device="cpu")
    for s in (1, 37, S):
        x, w = token_inputs(0, s, H, K, BF16, s)
        t = routing("dup", 0, 1, s, K, E, s)
        hg, wg, cug, pg, ev = gpu.dispatch(x.cuda(), t.cuda(), w.cuda(), async_op=True)
        hc, wc, cuc, pc = cpu.dispatch(x, t, w)
        ev.wait()
        z = (hg.float() * 1.5).to(BF16)
        yg, wkg, ev2 = gpu.combine(pg, z, wg, async_op=True)
        with ev2:                                 # EventOverlap-style: waits on exit
            pass
        torch.cuda.synchronize()
        assert torch.equal(hg.cpu(), hc) and torch.equal(wg.cpu(), wc)
        assert torch.equal(cug.cpu(), cuc) and torch.equal(pg.dst.cpu(), pc.dst)
        yc, wkc = cpu.combine(pc, z.cpu(), wc)
        assert torch.equal(yg.cpu(), yc) and torch.equal(wkg.cpu(), wkc)
        assert ev.query() and ev2.query()
    gpu.check_errors()
    _prefetch_reduce_async([gpu], seed=11)


# ---------------------------------------------------------------------------------------------
# prefetch_weight / reduce_grad, async, bitwise
# ---------------------------------------------------------------------------------------------


def _owner(o, epn, shape, dtype, tag):
    g = torch.Generator().manual_seed(1000 * tag + o)
    return torch.randn(epn, *shape, generator=g).to(dtype)


def _fake_plan(buf, etc):
    """A Plan carrying a given experts_to_copy table (prefetch/reduce read nothing else)."""
    s, K = buf.S, buf.K
    z = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=buf.device)  # noqa: E731
    return Plan(z(s * K), z(buf.G), etc.to(buf.device), z(buf.G, 2), z(2), rank=buf.rank,
                R=buf.R, E=buf.E, S=buf.S, K=K, s=s, token_padding=buf.token_padding,
                total_num_tokens=-1, NvS=buf.NvS, nvs_s=buf.nvs_s(s))


def _prefetch_reduce_async(bufs, seed):
    """Every rank's async prefetch then async reduce, all queued from this thread; checked
    against the CPU reference of tests/test_symm_cuda.py::prefetch_reduce_case."""
    R, epn = len(bufs), bufs[0].epn
    etc = _random_table(R, epn, seed=seed)
    streams = [torch.cuda.Stream() for _ in range(R)]
    st = []
    for r, buf in enumerate(bufs):
        with torch.cuda.stream(streams[r]):
            dev = buf.device
            plan = _fake_plan(buf, etc)
            local = [_owner(r, epn, (3, 5), BF16, 1).to(dev),
                     _owner(r, epn, (7,), torch.float32, 2).to(dev)]
            slots = [buf.symmetric_zeros((epn, 3, 5), BF16),
                     buf.symmetric_zeros((epn, 7), torch.float32)]
            lg = [_owner(r, epn, (6,), torch.float32, 3).to(dev)]
            sg = [buf.symmetric_zeros((epn, 6), torch.float32)]
            sg_src = _owner(r, epn, (6,), torch.float32, 4).to(dev)
            st.append((plan, local, slots, lg, sg, sg_src))
    torch.cuda.synchronize()      # symmetric allocations are collective; no host copy below
    handles = []
    for r, buf in enumerate(bufs):
        plan, local, slots, lg, sg, sg_src = st[r]
        with torch.cuda.stream(streams[r]):
            slots[0].fill_(-3)
            ev_p = buf.prefetch_weight(plan, local_weights=local, slot_weights=slots,
                                       async_op=True)
            sg[0].copy_(sg_src)           # the slot grads, while prefetch is in flight
            ev_r = buf.reduce_grad(plan, local_grads=lg, slot_grads=sg, async_op=True,
                                   previous_event=buf.capture())
            handles.append((ev_p, ev_r))
    for r in range(R):
        with torch.cuda.stream(streams[r]):
            for e in handles[r]:
                assert isinstance(e, EventHandle)
                e.wait()
    torch.cuda.synchronize()
    for r, buf in enumerate(bufs):
        plan, local, slots, lg, sg, _ = st[r]
        for b in range(epn):
            e = int(etc[r, b])
            for i, (shape, dt) in enumerate((((3, 5), BF16), ((7,), torch.float32))):
                exp = (torch.full(shape, -3.0 if i == 0 else 0.0, dtype=dt) if e < 0
                       else _owner(e // epn, epn, shape, dt, i + 1)[e % epn])
                assert torch.equal(slots[i][b].cpu(), exp), f"rank {r} slot {b} tensor {i}"
        exp = _owner(r, epn, (6,), torch.float32, 3).clone()
        for src in range(R):
            for b in range(epn):
                e = int(etc[src, b])
                if e >= 0 and e // epn == r:
                    exp[e % epn] += _owner(src, epn, (6,), torch.float32, 4)[b]
        assert torch.equal(lg[0].cpu(), exp), f"rank {r}: reduced grads"
        mine = _owner(r, epn, (6,), torch.float32, 4)
        for b in range(epn):
            exp_slot = torch.zeros(6) if int(etc[r, b]) >= 0 else mine[b]
            assert torch.equal(sg[0][b].cpu(), exp_slot), f"rank {r}: slot {b} after reduce"
        buf.check_errors()


@pytest.mark.parametrize("R", [1, 2, 4, 8])
def test_async_prefetch_reduce_virtual(R):
    bufs = _virtual_buffers(R, 8, 16, 2, 4 * R, comm_stream="explicit")
    assert len({id(b.comm_stream) for b in bufs}) == R
    _prefetch_reduce_async(bufs, seed=R)


# ---------------------------------------------------------------------------------------------
# caching-allocator safety across the streams
# ---------------------------------------------------------------------------------------------


def test_allocator_safety_inputs_and_outputs():
    """Inputs dropped right after the call, and outputs dropped while the current stream still
    reads them, are not handed to another tensor before the other stream is done (record_stream).
    The comm stream / the current stream are held back with a device sleep to make the race real."""
    S, H, K, E = 256, 512, 4, 8
    buf, = _virtual_buffers(1, S, H, K, E, tp=4, comm_stream=True)
    dev, cur = buf.device, torch.cuda.current_stream()
    comm = buf.comm_stream
    x0, w0 = token_inputs(0, S, H, K, BF16, 7)
    t0 = routing("zipf", 0, 1, S, K, E, 7)
    x3 = (x0.float() * 3 - 1).to(BF16)
    rh, rw, rcu, rplan = buf.dispatch(x0.to(dev), t0.to(dev), w0.to(dev))      # synchronous
    rh3, _, _, _ = buf.dispatch(x3.to(dev), t0.to(dev), w0.to(dev))
    torch.cuda.synchronize()
    gate_stream = torch.cuda.Stream()
    # 1) inputs: freed at once; the comm stream reads them only after a 10 ms gate
    x, t, w = x0.to(dev), t0.to(dev), w0.to(dev)
    gate_stream.wait_stream(cur)
    with torch.cuda.stream(gate_stream):
        torch.cuda._sleep(20_000_000)
    gate = torch.cuda.Event()
    gate.record(gate_stream)
    h, wn, cu, plan, ev = buf.dispatch(x, t, w, async_op=True, previous_event=gate)
    del x, t, w
    junk = [torch.full((S, H), 7, dtype=BF16, device=dev),
            torch.full((S, K), 7, dtype=torch.int32, device=dev),
            torch.full((S, K), 7.0, device=dev)]
    ev.wait()
    torch.cuda.synchronize()
    assert torch.equal(h, rh) and torch.equal(wn, rw) and torch.equal(cu, rcu)
    # 2) outputs: the current stream reads h late (behind a sleep); h is dropped and the comm
    #    stream allocates a same-sized h for new data without waiting for the current stream
    x3d, td, wd = x3.to(dev), t0.to(dev), w0.to(dev)
    torch.cuda.synchronize()
    ready = torch.cuda.Event()
    ready.record(gate_stream)                     # already complete: no wait on the current stream
    torch.cuda._sleep(20_000_000)
    copy = h.clone()                              # queued behind the sleep
    del h, ev                                     # the handle keeps its outputs alive too
    h3, _, _, _, ev3 = buf.dispatch(x3d, td, wd, async_op=True, previous_event=ready)
    ev3.wait()
    torch.cuda.synchronize()
    assert torch.equal(copy, rh), "an output block was reused while the current stream read it"
    assert torch.equal(h3, rh3)
    assert comm is buf.comm_stream
    del junk
    buf.check_errors()


# ---------------------------------------------------------------------------------------------
# the kernels run on the comm stream and overlap compute (profiler)
# ---------------------------------------------------------------------------------------------

MOONEP_KERNELS = ("barrier_kernel", "hist_publish_kernel", "dispatch_send_kernel",
                  "dispatch_recv_kernel", "dispatch_dups_kernel", "combine_recv_kernel",
                  "push_weights_kernel", "reduce_grads_kernel", "zero_slots_kernel",
                  "publish_ptrs_kernel", "plan_group_kernel", "plan_assign_kernel")


def _kernels(prof, path):
    prof.export_chrome_trace(str(path))
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            args = e.get("args", {})
            out.append(dict(name=e["name"], stream=args.get("stream"), ts=float(e["ts"]),
                            end=float(e["ts"]) + float(e.get("dur", 0))))
    return out


def test_kernels_on_comm_stream_and_overlap(tmp_path):
    """Profiler: every moonep kernel of an async dispatch + combine runs on one stream that is
    not the current stream, starts after the work queued before the call (a device sleep), and
    runs while a long matmul queued after the call runs on the current stream; the consumer
    queued after handle.wait() starts after the last moonep kernel.  Timestamps, not timings."""
    from torch.profiler import ProfilerActivity, profile
    S, H, K, E = 1024, 2048, 8, 64
    buf, = _virtual_buffers(1, S, H, K, E, tp=8, comm_stream=True)
    dev = buf.device
    x0, w0 = token_inputs(0, S, H, K, BF16, 3)
    x, w, t = x0.to(dev), w0.to(dev), routing("zipf", 0, 1, S, K, E, 3).to(dev)
    a = torch.randn(8192, 8192, device=dev, dtype=BF16)
    b = torch.randn(8192, 8192, device=dev, dtype=BF16)

    def step():
        # The current stream is busy ~200 ms: long enough for the host to enqueue the async ops
        # and the matmuls before it ends, even under the profiler after compile-heavy tests (a
        # 25 ms sleep ended before the matmuls were enqueued in one run of the whole suite).
        torch.cuda._sleep(400_000_000)
        h, wn, cu, plan, ev = buf.dispatch(x, t, w, async_op=True)
        y, _, ev2 = buf.combine(plan, h, async_op=True)
        c = None
        for _ in range(3):
            c = a @ b                             # on the current stream, after the sleep
        ev2.wait()
        return y.float().sum(), c

    step()                                        # warm-up: cuBLAS, allocator
    torch.cuda.synchronize()
    # No GC pass runs in here (conftest._no_gc_inside_cuda_tests): one that freed earlier tests'
    # CUDA graphs would synchronise the device mid-step and enqueue the matmuls only after the
    # sleep, the suspected cause of this test's failures after test_symm_cuda.py.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ks = _kernels(prof, tmp_path / "trace.json")
    if not ks:
        pytest.skip("the profiler recorded no CUDA kernels (CUPTI unavailable)")
    moon = [k for k in ks if any(n in k["name"] for n in MOONEP_KERNELS)]
    assert moon, f"no moonep kernels in the trace: {sorted({k['name'][:60] for k in ks})}"
    others = [k for k in ks if k not in moon]
    longest = max(others, key=lambda k: k["end"] - k["ts"])          # the sleep or a matmul
    cur_stream = longest["stream"]
    comm_streams = {k["stream"] for k in moon}
    assert len(comm_streams) == 1 and cur_stream not in comm_streams, (comm_streams, cur_stream)
    on_cur = sorted((k for k in others if k["stream"] == cur_stream), key=lambda k: k["ts"])
    spin = [k for k in on_cur if "spin" in k["name"]]
    if spin:                                      # the comm stream waited for the current stream
        assert min(k["ts"] for k in moon) >= spin[0]["end"] - 1.0
    gemms = [k for k in on_cur if "spin" not in k["name"] and k["end"] - k["ts"] > 200.0]
    assert gemms, [k["name"][:60] for k in on_cur]
    overlap = any(m["ts"] < g["end"] and g["ts"] < m["end"] for m in moon for g in gemms)
    t0 = min(k["ts"] for k in moon)
    span = lambda k: f"{k['name'][:24]} {k['ts'] - t0:.0f}..{k['end'] - t0:.0f}"  # noqa: E731
    assert overlap, ("no moonep kernel overlaps the matmuls (us, from the first moonep kernel)",
                     f"moonep: {len(moon)} kernels, {span(moon[0])} .. last end "
                     f"{max(k['end'] for k in moon) - t0:.0f}",
                     "current stream: " + "; ".join(span(k) for k in on_cur[:8]))
    last = on_cur[-1]                             # the consumer, queued after ev2.wait()
    assert last["ts"] >= max(k["end"] for k in moon) - 1.0
    buf.check_errors()


# ---------------------------------------------------------------------------------------------
# no host sync; CUDA graphs
# ---------------------------------------------------------------------------------------------


def _graph_case(R):
    S, H, K, E, tp = 32, 64, 4, 8 * R, 4
    bufs = _virtual_buffers(R, S, H, K, E, tp=tp, comm_stream=True)
    dev = bufs[0].device
    c = dict(R=R, S=S, H=H, K=K, E=E, tp=tp, bufs=bufs,
             streams=[torch.cuda.Stream() for _ in range(R)],
             xs=[torch.zeros(S, H, dtype=BF16, device=dev, requires_grad=True) for _ in range(R)],
             ws=[torch.zeros(S, K, device=dev) for _ in range(R)],
             ts=[torch.zeros(S, K, dtype=torch.int32, device=dev) for _ in range(R)],
             gy=[torch.zeros(S, H, dtype=BF16, device=dev) for _ in range(R)])
    return c


def _graph_step(c, r):
    buf = c["bufs"][r]
    h, w, cu, plan, ev = buf.dispatch(c["xs"][r], c["ts"][r], c["ws"][r], async_op=True)
    ev.wait()
    z = (h.float() * w[:, None]).to(BF16)
    y, _, ev2 = buf.combine(plan, z, async_op=True)
    ev2.wait()
    gx, = torch.autograd.grad(y, c["xs"][r], c["gy"][r])
    return y, gx, cu


def _graph_load(c, seed, skew):
    R, S, H, K, E = c["R"], c["S"], c["H"], c["K"], c["E"]
    xs, ws, ts = _step_inputs(R, S, H, K, E, seed, skew)
    with torch.no_grad():
        for r in range(R):
            c["xs"][r].copy_(xs[r]), c["ws"][r].copy_(ws[r]), c["ts"][r].copy_(ts[r])
            c["gy"][r].copy_(torch.ones(S, H) * (r + 1))
    torch.cuda.synchronize()
    grp = plan_all_ranks(ts, E, c["tp"], capacity=S)
    out = []
    for r in range(R):
        parts = [(xs[r].float() * ws[r][:, k:k + 1]).to(BF16) for k in range(K)]
        gparts = [(c["gy"][r].cpu().float() * ws[r][:, k:k + 1]).to(BF16) for k in range(K)]
        out.append((fixed_order_sum(parts, BF16), fixed_order_sum(gparts, BF16),
                    grp.plans[r].cu_seqlens))
    return out


@pytest.mark.parametrize("R", [1, 2])
def test_async_no_host_sync(R):
    """Forward + backward of every virtual rank, async, queued from ONE thread under
    sync_debug_mode("error")."""
    c = _graph_case(R)
    expected = _graph_load(c, 0, skew=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = []
        for r in range(R):
            with torch.cuda.stream(c["streams"][r]):
                outs.append(_graph_step(c, r))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for r, ((y, gx, cu), (ey, egx, ecu)) in enumerate(zip(outs, expected)):
        assert torch.equal(y.cpu(), ey) and torch.equal(gx.cpu(), egx)
        assert torch.equal(cu.cpu(), ecu)
    for b in c["bufs"]:
        b.check_errors()


@pytest.mark.parametrize("R", [1, 2])
def test_async_cuda_graph_capture(R):
    """Captured with the comm stream forked from the capturing stream (event) and joined back by
    handle.wait(); replayed with new routing copied into the static inputs."""
    c = _graph_case(R)
    _graph_load(c, 0, skew=True)
    for r in range(R):                            # warm-up on the side streams
        with torch.cuda.stream(c["streams"][r]):
            _graph_step(c, r)
    torch.cuda.synchronize()
    graphs = [torch.cuda.CUDAGraph() for _ in range(R)]
    static = [None] * R
    for r in range(R):
        with torch.cuda.graph(graphs[r], stream=c["streams"][r]):
            static[r] = _graph_step(c, r)
    torch.cuda.synchronize()
    for seed, skew in ((1, False), (2, True)):
        expected = _graph_load(c, seed, skew)
        for r in range(R):
            with torch.cuda.stream(c["streams"][r]):
                graphs[r].replay()
        torch.cuda.synchronize()
        for r, ((y, gx, cu), (ey, egx, ecu)) in enumerate(zip(static, expected)):
            assert torch.equal(cu.cpu(), ecu), f"replay {seed} rank {r}: cu_seqlens"
            assert torch.equal(y.cpu(), ey), f"replay {seed} rank {r}: y"
            assert torch.equal(gx.cpu(), egx), f"replay {seed} rank {r}: grad x"
    # eager async ops still work after the capture
    expected = _graph_load(c, 3, skew=True)
    outs = []
    for r in range(R):
        with torch.cuda.stream(c["streams"][r]):
            outs.append(_graph_step(c, r))
    torch.cuda.synchronize()
    for r, ((y, gx, cu), (ey, egx, ecu)) in enumerate(zip(outs, expected)):
        assert torch.equal(y.cpu(), ey) and torch.equal(gx.cpu(), egx)
    for b in c["bufs"]:
        b.check_errors()
