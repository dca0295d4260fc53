"""The MoE layer: router -> dispatch -> routed SwiGLU experts -> weights -> combine (+ shared).

    ids_sK, w_sK, scores_sE = router(x_sD)                           fp32 router
    h_MD, w_M, cu_G, plan   = buffer.dispatch(x_sD, ids_sK, w_sK)    exactly the cap of rows real
    y_MD                    = moonep::moe_experts(h_MD, cu_G, plan.experts_to_copy, w1, w3, w2)
    out_sD                  = buffer.combine(plan, y_MD * w_M) [+ shared_expert(x_sD)]

Expert weights (nn.Linear layout): w1 (gate) and w3 (up) [B, F, D], w2 (down) [B, D, F], this
rank's home experts; the redundant slots live in the Buffer's ExpertPool
(moonep_ops/ops/moe_experts.py, with the backward and the memory formula).  The weight grads come
back holding every rank's contribution for the home experts.  The router and the shared expert
are replicated like any data-parallel parameter: all-reduce their grads over the EP group
(``reduce_router_grad``) as DDP/FSDP would.

On CUDA the shared expert runs on a side stream, overlapping dispatch, the routed GEMMs and
combine (events only, no host sync; eager mode: torch.compile keeps one stream).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.functional import silu
from torch import Tensor, nn

from ..buffer import Buffer
from ..ops import moe_experts as _moe_experts  # noqa: F401  (registers moonep::moe_experts)
from .router import Router


def check_backend_dims(device_type: str, dtype: torch.dtype, D: int, F: int) -> None:
    """Hidden sizes the grouped-GEMM backends take: CUDA bf16 rows must be 16-byte multiples
    (TMA / torch._grouped_mm alignment); the CPU reference takes any size."""
    if device_type == "cuda" and dtype == torch.bfloat16 and (D % 8 or F % 8):
        raise ValueError(f"CUDA grouped GEMMs need D and F multiples of 8 (16-byte rows); "
                         f"got D={D}, F={F}")


class SwiGLU(nn.Module):
    """Dense SwiGLU FFN (the shared expert)."""

    def __init__(self, dim: int, hidden: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False, dtype=dtype, device=device)
        self.w3 = nn.Linear(dim, hidden, bias=False, dtype=dtype, device=device)
        self.w2 = nn.Linear(hidden, dim, bias=False, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(silu(self.w1(x)) * self.w3(x))


class MoonEPMoE(nn.Module):
    """Drop-in MoE layer over a MoonEP ``Buffer`` (see the module docstring)."""

    def __init__(self, buffer: Buffer, hidden_dim: int, *, score_func: str = "softmax",
                 route_norm: bool = False, route_scale: float = 1.0, balance_rate: float = 0.0,
                 num_shared_experts: int = 0, shared_hidden_dim: Optional[int] = None,
                 init_std: float = 0.02, side_stream: bool = True):
        super().__init__()
        if not isinstance(buffer, Buffer):
            raise TypeError("buffer must be a moonep_ops.Buffer")
        D, E, K, R, B = buffer.D, buffer.E, buffer.K, buffer.R, buffer.epn
        if K > E:
            raise ValueError(f"top-k K={K} > num_experts E={E}")
        if hidden_dim < 1:
            raise ValueError(f"hidden_dim must be >= 1, got {hidden_dim}")
        dev, dt = buffer.device, buffer.dtype
        check_backend_dims(dev.type, dt, D, hidden_dim)
        self.buffer = buffer          # a plain attribute (not a Module): traced through, not lifted
        self.D, self.F, self.E, self.K, self.R, self.B = D, hidden_dim, E, K, R, B
        self.router = Router(D, E, K, score_func=score_func, route_norm=route_norm,
                             route_scale=route_scale, balance_rate=balance_rate,
                             balance_group=buffer.group)
        self.router.to(dev)
        self.w1 = nn.Parameter(torch.randn(B, hidden_dim, D, device=dev).mul_(init_std).to(dt))
        self.w3 = nn.Parameter(torch.randn(B, hidden_dim, D, device=dev).mul_(init_std).to(dt))
        self.w2 = nn.Parameter(torch.randn(B, D, hidden_dim, device=dev).mul_(init_std).to(dt))
        self.pool_name = buffer.expert_pool(D, hidden_dim, dt).name
        self.shared = None
        if num_shared_experts:
            self.shared = SwiGLU(D, num_shared_experts * (shared_hidden_dim or hidden_dim), dt, dev)
        self._side = (torch.cuda.Stream(device=dev)
                      if side_stream and dev.type == "cuda" and self.shared is not None else None)
        self.last_scores = None

    def forward(self, x_sD: Tensor, total_num_tokens: Optional[int] = None) -> Tensor:
        buf = self.buffer
        ids_sK, w_sK, scores = self.router(x_sD)
        self.last_scores = scores.detach()
        shared_out = None
        side = self._side if not torch.compiler.is_compiling() else None
        if self.shared is not None and side is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                shared_out = self.shared(x_sD)
        h, w_M, cu, plan = buf.dispatch(x_sD, ids_sK, w_sK, total_num_tokens=total_num_tokens)
        y, _, _ = torch.ops.moonep.moe_experts(h, cu, plan.experts_to_copy, self.w1, self.w3,
                                               self.w2, self.pool_name)
        z = (y.float() * w_M[:, None]).to(x_sD.dtype)
        out, _ = buf.combine(plan, z)
        if self.shared is not None:
            if side is not None:
                torch.cuda.current_stream().wait_stream(side)
                shared_out.record_stream(torch.cuda.current_stream())
            else:
                shared_out = self.shared(x_sD)
            out = out + shared_out
        return out

    @torch.no_grad()
    def update_balance(self) -> None:
        """Quantile-Balancing step from the last forward's router scores (after backward)."""
        if self.last_scores is not None:
            self.router.update_balance(self.last_scores)

    def reduce_router_grad(self) -> None:
        """All-reduce (sum) the replicated router's and shared expert's grads over the EP group."""
        group = self.buffer.group
        if group is None or not dist.is_initialized():
            return
        params = list(self.router.parameters()) + (list(self.shared.parameters()) if self.shared else [])
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
