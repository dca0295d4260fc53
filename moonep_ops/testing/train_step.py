"""A training step that compiles as one graph: forward, ``loss.backward()``, functional SGD.

Two torch facts shape it (found in tests/test_moe.py):
  * ``torch.optim`` optimizers always graph-break in ``step()``, so the update is written out;
  * on torch 2.13 CPU, inductor's pattern matcher mis-compiles ``p.add_(p.grad, alpha=-lr)`` for
    an mm-produced grad (a wrong update even at lr = 0); ``p.sub_(p.grad * lr)`` compiles right.
Tracing ``loss.backward()`` inside ``torch.compile`` needs
``torch._dynamo.config.trace_autograd_ops = True`` (:func:`enable_backward_tracing`).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor, nn


def enable_backward_tracing() -> None:
    """Let dynamo trace ``loss.backward()`` (a no-op on torch versions without the switch)."""
    if hasattr(torch._dynamo.config, "trace_autograd_ops"):
        torch._dynamo.config.trace_autograd_ops = True


def sgd_step(model: nn.Module, params: Sequence[nn.Parameter], lr: float, *,
             mean: bool = False, skip_nonfinite: bool = False) -> Callable[[Tensor, Tensor], Tensor]:
    """``step(x, gy) -> loss``: loss = sum(model(x) * gy) (divided by its size if ``mean``),
    backward, ``p -= lr * p.grad`` for every p of ``params``, grads cleared.  With
    ``skip_nonfinite`` a step whose loss is not finite updates nothing (decided on the device, no
    host sync), as a loss scaler skips an overflowing step.  Compiles with ``fullgraph=True``
    (also ``mode="reduce-overhead"`` on the CUDA backend)."""
    params = list(params)

    def step(x: Tensor, gy: Tensor) -> Tensor:
        out = model(x)
        loss = (out.float() * gy).sum()
        if mean:
            loss = loss / out.numel()
        loss.backward()
        with torch.no_grad():
            ok = torch.isfinite(loss) if skip_nonfinite else None
            for p in params:
                d = p.grad * lr
                if ok is not None:
                    d = torch.where(ok, d, torch.zeros_like(d))
                p.sub_(d)
                p.grad = None
        return loss.detach()

    return step


def grads_with_and_without_input_grad(layer: nn.Module, x: Tensor,
                                      loss: Callable[[Tensor], Tensor], op: str):
    """One forward + backward of ``loss(layer(x))`` with x requiring grad, then without:
    ([calls of ``op`` in each backward], [each run's parameter grads by name]).  The calls are
    counted in a CPU profile by name, so the bodies the expert ops call directly count too (they
    run in a range named like their op while a profiler runs)."""
    from torch.profiler import ProfilerActivity, profile
    calls, grads = [], []
    for need in (True, False):
        layer.zero_grad(set_to_none=True)
        out = layer(x.clone().requires_grad_(need))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            loss(out).backward()
        calls.append(sum(e.name == op for e in prof.events()))
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    return calls, grads
