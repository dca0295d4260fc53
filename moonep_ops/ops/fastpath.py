"""Eager calls of the layer's custom ops without the dispatcher.

A ``torch.library.custom_op`` call in eager mode goes through the C++ dispatcher into Python
three times (autograd, the backend kernel, a dynamo-disabled wrapper), checks the outputs'
aliasing, and, when an input requires grad, rebuilds the schema's argument list once per
argument to fill defaults for setup_context: ~10 us without grad and ~25 us with it, per call,
on the CPU of the CI machine (tests/test_host_cost.py, benchmarks/bench_host_cost.py).  The layer
step makes six such calls (dispatch, moe_experts, combine, and their transposes in backward).

``call(op, body, fn, *args)`` runs the op's own Python body (its checks included) directly,
inside ``fn`` (an autograd.Function with the op's setup_context and backward) when an input
requires grad, whenever that is the same as calling the op: ``eager(...)``.  Otherwise (traced
by torch.compile or make_fx, a dispatch or function mode, a functorch transform, a tensor
subclass, functionalization, meta or fake tensors, a profiler recording the op by name) it
calls the op.  So compiled graphs, fake kernels, opcheck and profiles are unchanged: the ops
stay custom ops, and this is only their eager entry point.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch._C import _functorch
from torch.autograd import _profiler_enabled

_PLAIN = (Tensor, torch.nn.Parameter)
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_is_functional = torch._is_functional_tensor
_is_wrapped = _functorch.is_functorch_wrapped_tensor
_grad_enabled = torch.is_grad_enabled


def _plain(t: Tensor) -> bool:
    # (is_meta: the type test first, so no subclass's own device property is bypassed)
    return (type(t) in _PLAIN and not t.is_meta and not _is_functional(t)
            and not _is_wrapped(t))


OP, BODY, AUTOGRAD = 0, 1, 2


def intercepted() -> bool:
    """Some call goes through the dispatcher whatever its arguments: torch.compile tracing, a
    dispatch or function mode, a profiler."""
    return bool(_is_compiling() or _dispatch_modes() or _function_modes() or _profiler_enabled())


def route(args) -> int:
    """How a call with these arguments runs: OP (the dispatcher), BODY (the op's body:
    ``eager`` and not ``needs_grad``) or AUTOGRAD (eager, and autograd records it), in one
    pass over the arguments."""
    if intercepted():
        return OP
    grad = _grad_enabled()
    record = False
    for a in args:
        if isinstance(a, Tensor):
            # (_plain, inlined: the hot loop of every eager call)
            if (type(a) not in _PLAIN or a.is_meta or _is_functional(a)
                    or _is_wrapped(a)):
                return OP
            if grad and a.requires_grad:
                record = True
        elif isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, Tensor) and not _plain(t):
                    return OP
    return AUTOGRAD if record else BODY


def route_plain(tensors) -> int:
    """``route(tensors)`` after ``intercepted()`` said no, for tensors the caller knows to be of
    a plain type (``type(t) in (Tensor, Parameter)``) on a device other than meta: only the
    functionalization / functorch wrappers and requires_grad are left to read."""
    record = False
    for t in tensors:
        if _is_functional(t) or _is_wrapped(t):
            return OP
        if t.requires_grad:
            record = True
    return AUTOGRAD if record and _grad_enabled() else BODY


def eager(*args) -> bool:
    """Calling an op's body directly is the same as calling the op, for these arguments
    (tensors, lists of tensors, or anything else)."""
    return route(args) != OP


def needs_grad(*args) -> bool:
    """Autograd records the call: grad mode on and some tensor argument requires grad."""
    return _grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)


def call(op, body, fn, *args):
    """``op(*args)``: in eager mode ``body(*args)``, or ``fn.apply(*args)`` when autograd
    records the call.  ``fn`` None: an op without autograd, called as the op when autograd
    would record it (so that backward through it raises as it did)."""
    how = route(args)
    if how == BODY:
        return body(*args)
    if how == AUTOGRAD and fn is not None:
        return fn.apply(*args)
    return op(*args)


def autograd(op, name: str, body, setup_context, backward) -> type:
    """Registers ``op``'s autograd and returns ``name``, the autograd.Function of its eager
    path: forward = the op's body and its setup_context, backward = the op's backward (one
    registration for both paths; autograd.Function has the same contract: grads of every
    output in, one grad or None per input out)."""
    op.register_autograd(backward, setup_context=setup_context)

    def forward(ctx, *args):
        out = body(*args)
        setup_context(ctx, args, out)
        return out

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


__all__ = ["eager", "needs_grad", "intercepted", "route", "route_plain", "OP", "BODY",
           "AUTOGRAD", "call", "autograd"]
