"""The async mode of the data plane: a Buffer's ops on a dedicated *comm stream* (eager API).

``Buffer.dispatch / combine / prefetch_weight / reduce_grad(..., async_op=True)`` launch their
kernels on the Buffer's comm stream instead of the caller's current stream, and return an
:class:`EventHandle` marking the end of that work, so compute on the caller's stream can overlap
the communication (DeepEP's ``previous_event`` / ``async_finish`` / ``EventOverlap``).  One call:

  1. the comm stream waits for ``previous_event`` if one is given, else for the caller's current
     stream (everything queued there so far: the inputs are ready);
  2. it also waits for the Buffer's previous data-plane op if that ran on another stream (the
     Buffer's symmetric regions and barrier counter are used by one op at a time, in call order);
  3. the op runs with the comm stream as the current stream (its outputs are allocated there);
  4. allocator safety: every input tensor is ``record_stream``-ed on the comm stream (the caller
     may drop it at once), every output on the caller's stream (and on the stream given to
     ``EventHandle.wait``), so no block is reused while another stream may still use it;
  5. an event is recorded on the comm stream and returned in the handle.
Nothing is read on the host.  Only the CUDA symmetric-memory backend (SymmBackend) has an async
mode: the torch.distributed and single-rank backends read split sizes on the host and always run
synchronously, so ``async_op=True`` raises a ``ValueError`` there.

The ``torch.ops.moonep.*`` ops themselves (and so everything under ``torch.compile``) always
launch on the current stream; async mode is a Python-level wrapper and refuses to run while
compiling.  Under CUDA-graph capture the comm stream forks from the capturing stream through an
event and the caller joins it back with ``handle.wait()`` (required before the capture ends).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import Tensor


class EventHandle:
    """The end of one async data-plane op (an event recorded on the Buffer's comm stream).

    ``wait(stream=None)`` / ``current_stream_wait()`` make a stream (default: the current one)
    wait for the op on the device, without blocking the host, and mark the op's outputs as used
    by that stream for the caching allocator.  Use the outputs (and tensors the op mutated, such
    as slot weights or local grads) only on a stream that waited.  ``query()`` and
    ``synchronize()`` are the host-side forms (eager only).  As a context manager the current
    stream waits on exit (DeepEP's ``EventOverlap``).  The handle keeps the op's output tensors
    alive until it is dropped.
    """

    __slots__ = ("event", "stream", "_tensors")

    def __init__(self, event: torch.cuda.Event, stream: torch.cuda.Stream,
                 tensors: Iterable[Tensor] = ()):
        self.event = event
        self.stream = stream
        self._tensors = tuple(t for t in tensors if isinstance(t, Tensor))

    def wait(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Make ``stream`` (default: the current stream of the comm stream's device) wait for the
        op, and record the op's outputs as used on it."""
        if stream is None:
            stream = torch.cuda.current_stream(self.stream.device)
        stream.wait_event(self.event)
        if stream != self.stream:
            for t in self._tensors:
                if t.is_cuda:
                    t.record_stream(stream)

    def current_stream_wait(self) -> None:
        """DeepEP spelling of ``wait()``."""
        self.wait()

    def query(self) -> bool:
        """True when the op has finished on the device (host-side, non-blocking, eager only)."""
        return self.event.query()

    def synchronize(self) -> None:
        """Block the host until the op has finished (a host sync; eager only)."""
        self.event.synchronize()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.wait()

    def __repr__(self):
        return f"EventHandle(stream={self.stream})"


# ---------------------------------------------------------------------------------------------
# Argument checks (pure Python: run before anything is queued)
# ---------------------------------------------------------------------------------------------


def _is_torch_or_cuda(obj, name: str) -> bool:
    """isinstance of torch.<name> or torch.cuda.<name> (the latter may be missing or not a class
    on some builds)."""
    if isinstance(obj, getattr(torch, name)):
        return True
    cuda_cls = getattr(torch.cuda, name, None)
    try:
        return cuda_cls is not None and isinstance(obj, cuda_cls)
    except TypeError:
        return False


def _is_stream(s) -> bool:
    return _is_torch_or_cuda(s, "Stream")


def _is_event(e) -> bool:
    return _is_torch_or_cuda(e, "Event")


def backend_error(backend) -> Optional[str]:
    """Why ``backend`` has no async mode (None when it has one)."""
    if backend.supports_async:
        return None
    return (f"the async mode (async_op=True / comm_stream) needs the CUDA symmetric-memory "
            f"backend (SymmBackend); this Buffer uses {type(backend).__name__}, which reads split "
            "sizes on the host and always runs synchronously on the current stream")


def check_comm_stream(comm_stream, device: torch.device, backend):
    """Validate ``Buffer(comm_stream=...)``: None/False (created at the first async op), True
    (created now) or a CUDA stream on the Buffer's device.  Returns the stream to use or None."""
    if comm_stream is None or comm_stream is False:
        return None
    if comm_stream is not True and not _is_stream(comm_stream):
        raise TypeError("comm_stream must be None, True or a torch.cuda.Stream on the Buffer's "
                        f"device, got {type(comm_stream).__name__}")
    if comm_stream is not True:
        sdev = torch.device(comm_stream.device)
        if sdev.type != "cuda" or sdev != device:
            raise ValueError(f"comm_stream lives on {sdev} but the Buffer on {device}: it must be "
                             "a CUDA stream of the Buffer's device")
    why = backend_error(backend)
    if why is not None:
        raise ValueError(why)
    if comm_stream is True:
        return torch.cuda.Stream(device=device)
    if not isinstance(comm_stream, torch.cuda.Stream):    # a generic torch.Stream of a GPU
        comm_stream = torch.cuda.Stream(stream_id=comm_stream.stream_id,
                                        device_index=comm_stream.device_index,
                                        device_type=comm_stream.device_type)
    return comm_stream


def check_async_args(buf, async_op, previous_event) -> None:
    """Validate the per-call ``async_op`` / ``previous_event`` (raises before anything runs)."""
    if not isinstance(async_op, bool):
        raise TypeError(f"async_op must be a bool, got {type(async_op).__name__}")
    if previous_event is not None:
        if not (isinstance(previous_event, EventHandle) or _is_event(previous_event)):
            raise TypeError("previous_event must be a torch.cuda.Event or an EventHandle, got "
                            f"{type(previous_event).__name__}")
        if not async_op:
            raise ValueError("previous_event is only used with async_op=True (a synchronous call "
                             "runs on the current stream, in its order)")
    if not async_op:
        return
    if torch.compiler.is_compiling():
        raise RuntimeError("async_op=True is an eager API: under torch.compile the moonep ops "
                           "launch on the current stream (call Buffer methods without async_op)")
    why = backend_error(buf.backend)
    if why is not None:
        raise ValueError(why)


def _event_of(previous_event):
    return previous_event.event if isinstance(previous_event, EventHandle) else previous_event


def _tensors(objs) -> list[Tensor]:
    out = []
    for o in objs:
        if isinstance(o, Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple)):
            out.extend(_tensors(o))
    return out


# ---------------------------------------------------------------------------------------------
# Ordering of one Buffer's ops across streams
# ---------------------------------------------------------------------------------------------


class StreamOrder:
    """Per-Buffer state: the comm stream and the *tail*, an event after the Buffer's last
    data-plane op issued through the Buffer API (with the stream it ran on).  Every op first makes
    its stream wait for the tail if the tail is on another stream, so ops of one Buffer never
    overlap each other whichever streams they run on.  Only kept once the Buffer has a comm
    stream (default Buffers do nothing).  Not kept under CUDA-graph capture (events recorded in a
    capture cannot be waited on outside it): there, join each async op with ``handle.wait()``
    before the next synchronous op of the Buffer.
    """

    def __init__(self, device: torch.device, comm_stream=None):
        self.device = device
        self.comm = comm_stream
        self.tail: Optional[tuple[torch.cuda.Event, torch.cuda.Stream]] = None

    @property
    def active(self) -> bool:
        return self.comm is not None

    def _record(self, stream) -> None:
        ev = torch.cuda.Event()
        ev.record(stream)
        self.tail = (ev, stream)

    def _after_tail(self, stream) -> None:
        if self.tail is not None and self.tail[1] != stream:
            stream.wait_event(self.tail[0])

    def ensure_comm(self) -> torch.cuda.Stream:
        if self.comm is None:
            self.comm = torch.cuda.Stream(device=self.device)
            if not torch.cuda.is_current_stream_capturing():
                # covers the synchronous ops issued before the async mode was first used
                self._record(torch.cuda.current_stream(self.device))
        return self.comm

    # synchronous ops (Buffer API, current stream)
    def before_sync(self) -> None:
        if torch.cuda.is_current_stream_capturing():
            return
        self._after_tail(torch.cuda.current_stream(self.device))

    def after_sync(self) -> None:
        if not torch.cuda.is_current_stream_capturing():
            self._record(torch.cuda.current_stream(self.device))

    def drain(self) -> None:
        """The current stream waits for the Buffer's last op (check_errors, destroy)."""
        if self.active:
            self.before_sync()

    # asynchronous ops
    def run_async(self, fn, inputs, previous_event, mutated=()):
        """Run ``fn()`` (which launches the op) on the comm stream; returns (result, handle).
        ``inputs``: every tensor the op reads or writes (record_stream on the comm stream);
        ``mutated``: the inputs it writes, which ``handle.wait(stream)`` records on ``stream``
        like the outputs."""
        capturing = torch.cuda.is_current_stream_capturing()
        comm = self.ensure_comm()
        cur = torch.cuda.current_stream(self.device)
        ev_in = _event_of(previous_event)
        if ev_in is not None:
            comm.wait_event(ev_in)
        else:
            comm.wait_stream(cur)
        if not capturing:
            self._after_tail(comm)
        with torch.cuda.stream(comm):
            result = fn()
        outs = _tensors(result if isinstance(result, (list, tuple)) else (result,))
        if comm != cur:
            for t in _tensors(inputs):
                if t.is_cuda:
                    t.record_stream(comm)
            for t in outs:
                if t.is_cuda:
                    t.record_stream(cur)
        done = torch.cuda.Event()
        done.record(comm)
        if not capturing:
            self.tail = (done, comm)
        return result, EventHandle(done, comm, outs + _tensors(mutated))
