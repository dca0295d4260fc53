"""What the host-cost work of the hot path keeps (CPU): the shortcuts change no behaviour.

* settings.get reads the environment as os.environ.get does, changes at run time included;
* moonep::moe_experts and its backward make no nested op calls (their GEMMs, SwiGLU, prefetch
  and reduce run as plain calls after one set of checks; a profiler still shows them by the
  ops' names), and their results equal the op-by-op composition;
* the grouped GEMM's per-shape launch constants follow the environment switches and
  clear_plan_cache;
* the device planner's cached size validation still raises on every bad call.
"""
from __future__ import annotations

import os

import pytest
import torch

from moonep_ops import Buffer, planner, runtime, settings
from moonep_ops.ops import checks
from moonep_ops.ops import grouped_mm as gm
from moonep_ops.ops import grouped_mm_kernels as gk
from moonep_ops.ops.swiglu import swiglu, swiglu_backward


def test_settings_read_the_environment_as_os_environ_does(monkeypatch):
    name = "MOONEP_GEMM_FAMILY"                             # a declared switch, default "auto"
    monkeypatch.delenv(name, raising=False)
    assert settings.get(name) == os.environ.get(name, "auto") == "auto"
    monkeypatch.setenv(name, "torch")
    assert settings.get(name) == "torch"
    os.environ[name] = ""                                   # set but empty: not the default
    assert settings.get(name) == os.environ.get(name, "auto") == ""
    del os.environ[name]
    assert settings.get(name) == "auto"
    with pytest.raises(KeyError):                           # every switch is declared
        settings.get("MOONEP_NOT_A_SWITCH")
    monkeypatch.setenv("MOONEP_GEMM_PDL", "0")
    assert not settings.flag("MOONEP_GEMM_PDL")
    monkeypatch.setenv("MOONEP_VALIDATE", "0")
    assert runtime.validate_mode() == "0" and not runtime.should_validate(torch.empty(1))


def test_on_device_of_cpu_is_a_no_op():
    with runtime.on_device_of(torch.device("cpu")) as ctx:
        assert ctx.prev == -1
    assert runtime.call_on(torch.device("cpu"), max, 1, 2) == 2


def _expert_case(D=16, F=24, E=4, K=2, s=12, tp=4, dtype=torch.float32):
    torch.manual_seed(0)
    buf = Buffer(s, D, K, E, token_padding=tp, dtype=dtype)
    pool = buf.expert_pool(D, F, dtype)
    x = torch.randn(s, D, dtype=dtype)
    ids = torch.randint(0, E, (s, K), dtype=torch.int32)
    h, _, cu, plan = buf.dispatch(x, ids)
    w1, w3 = torch.randn(E, F, D, dtype=dtype), torch.randn(E, F, D, dtype=dtype)
    w2 = torch.randn(E, D, F, dtype=dtype)
    return buf, pool, h, cu, plan.experts_to_copy, w1, w3, w2


_NESTED = ("grouped_mm", "grouped_mm_dgrad", "grouped_mm_wgrad_into", "swiglu",
           "swiglu_backward", "prefetch_weight", "reduce_grad")


def _count_op_calls(monkeypatch, names=_NESTED) -> dict:
    """Calls of the ops ``names`` through the dispatcher (by default those moe_experts used to
    make), counted."""
    calls = {n: 0 for n in names}
    for n in names:
        packet = getattr(torch.ops.moonep, n)

        def counted(*a, _n=n, _p=packet, **k):
            calls[_n] += 1
            return _p(*a, **k)
        monkeypatch.setattr(torch.ops.moonep, n, counted)
    return calls


