"""Argument errors of the async (comm-stream) mode, on CPU (moonep_ops/comm_stream.py).

The async mode exists only on the CUDA symmetric-memory backend; every other backend raises a
clear ValueError before anything is communicated or written.  Bad values (a non-bool async_op,
a previous_event that is no event, a comm stream of another device) raise before any backend
work too.  The GPU behaviour is in tests/test_async_cuda.py.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from moonep_ops import Buffer
from moonep_ops.backends import TorchDistBackend
from moonep_ops.comm_stream import EventHandle, check_async_args, check_comm_stream

from test_data_plane import routing, token_inputs


def _single(S=6, H=8, K=3, E=4, tp=2, s=5):
    buf = Buffer(S, H, K, E, token_padding=tp, dtype=torch.float32)
    x, w = token_inputs(0, s, H, K, torch.float32, 3)
    t = routing("dup", 0, 1, s, K, E, 3)
    return buf, x, w, t


def _snapshot(buf):
    return buf.backend.recv_rows.clone(), buf.backend.recv_meta.clone(), buf.backend.recv_weights.clone()


def _unchanged(buf, snap):
    return all(torch.equal(a, b) for a, b in zip(_snapshot(buf), snap))


def test_default_results_unchanged():
    """Without async_op the methods return what they always returned."""
    buf, x, w, t = _single()
    out = buf.dispatch(x, t, w)
    assert len(out) == 4
    h, wn, cu, plan = out
    assert len(buf.dispatch(x, route_weights_sK=w, plan=plan)) == 4
    assert len(buf.combine(plan, h, wn)) == 2
    assert buf.comm_stream is None
    loc, slots = [torch.randn(buf.epn, 3)], [torch.zeros(buf.epn, 3)]
    assert buf.prefetch_weight(plan, local_weights=loc, slot_weights=slots) is None
    assert buf.reduce_grad(plan, local_grads=loc, slot_grads=slots) is None
    # async_op=False spelled out is the same call
    assert len(buf.dispatch(x, t, w, async_op=False)) == 4


def test_async_on_host_backend_raises_before_anything():
    buf, x, w, t = _single()
    h, wn, cu, plan = buf.dispatch(x, t, w)
    snap = _snapshot(buf)
    with pytest.raises(ValueError, match="CUDA symmetric-memory backend.*SingleRankBackend"):
        buf.dispatch(x, t, w, async_op=True)
    with pytest.raises(ValueError, match="SingleRankBackend"):
        buf.dispatch(x, route_weights_sK=w, plan=plan, async_op=True)
    with pytest.raises(ValueError, match="SingleRankBackend"):
        buf.combine(plan, h, wn, async_op=True)
    loc, slots = [torch.randn(buf.epn, 3)], [torch.full((buf.epn, 3), 5.0)]
    with pytest.raises(ValueError, match="SingleRankBackend"):
        buf.prefetch_weight(plan, local_weights=loc, slot_weights=slots, async_op=True)
    g0 = loc[0].clone()
    with pytest.raises(ValueError, match="SingleRankBackend"):
        buf.reduce_grad(plan, local_grads=loc, slot_grads=slots, async_op=True)
    with pytest.raises(ValueError, match="SingleRankBackend"):
        buf.capture()
    assert bool((slots[0] == 5).all()) and torch.equal(loc[0], g0)
    assert _unchanged(buf, snap)
    assert buf.comm_stream is None


@pytest.mark.parametrize("bad", [1, 0, "yes", None, torch.tensor(True)])
def test_async_op_must_be_bool(bad):
    buf, x, w, t = _single()
    with pytest.raises(TypeError, match="async_op must be a bool"):
        buf.dispatch(x, t, w, async_op=bad)
    h, wn, cu, plan = buf.dispatch(x, t, w)
    with pytest.raises(TypeError, match="async_op must be a bool"):
        buf.combine(plan, h, async_op=bad)


def test_previous_event_checks():
    buf, x, w, t = _single()
    h, wn, cu, plan = buf.dispatch(x, t, w)
    with pytest.raises(TypeError, match="previous_event must be"):
        buf.dispatch(x, t, w, async_op=True, previous_event="event")
    with pytest.raises(TypeError, match="previous_event must be"):
        buf.combine(plan, h, async_op=True, previous_event=torch.zeros(1))
    ev = torch.Event(device="cpu") if hasattr(torch, "Event") else None
    if ev is not None:
        # a real event without async_op: refused (a synchronous call runs in stream order)
        with pytest.raises(ValueError, match="only used with async_op=True"):
            buf.combine(plan, h, previous_event=ev)
        # with async_op on the CPU backend: the backend error
        with pytest.raises(ValueError, match="SingleRankBackend"):
            buf.combine(plan, h, async_op=True, previous_event=ev)


def test_comm_stream_argument_checks():
    with pytest.raises(TypeError, match="comm_stream must be"):
        Buffer(4, 8, 2, 4, dtype=torch.float32, comm_stream="side")
    with pytest.raises(TypeError, match="comm_stream must be"):
        Buffer(4, 8, 2, 4, dtype=torch.float32, comm_stream=3)
    with pytest.raises(ValueError, match="CUDA symmetric-memory backend"):
        Buffer(4, 8, 2, 4, dtype=torch.float32, comm_stream=True)
    # a stream object of another device (a CPU stream, a stream of cuda:1): device error first
    with pytest.raises(ValueError, match="lives on cpu"):
        Buffer(4, 8, 2, 4, dtype=torch.float32, comm_stream=torch.Stream(device="cpu"))
    fake_gpu1 = torch.Stream(stream_id=0, device_index=1, device_type=1)
    with pytest.raises(ValueError, match="lives on cuda:1 but the Buffer on cpu"):
        Buffer(4, 8, 2, 4, dtype=torch.float32, comm_stream=fake_gpu1)
    # the validator itself, as a device-side backend would see it (no GPU needed for the error)

    class DeviceSide:
        supports_async = True

    with pytest.raises(ValueError, match="lives on cuda:1 but the Buffer on cuda:0"):
        check_comm_stream(fake_gpu1, torch.device("cuda", 0), DeviceSide())
    assert check_comm_stream(None, torch.device("cuda", 0), DeviceSide()) is None
    assert check_comm_stream(False, torch.device("cuda", 0), DeviceSide()) is None
    # False / None keep the default
    buf = Buffer(4, 8, 2, 4, dtype=torch.float32, comm_stream=False)
    assert buf.comm_stream is None


def test_check_async_args_order():
    """Type errors come before the backend error; async_op=False needs nothing."""
    buf, *_ = _single()
    check_async_args(buf, False, None)
    with pytest.raises(TypeError):
        check_async_args(buf, "no", None)
    with pytest.raises(ValueError, match="SingleRankBackend"):
        check_async_args(buf, True, None)


def test_event_handle_is_exported_from_buffer_module():
    import moonep_ops.buffer as bmod
    assert bmod.EventHandle is EventHandle


@pytest.fixture
def gloo_one_rank():
    created = False
    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(prefix="moonep_gloo_"), "store")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
        created = True
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def test_async_on_gloo_raises(gloo_one_rank):
    buf = Buffer(6, 8, 3, 4, group=gloo_one_rank, token_padding=2, dtype=torch.float32,
                 backend="torch")
    assert isinstance(buf.backend, TorchDistBackend)
    x, w = token_inputs(0, 5, 8, 3, torch.float32, 3)
    t = routing("dup", 0, 1, 5, 3, 4, 3)
    snap = _snapshot(buf)
    with pytest.raises(ValueError, match="TorchDistBackend, which reads split sizes on the host"):
        buf.dispatch(x, t, w, async_op=True)
    assert _unchanged(buf, snap)
    with pytest.raises(ValueError, match="TorchDistBackend"):
        Buffer(6, 8, 3, 4, group=gloo_one_rank, dtype=torch.float32, backend="torch",
               comm_stream=True)
    h, wn, cu, plan = buf.dispatch(x, t, w)        # the synchronous path still works
    y, wk = buf.combine(plan, h, wn)
    assert y.shape == (5, 8)