def test_moe_experts_makes_no_nested_op_calls(monkeypatch):
    buf, pool, h, cu, etc, w1, w3, w2 = _expert_case()
    ops = torch.ops.moonep
    calls = _count_op_calls(monkeypatch)
    y, g, u = ops.moe_experts(h, cu, etc, w1, w3, w2, pool.name)
    dy = torch.randn_like(y)
    dh, d1, d3, d2 = ops.moe_experts_backward(dy, h, g, u, cu, etc, w1, w3, w2, pool.name)
    assert not any(calls.values()), calls
    monkeypatch.undo()
    # while a profiler runs, the phases still show under the ops' names
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.moe_experts_backward(dy, h, g, u, cu, etc, w1, w3, w2, pool.name)
    names = {e.name for e in prof.events()}
    assert {"moonep::grouped_mm_dgrad", "moonep::reduce_grad", "moonep::prefetch_weight",
            "moonep::grouped_mm_wgrad_into", "moonep::swiglu_backward"} <= names, names
    # the same values as the ops composed one by one (R = 1: the slots stay unused)
    zs = torch.zeros_like(w1)
    g_ref = gm.grouped_mm(h, w1, zs, cu, zero_tail=False)
    u_ref = gm.grouped_mm(h, w3, zs, cu, zero_tail=False)
    rows = int(cu[-1])
    assert torch.equal(g[:rows], g_ref[:rows]) and torch.equal(u[:rows], u_ref[:rows])
    y_ref = gm.grouped_mm(swiglu(g, u), w2, torch.zeros_like(w2), cu, zero_tail=False)
    assert torch.equal(y[:rows], y_ref[:rows])
    da = gm.grouped_mm_dgrad(dy, w2, torch.zeros_like(w2), cu, zero_tail=False)
    dg, du, a = swiglu_backward(g, u, da)
    dh_ref = gm.grouped_mm_dgrad(dg, w1, zs, cu) + gm.grouped_mm_dgrad(du, w3, zs, cu)
    assert torch.equal(dh, dh_ref)
    d2_ref, _ = gm.grouped_mm_wgrad(dy, a, cu, w2.shape[0], out_dtype=w2.dtype)
    assert torch.equal(d2, d2_ref)
    buf.destroy()


def test_moe_experts_checks_etc_values_before_staging():
    buf, pool, h, cu, etc, w1, w3, w2 = _expert_case()
    bad = etc.clone()
    bad[0, 0] = 99                                          # expert id >= E
    before = [t.clone() for t in pool.slot_weights()]
    with pytest.raises(ValueError, match="experts_to_copy values"):
        torch.ops.moonep.moe_experts(h, cu, bad, w1, w3, w2, pool.name)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.slot_weights()))
    buf.destroy()


def test_gemm_call_constants_follow_env_and_clear(monkeypatch):
    monkeypatch.setattr(gk, "_workspace_bytes", lambda kid, G, sm: 4096 + G)   # no library here
    for v in ("MOONEP_GEMM_FAMILY", "MOONEP_GEMM_CANDIDATES", "MOONEP_GEMM_PDL"):
        monkeypatch.delenv(v, raising=False)
    gm.clear_plan_cache()
    kid, table, mask, nbytes, pdl = gm._call_constants("fwd", 8192, 32, 768, 2048, 132)
    assert (kid, nbytes, pdl) == (0, 4096 + 32, gm._PDL)
    assert mask == gm.candidate_mask("fwd", 8192, 32, 768, 2048, 132)
    assert list(table) == pytest.approx(gm.gemm_cost_model.tuning_table(
        "fwd", gm.gemm_cost_model.tie_tolerance("fwd", 8192, 32)))
    assert gm._call_constants("fwd", 8192, 32, 768, 2048, 132)[1] is table     # built once
    monkeypatch.setenv("MOONEP_GEMM_PDL", "0")
    assert gm._call_constants("fwd", 8192, 32, 768, 2048, 132)[4] == 0
    monkeypatch.delenv("MOONEP_GEMM_PDL")
    monkeypatch.setenv("MOONEP_GEMM_FAMILY", "moonep")
    m2 = gm._call_constants("fwd", 8192, 32, 768, 2048, 132)[2]
    assert m2 == gm.candidate_mask("fwd", 8192, 32)
    monkeypatch.setenv("MOONEP_GEMM_FAMILY", "bogus")
    with pytest.raises(ValueError, match="MOONEP_GEMM_FAMILY"):
        gm._call_constants("fwd", 8192, 32, 768, 2048, 132)
    monkeypatch.delenv("MOONEP_GEMM_FAMILY")
    assert gm._CALLS
    gm.clear_plan_cache()
    assert not gm._CALLS and not gm._tables


def _device_geometry():
    """The device planner's size validation (planner.py, or planner/device.py once split)."""
    try:
        from moonep_ops.planner import device
        return device._geometry
    except ImportError:
        return planner._geometry


def test_device_planner_size_checks_raise_every_time():
    geometry = _device_geometry()
    args = (2, 8, 16, 2, 4, 64, 0, 16)                      # R E S K tp NvS rank s
    geo = geometry(*args)
    assert geometry(*args) is geo                           # validated once per shape
    for _ in range(2):
        with pytest.raises(ValueError, match="NvS"):
            geometry(2, 8, 16, 2, 4, 1, 0, 16)              # NvS too small
        with pytest.raises(TypeError):
            geometry(2, 8, 16, True, 4, 64, 0, 16)          # a bool K (True == 1 as a key)
    geometry(2, 8, 16, 1, 4, 64, 0, 16)
    with pytest.raises(TypeError):
        geometry(2, 8, 16, True, 4, 64, 0, 16)


# ---------------------------------------------------------------------------------------------
# The ops' eager entry (moonep_ops/ops/fastpath.py)
# ---------------------------------------------------------------------------------------------

class _NoopFunctionMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _NoopDispatchMode(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Sub(torch.Tensor):
    pass


def test_fastpath_only_where_the_op_would_do_the_same():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from moonep_ops.ops import fastpath
    x = torch.randn(4, 4)
    assert fastpath.eager(x, [x, x], "name", 3, None)
    assert fastpath.eager(torch.nn.Parameter(x))
    assert not fastpath.eager(x.to("meta"))
    assert not fastpath.eager(x.as_subclass(_Sub))
    assert not fastpath.eager([x, x.to("meta")])
    with _NoopFunctionMode():
        assert not fastpath.eager(x)
    with _NoopDispatchMode():
        assert not fastpath.eager(x)
    with FakeTensorMode():
        assert not fastpath.eager(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not fastpath.eager(x)
    seen = []
    torch.func.vmap(lambda r: seen.append(fastpath.eager(r)) or r)(x)
    assert seen == [False]
    assert fastpath.eager(x)
    y = x.clone().requires_grad_()
    assert fastpath.needs_grad(x, y) and not fastpath.needs_grad(x, 3)
    assert fastpath.route((x, [y], 3)) == fastpath.BODY      # (a list's tensors: not recorded)
    assert fastpath.route((x, y)) == fastpath.AUTOGRAD
    assert fastpath.route((y, x.to("meta"))) == fastpath.OP
    with torch.no_grad():
        assert not fastpath.needs_grad(y)
        assert fastpath.route((x, y)) == fastpath.BODY


_LAYER_OPS = ("dispatch", "dispatch_with_plan", "combine", "moe_experts", "moe_experts_backward")


def _layer_step(layer, x, gy):
    out = layer(x)
    (out * gy).sum().backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    for p in layer.parameters():
        p.grad = None
    return out.detach(), grads


def test_layer_step_without_the_dispatcher_equals_the_ops(monkeypatch):
    """An eager layer step calls no op through the dispatcher, and gives bitwise what the ops
    give (while a profiler runs, every call goes through them, backward included)."""
    from moonep_ops import MoonEPMoE
    torch.manual_seed(0)
    buf = Buffer(24, 16, 2, 4, token_padding=4, dtype=torch.float32)
    layer = MoonEPMoE.for_buffer(buf, 8, num_shared_experts=1)
    x, gy = torch.randn(24, 16), torch.randn(24, 16)
    calls = _count_op_calls(monkeypatch, _LAYER_OPS)
    fast = _layer_step(layer, x, gy)
    assert not any(calls.values()), calls
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        slow = _layer_step(layer, x, gy)
    assert all(calls[n] for n in _LAYER_OPS), calls
    assert torch.equal(fast[0], slow[0])
    assert all(torch.equal(a, b) for a, b in zip(fast[1], slow[1]))
    buf.destroy()


def test_gemm_api_entry_keeps_errors_and_versions():
    torch.manual_seed(0)
    x = torch.randn(12, 8, dtype=torch.float64)
    wl, ws = torch.randn(2, 6, 8, dtype=torch.float64), torch.randn(2, 6, 8, dtype=torch.float64)
    cu = torch.tensor([3, 6, 9, 12], dtype=torch.int32)
    y = gm.grouped_mm(x, wl, ws, cu)
    with _NoopFunctionMode():
        assert torch.equal(y, gm.grouped_mm(x, wl, ws, cu))
    with pytest.raises(Exception) as fast_err:
        gm.grouped_mm(x, wl, ws, cu, config=1.5)           # not an int: the op reports it
    with pytest.raises(Exception) as op_err:
        torch.ops.moonep.grouped_mm(x, wl, ws, cu, 1.5, True)
    assert type(fast_err.value) is type(op_err.value)
    xg = x.clone().requires_grad_()
    gm.grouped_mm(xg, wl, ws, cu).sum().backward()         # autograd through the entry
    assert torch.equal(xg.grad, gm.grouped_mm_dgrad(torch.ones(12, 6, dtype=torch.float64),
                                                    wl, ws, cu))
    dy = torch.randn(12, 6, dtype=torch.float64)
    gl, gs = torch.zeros_like(wl), torch.zeros_like(ws)
    v = (gl._version, gs._version)
    gm.grouped_mm_wgrad_into(dy, x, cu, gl, gs)
    assert gl._version > v[0] and gs._version > v[1]    # autograd sees them modified, as by the op
    ol, os_ = torch.zeros_like(wl), torch.zeros_like(ws)
    with _NoopFunctionMode():                                   # through the op
        gm.grouped_mm_wgrad_into(dy, x, cu, ol, os_)
    assert torch.equal(gl, ol) and torch.equal(gs, os_)


def test_cached_checks_reject_a_call_one_property_away(monkeypatch):
    """The ops' bodies skip their static checks for a call signature that passed once; a call
    that differs from a cached good one in one property is checked in full and rejected, and
    the value checks (cu_seqlens's values, memory overlap) run on every call."""
    torch.manual_seed(0)
    x, dy = torch.randn(12, 8), torch.randn(12, 6)
    wl, ws = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    cu = torch.tensor([3, 6, 9, 12], dtype=torch.int32)
    body = gm.grouped_mm_body
    gm.clear_plan_cache()
    checked = []
    check_mm = gm._check_mm
    monkeypatch.setattr(gm, "_check_mm", lambda *a, **k: checked.append(a[0]) or check_mm(*a, **k))
    for config in (-1, 1):
        body(x, wl, ws, cu, config, True)
        body(x.clone(), wl, ws, cu, config, True)          # the same signature
        gm.grouped_mm(x, wl, ws, cu, config=config)
    assert checked == ["fwd", "fwd"]                       # once per signature
    with pytest.raises(TypeError, match="dtype"):
        body(x.double(), wl, ws, cu)
    with pytest.raises(ValueError, match="cu_seqlens_G is on meta"):
        body(x, wl, ws, cu.to("meta"))
    with pytest.raises(ValueError, match="columns"):
        body(x[:, :6], wl, ws, cu)
    with pytest.raises(TypeError, match="config must be an int"):
        body(x, wl, ws, cu, True, True)                 # True == 1 and hashes alike
    with pytest.raises(TypeError, match="must be a Tensor"):
        body(x.numpy(), wl, ws, cu)
    with pytest.raises(ValueError, match="non-decreasing"):   # CPU: values checked
        body(x, wl, ws, torch.tensor([3, 2, 9, 12], dtype=torch.int32))
    gl, gs = torch.zeros_like(wl), torch.zeros_like(ws)
    gm.grouped_mm_wgrad_into(dy, x, cu, gl, gs)
    strided = torch.zeros(2, 8, 6).transpose(1, 2)          # gl's shape, dtype and device
    with pytest.raises(ValueError, match="grad_local must be contiguous"):
        gm.grouped_mm_wgrad_into(dy, x, cu, strided, gs)
    with pytest.raises(ValueError, match="overlap"):
        gm.grouped_mm_wgrad_into(dy, x, cu, gl, gl)
    with pytest.raises(TypeError, match="input dtype"):
        gm.grouped_mm_wgrad_into(dy, x, cu, gl.double(), gs)


def test_cached_expert_checks_reject_a_call_one_property_away():
    buf, pool, h, cu, etc, w1, w3, w2 = _expert_case()
    ops = torch.ops.moonep
    ops.moe_experts(h, cu, etc, w1, w3, w2, pool.name)                  # a cached good call
    strided = w1.transpose(1, 2).contiguous().transpose(1, 2)          # w1's shape and dtype
    with pytest.raises(ValueError, match="w1 must be contiguous"):
        ops.moe_experts(h, cu, etc, strided, w3, w2, pool.name)
    with pytest.raises(ValueError, match="experts_to_copy must be int32"):
        ops.moe_experts(h, cu, etc.long(), w1, w3, w2, pool.name)
    with pytest.raises(ValueError, match="h must be"):
        ops.moe_experts(h.double(), cu, etc, w1, w3, w2, pool.name)
    bad = etc.clone()
    bad[0, 0] = 99                                                     # values: every call
    with pytest.raises(ValueError, match="experts_to_copy values"):
        ops.moe_experts(h, cu, bad, w1, w3, w2, pool.name)
    with pytest.raises(ValueError, match="overlap"):
        ops.moe_experts(h, cu, etc, pool.w1, w3, w2, pool.name)
    buf.destroy()


def test_cached_buffer_op_checks_reject_a_call_one_property_away():
    from moonep_ops.ops import dispatch as dops
    torch.manual_seed(0)
    buf = Buffer(12, 16, 2, 4, token_padding=4, dtype=torch.float32)
    x = torch.randn(12, 16)
    ids = torch.randint(0, 4, (12, 2), dtype=torch.int32)
    h, _, cu, plan = buf.dispatch(x, ids)                              # cached good calls
    dops.combine(h, None, plan.dst, buf.name, plan.total_num_tokens)
    dops.dispatch_with_plan(x, None, plan.dst, buf.name, plan.total_num_tokens)
    with pytest.raises(TypeError, match="topk_ids"):
        dops.dispatch(x, ids.long(), None, buf.name, -1)
    with pytest.raises(TypeError, match="route_weights"):       # present where it was absent
        dops.dispatch(x, ids, torch.ones(12, 2, dtype=torch.float64), buf.name, -1)
    strided = h.t().contiguous().t()                                   # h's shape and dtype
    with pytest.raises(ValueError, match="must be contiguous"):
        dops.combine(strided, None, plan.dst, buf.name, plan.total_num_tokens)
    with pytest.raises(ValueError, match="x"):
        dops.dispatch_with_plan(x[:, :8], None, plan.dst, buf.name, plan.total_num_tokens)
    bad = plan.dst.clone()
    bad[0] = 2 ** 30                                                   # values: every call
    with pytest.raises(ValueError, match="plan.dst names"):
        dops.combine(h, None, bad, buf.name, plan.total_num_tokens)
    with pytest.raises(ValueError, match="plan.dst names"):
        dops.dispatch_with_plan(x, None, bad, buf.name, plan.total_num_tokens)
    buf.destroy()


def test_gemm_launch_through_the_c_prototype(monkeypatch):
    """_launch's arguments pass ctypes' conversion of the library's real prototype (a Python
    callback behind a CFUNCTYPE of native.GEMM_PROTOTYPES) with the values the C side reads:
    the per-shape constants, the raw stream and the PDL flag."""
    import ctypes
    from types import SimpleNamespace
    from moonep_ops import native
    restype, argtypes = native.GEMM_PROTOTYPES["moonep_grouped_gemm"]
    seen = []

    def cb(*args):
        seen.append(args)
        return 0

    fn = ctypes.CFUNCTYPE(restype, *argtypes)(cb)
    monkeypatch.setattr(native, "require_gemm", lambda: SimpleNamespace(grouped_gemm=fn))
    monkeypatch.setattr(gk, "sm_count", lambda dev: 132)
    monkeypatch.setattr(gk, "current_raw_stream", lambda dev: 0x1234)
    monkeypatch.setattr(gk, "_workspace_bytes", lambda kid, G, sm: 512)
    for v in ("MOONEP_GEMM_FAMILY", "MOONEP_GEMM_CANDIDATES", "MOONEP_GEMM_PDL"):
        monkeypatch.delenv(v, raising=False)
    gk.clear_plan_cache()
    epn, M, O, I = 2, 64, 24, 32
    x = torch.randn(M, I, dtype=torch.bfloat16)
    wl, ws = torch.randn(epn, O, I, dtype=torch.bfloat16), torch.randn(epn, O, I,
                                                                       dtype=torch.bfloat16)
    y = torch.empty(M, O, dtype=torch.bfloat16)
    cu = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    work = gk._launch("fwd", -1, x, wl, ws, y, None, cu, epn, M, O, I, flags=gk._KEEP_TAIL)
    (a,) = seen
    assert a[:3] == (0, -1, 0)                                       # kind, config, raster
    assert a[3:9] == (x.data_ptr(), wl.data_ptr(), ws.data_ptr(), y.data_ptr(), None,
                      cu.data_ptr())
    assert a[9:14] == (2 * epn, epn, M, O, I)
    table = gk._call_constants("fwd", M, 2 * epn, O, I, 132)[1]
    assert [a[14][i] for i in range(len(table))] == pytest.approx(list(table))
    assert a[15] == gk.candidate_mask("fwd", M, 2 * epn, O, I, 132)
    assert a[16] == gk._KEEP_TAIL | gk._PDL
    assert a[17:] == (work.data_ptr(), 512, 132, 0x1234) and work.numel() == 512
    monkeypatch.setenv("MOONEP_GEMM_PDL", "0")
    gk._launch("fwd", 1, x, wl, ws, y, None, cu, epn, M, O, I, workspace=work)
    assert seen[1][1] == 1 and seen[1][16] == 0 and seen[1][17] == work.data_ptr()
    gk.clear_plan_cache()


def test_gemm_api_launches_on_the_cutlass_branch(monkeypatch):
    """The public GEMM calls on the CUTLASS branch (CPU bf16 tensors taken for CUDA ones, the
    library a callback behind its real prototype) hand the launch what the per-call path
    computes from the arguments: every pointer, G, epn, M, O, I, the mask, flags and table of
    the call's shape; a repeated call (its signature's entry) the new tensors' pointers, and a
    changed switch its new value."""
    import ctypes
    from types import SimpleNamespace
    from moonep_ops import native
    restype, argtypes = native.GEMM_PROTOTYPES["moonep_grouped_gemm"]
    seen = []
    fn = ctypes.CFUNCTYPE(restype, *argtypes)(lambda *a: seen.append(a) or 0)
    lib = SimpleNamespace(grouped_gemm=fn)
    for name, val in (("gemm", lambda: lib), ("require_gemm", lambda: lib),
                      ("gemm_keep_tail", lambda: True)):
        monkeypatch.setattr(native, name, val)
    monkeypatch.setattr(gk, "_on_cuda", lambda t: True)
    monkeypatch.setattr(gk, "sm_count", lambda dev: 132)
    monkeypatch.setattr(gk, "current_raw_stream", lambda dev: 0x1234)
    monkeypatch.setattr(gk, "_workspace_bytes", lambda kid, G, sm: 512)
    for v in ("MOONEP_GEMM_FAMILY", "MOONEP_GEMM_CANDIDATES", "MOONEP_GEMM_PDL"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("MOONEP_VALIDATE", "0")
    gk.clear_plan_cache()
    epn, M, O, I = 4, 256, 24, 32
    bf = torch.bfloat16

    def tensors():
        return (torch.randn(M, I, dtype=bf), torch.randn(M, O, dtype=bf),
                torch.randn(epn, O, I, dtype=bf), torch.randn(epn, O, I, dtype=bf),
                torch.zeros(epn, O, I, dtype=bf), torch.zeros(epn, O, I, dtype=bf),
                torch.tensor([32, 64, 96, 128, 160, 192, 224, 240], dtype=torch.int32))

    def check(kind, a, b, b_slot, d, d_slot, cu, flags, config=-1):
        args = seen.pop()
        ptr = [None if t is None else t.data_ptr() for t in (a, b, b_slot, d, d_slot, cu)]
        assert args[:3] == (gk._KIND_ID[kind], config, 0)
        assert args[3:9] == tuple(ptr)
        assert args[9:14] == (2 * epn, epn, M, O, I)
        assert args[15] == gk.candidate_mask(kind, M, 2 * epn, O, I, 132)
        assert args[16] == flags
        table = gk._call_constants(kind, M, 2 * epn, O, I, 132)[1]
        assert [args[14][i] for i in range(len(table))] == pytest.approx(list(table))
        assert args[18:] == (512, 132, 0x1234)

    for _ in range(2):                          # a signature's first call, then its entry
        x, dy, wl, ws, gl, gs, cu = tensors()
        y = gm.grouped_mm(x, wl, ws, cu, zero_tail=False)
        check("fwd", x, wl, ws, y, None, cu, gk._KEEP_TAIL | gk._PDL)
        dx = gm.grouped_mm_dgrad(dy, wl, ws, cu)
        check("dgrad", dy, wl, ws, dx, None, cu, gk._PDL)
        gm.grouped_mm_wgrad_into(dy, x, cu, gl, gs)
        check("wgrad_lp", dy, x, None, gl, gs, cu, gk._KEEP_EMPTY_SLOTS | gk._PDL)
        y = gm.run_fwd(x, wl, ws, cu, 2, False)                 # moe_experts' entry
        check("fwd", x, wl, ws, y, None, cu, gk._KEEP_TAIL | gk._PDL, config=2)
    monkeypatch.setenv("MOONEP_GEMM_PDL", "0")
    y = gm.grouped_mm(x, wl, ws, cu, config=1)
    check("fwd", x, wl, ws, y, None, cu, 0, config=1)
    monkeypatch.setenv("MOONEP_GEMM_FAMILY", "moonep")
    monkeypatch.setenv("MOONEP_GEMM_CANDIDATES", gm.gemm_cost_model.CONFIGS["dgrad"][0].name)
    dx = gm.grouped_mm_dgrad(dy, wl, ws, cu)
    check("dgrad", dy, wl, ws, dx, None, cu, 0)
    strided = dy.t().contiguous().t()                       # dy's values, another layout
    gm.grouped_mm_wgrad_into(strided, x, cu, gl, gs)
    assert seen.pop()[3] != strided.data_ptr()              # a contiguous copy launched
    bad = torch.tensor([32, 16, 96, 128, 160, 192, 224, 240], dtype=torch.int32)
    gm.grouped_mm(x, wl, ws, bad)                           # MOONEP_VALIDATE=0: not read
    seen.pop()
    monkeypatch.setenv("MOONEP_VALIDATE", "auto")           # CPU tensors: read
    with pytest.raises(ValueError, match="non-decreasing"):
        gm.grouped_mm(x, wl, ws, bad)
    monkeypatch.setenv("MOONEP_GEMM_BACKEND", "reference")
    y = gm.grouped_mm(x, wl, ws, cu)
    assert not seen and torch.equal(y, gm.reference_grouped_mm(x, wl, ws, cu))
    gk.clear_plan_cache()


def test_fp8_launch_through_the_c_prototype(monkeypatch):
    """Fp8Gemm.launch's arguments pass ctypes' conversion of the FP8 GEMM's real prototype,
    with the raw stream, the forced config and the workspace it returns."""
    import ctypes
    from types import SimpleNamespace
    from moonep_ops import native
    from moonep_ops.ops import grouped_mm_fp8 as g8
    restype, argtypes = native.GEMM_FP8_PROTOTYPES["moonep_grouped_gemm_fp8"]
    seen = []
    fn = ctypes.CFUNCTYPE(restype, *argtypes)(lambda *a: seen.append(a) or 0)
    gemm = g8.Fp8Gemm("fp8", lambda: None, lambda: SimpleNamespace(
        grouped_gemm_fp8=fn, gemm_fp8_workspace_bytes=lambda G, sms: 256 + G),
        g8.fp8_cost, "MOONEP_GEMM_FP8_CONFIG", "test FP8 GEMM")
    monkeypatch.setattr(g8, "sm_count", lambda dev: 132)
    monkeypatch.setattr(g8, "current_raw_stream", lambda dev: 0x4321)
    monkeypatch.delenv("MOONEP_GEMM_FP8_CONFIG", raising=False)
    operands = (16, 32, 48, 64, 80, 96, 112, 128, 4, 2, 64, 24, 32)
    work = gemm.launch(operands, 4, gk._PDL, 1, torch.device("cpu"))
    (a,) = seen
    assert a[:8] == operands[:8] and a[8:13] == operands[8:]
    assert a[13] == 1 and a[15] == gk._PDL                              # config, flags
    assert a[16:] == (work.data_ptr(), 260, 132, 0x4321) and work.numel() == 260


@pytest.mark.parametrize("world", [1, 2])
def test_symm_backend_reads_the_stream_once_per_op(monkeypatch, world):
    """The CUDA data plane's launches, on a skeleton SymmBackend with the library replaced by
    callbacks behind its real prototypes (native.EP_PROTOTYPES): every launch and barrier of
    one op gets the stream read once for that op, and each barrier its code.  A one-rank group
    launches only the "sent" barriers (the epoch dispatch_recv checks), a larger one all."""
    import ctypes
    from types import SimpleNamespace
    from moonep_ops import native
    from moonep_ops.backends import symm
    from moonep_ops.geometry import GroupSpec
    calls, reads = [], []
    fns = {}
    for name in ("barrier", "publish_ptrs", "combine_recv", "dispatch_send", "dispatch_recv",
                 "push_weights", "reduce_grads", "zero_slots"):
        restype, argtypes = native.EP_PROTOTYPES["moonep_ep_" + name]
        fns["ep_" + name] = ctypes.CFUNCTYPE(restype, *argtypes)(
            lambda *a, _n=name: calls.append((_n, a)) or 0)
    monkeypatch.setattr(native, "require_ep", lambda: SimpleNamespace(**fns))
    monkeypatch.setattr(symm, "current_raw_stream", lambda dev: reads.append(dev) or 0x77)
    be = object.__new__(symm.SymmBackend)
    be.spec = GroupSpec(R=1, E=4, S=8, K=2, token_padding=1, D=16, dtype=torch.bfloat16)
    be.rank, be.world_size, be.device = 0, world, torch.device("cpu")
    be.timeout_ns, be.num_sms, be.direct, be.row_bytes = 10 ** 9, 132, True, 32
    for n in ("sig_peers", "epoch", "err", "ptab", "ptab_peers", "x_stage", "desc",
              "desc_peers", "wland", "wland_peers", "x_peers"):
        setattr(be, n, torch.zeros(8, dtype=torch.int64))
    slots = [torch.zeros(4, 3, 2), torch.zeros(4, 2, 3)]
    be._sym_peers = {t.data_ptr(): torch.zeros(1, dtype=torch.int64) for t in slots}
    h, dst = torch.zeros(16, 16, dtype=torch.bfloat16), torch.arange(16, dtype=torch.int32)
    etc = torch.zeros(1, 4, dtype=torch.int32)

    def run(fn, *args):
        calls.clear()
        reads.clear()
        fn(*args)
        assert len(reads) == 1, reads                          # one stream read per op
        assert all(a[-1] == 0x77 for _, a in calls), calls
        return [(n, a[6] if n == "barrier" else None) for n, a in calls]

    code = native.BARRIER_CODE

    def want(*seq):
        return [(n, c) for n, c in seq if n != "barrier" or world > 1 or c == code["sent"]]

    assert run(be.combine, h, None, dst) == want(
        ("publish_ptrs", None), ("barrier", code["staged"]), ("combine_recv", None),
        ("barrier", code["gathered"]))
    assert run(be.dispatch_with_plan, torch.zeros(8, 16, dtype=torch.bfloat16), None, dst, 16) \
        == want(("dispatch_send", None), ("barrier", code["sent"]), ("dispatch_recv", None),
                ("barrier", code["received"]))
    assert run(be.prefetch_weight, etc, [torch.zeros(4, 3, 2), torch.zeros(4, 2, 3)], slots) \
        == want(("barrier", code["slots_free"]), ("push_weights", None),
                ("barrier", code["slots_filled"]))
    assert run(be.reduce_grad, etc, [torch.zeros(4, 3, 2), torch.zeros(4, 2, 3)], slots) == want(
        ("barrier", code["grads_complete"]), ("reduce_grads", None),
        ("barrier", code["grads_read"]), ("zero_slots", None))
    calls.clear()
    be.barrier("sent")                                        # alone: reads the stream itself
    assert calls[0][1][-1] == 0x77 and calls[0][1][6] == code["sent"]


def test_standin_benchmark_runs_and_restores(tmp_path):
    """bench_host_cost --standin reaches the CUTLASS branch's launch on CPU tensors (it raises
    otherwise) and puts back every stub and the environment after."""
    import json
    import sys
    from pathlib import Path
    from moonep_ops import native
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_host_cost
    before = (native.gemm, native.require_gemm, gk._on_cuda, runtime.sm_count, gk.sm_count,
              runtime.current_raw_stream, os.environ.get("MOONEP_VALIDATE"))
    assert bench_host_cost.main(["--standin", "--calls", "3", "--reps", "1", "--rounds", "1",
                                 "--out", str(tmp_path)]) == 0
    assert before == (native.gemm, native.require_gemm, gk._on_cuda, runtime.sm_count,
                      gk.sm_count, runtime.current_raw_stream, os.environ.get("MOONEP_VALIDATE"))
    rows = json.loads((tmp_path / "host_cost_standin.json").read_text())["standin"]
    assert {r["kind"] for r in rows} == {"fwd", "dgrad", "wgrad_into"}
    assert all(r[k] > 0 for r in rows for k in ("api", "body", "native", "empty"))
    root = Path(__file__).resolve().parent.parent                  # this tree as its baseline
    assert bench_host_cost.main(["--standin", "--calls", "3", "--reps", "1", "--rounds", "1",
                                 "--baseline", str(root), "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "host_cost_standin_baseline.json").read_text())
    assert len(doc["rows"]) == len(rows) and all(r["api_baseline"] > 0 and r["api_this"] > 0
                                                 for r in doc["rows"])
