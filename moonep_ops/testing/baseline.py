"""Plain all-to-all expert parallelism: the baseline the main job compares MoonEP against.

Every expert runs on its home rank only (no redundancy, no planner), as Megatron-LM's
``MoEAlltoAllTokenDispatcher`` does:

    ids_sK, w_sK      = router(x_sD)                       same Router as MoonEPMoE
    counts_E          = bincount(ids)                       entries per expert from this rank
    recv_RB           = all_to_all(counts_E.view(R, B))     entries per (source rank, my expert)
    rows_ND           = x[entries sorted by expert]         one row per (token, k) entry
    h                 = all_to_all_single(rows, out_splits=recv_RB.sum(1), in_splits=counts_RB.sum(1))
    h                 = sort chunks (source, expert) -> (expert, source)
    y                 = SwiGLU experts over B segments (moonep::grouped_mm, no slots)
    back              = unsort, all_to_all_single with the splits swapped, unpermute
    out_sD            = sum_k w_sk * y_sk (fp32, k = 0..K-1) [+ shared expert(x)]

Split sizes are read on the host (``tolist``), so the receive shapes follow the routing: the
hottest expert's rank receives (maxvio+1)x the balanced load, and the compiled graph sees new
shapes whenever the routing changes (the communication runs eagerly, ``torch.compiler.disable``).
The parameters are laid out exactly as ``MoonEPMoE``'s (router.gate, w1/w3 [B, F, D],
w2 [B, D, F], shared.w1/w3/w2), so one set of weights drives both layers.

A duplicate expert inside one token (allowed by the synthetic routings) is sent as its own
entry, like Megatron; MoonEP sends such a row once per destination rank.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..ops import grouped_mm as _gm  # noqa: F401  (registers moonep::grouped_mm)
from ..ops import swiglu as _sw  # noqa: F401  (registers moonep::swiglu)
from ..nn.moe import SwiGLU, check_backend_dims
from ..nn.router import Router


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with explicit split sizes; backward is the transposed exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list, in_splits: list, group) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        if group is None:                       # single process: the exchange is a copy
            out.copy_(x)
        else:
            dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                                   input_split_sizes=in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(g.contiguous(), in_splits, out_splits, ctx.group), None, None, None


@torch.compiler.disable
def _exchange_counts(counts_RB: Tensor, group) -> tuple[Tensor, list, list, list]:
    """Per (destination, expert) counts out -> per (source, my expert) counts in (+ host lists)."""
    recv = torch.empty_like(counts_RB)
    if group is None:
        recv.copy_(counts_RB)
    else:
        dist.all_to_all_single(recv, counts_RB.contiguous(), group=group)
    return recv, recv.tolist(), counts_RB.sum(1).tolist(), recv.sum(1).tolist()


@torch.compiler.disable
def _a2a(x: Tensor, out_splits: list, in_splits: list, group) -> Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _chunk_order(recv_RB: Tensor, total: int) -> Tensor:
    """Row permutation taking the received layout (source-major, expert inside) to expert-major
    (source inside): ``h_expert_major = h_received[order]``."""
    R, B = recv_RB.shape
    n = recv_RB.reshape(-1).long()
    start = torch.cumsum(n, 0) - n                           # start of chunk (src, e), received
    chunk = torch.arange(R * B, device=recv_RB.device).view(R, B).t().reshape(-1)  # (e, src)
    lens = n[chunk]
    rows = torch.repeat_interleave(start[chunk], lens, output_size=total)
    base = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens, output_size=total)
    return rows + torch.arange(total, device=recv_RB.device) - base


class AllToAllEPMoE(nn.Module):
    """Megatron-style expert-parallel MoE layer over ``group`` (None: a single process)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, *,
                 group: Optional[dist.ProcessGroup] = None, score_func: str = "softmax",
                 route_norm: bool = False, route_scale: float = 1.0,
                 num_shared_experts: int = 0, shared_hidden_dim: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device=None, init_std: float = 0.02,
                 token_padding: int = 1):
        super().__init__()
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        R = dist.get_world_size(group) if group is not None else 1
        self.group = group if R > 1 else None
        self.rank = dist.get_rank(group) if group is not None else 0
        D, E, K = dim, num_experts, top_k
        if E % R:
            raise ValueError(f"num_experts E={E} must be divisible by the EP size R={R}")
        if K > E:
            raise ValueError(f"top-k K={K} > num_experts E={E}")
        if hidden_dim < 1 or D < 1:
            raise ValueError("hidden sizes must be >= 1")
        dev = torch.device(device) if device is not None else torch.device("cpu")
        check_backend_dims(dev.type, dtype, D, hidden_dim)
        if token_padding < 1:
            raise ValueError(f"token_padding must be >= 1, got {token_padding}")
        self.token_padding = token_padding
        B = E // R
        self.D, self.F, self.E, self.K, self.R, self.B = D, hidden_dim, E, K, R, B
        self.router = Router(D, E, K, score_func=score_func, route_norm=route_norm,
                             route_scale=route_scale).to(dev)
        self.w1 = nn.Parameter(torch.randn(B, hidden_dim, D, device=dev).mul_(init_std).to(dtype))
        self.w3 = nn.Parameter(torch.randn(B, hidden_dim, D, device=dev).mul_(init_std).to(dtype))
        self.w2 = nn.Parameter(torch.randn(B, D, hidden_dim, device=dev).mul_(init_std).to(dtype))
        # the grouped GEMM op takes 2*epn groups (home + slots); the baseline has no slots
        self.register_buffer("_no_slots13", torch.zeros(B, hidden_dim, D, dtype=dtype, device=dev),
                             persistent=False)
        self.register_buffer("_no_slots2", torch.zeros(B, D, hidden_dim, dtype=dtype, device=dev),
                             persistent=False)
        self.shared = None
        if num_shared_experts:
            self.shared = SwiGLU(D, num_shared_experts * (shared_hidden_dim or hidden_dim), dtype, dev)
        self.last_recv_rows = 0          # rows this rank's experts received in the last forward
        self.last_sent_remote = 0        # rows this rank sent to other ranks in the last forward

    def experts(self, h: Tensor, cu: Tensor) -> Tensor:
        g = torch.ops.moonep.grouped_mm(h, self.w1, self._no_slots13, cu)
        u = torch.ops.moonep.grouped_mm(h, self.w3, self._no_slots13, cu)
        # the same fused SwiGLU as MoonEP's experts, so that the comparison isolates EP
        return torch.ops.moonep.grouped_mm(torch.ops.moonep.swiglu(g, u), self.w2,
                                           self._no_slots2, cu)

    def forward(self, x_sD: Tensor) -> Tensor:
        s, K, E, R, B = x_sD.shape[0], self.K, self.E, self.R, self.B
        ids_sK, w_sK, _ = self.router(x_sD)
        flat = ids_sK.reshape(-1).long()
        order = torch.sort(flat, stable=True).indices           # by expert = by (rank, expert)
        counts_RB = torch.zeros(E, dtype=torch.long, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat)).view(R, B)
        recv_RB, recv_l, in_splits, out_splits = _exchange_counts(counts_RB, self.group)
        rows = x_sD.index_select(0, order // K)
        h = _a2a(rows, out_splits, in_splits, self.group)
        total = sum(out_splits)
        perm = _chunk_order(recv_RB, total)
        h = h.index_select(0, perm)
        tp = self.token_padding
        per_expert = recv_RB.sum(0)
        padded = (per_expert + tp - 1) // tp * tp if tp > 1 else per_expert
        cu_B = torch.cumsum(padded, 0)
        cu = torch.cat([cu_B, cu_B[-1:].expand(B)]).to(torch.int32)
        if tp > 1:              # each expert's segment padded to tp rows (zero rows)
            rows_pad = sum(-(-sum(r[e] for r in recv_l) // tp) * tp for e in range(B))
            shift = (cu_B - padded) - (torch.cumsum(per_expert, 0) - per_expert)
            at = torch.repeat_interleave(shift, per_expert, output_size=total) + \
                torch.arange(total, device=h.device)
            y = self.experts(h.new_zeros(rows_pad, self.D).index_copy(0, at, h), cu)
            y = y.index_select(0, at)
        else:
            y = self.experts(h, cu)
        back = torch.empty_like(y).index_copy(0, perm, y)       # inverse of the chunk sort
        y_N = _a2a(back, in_splits, out_splits, self.group)
        y_sorted = torch.empty_like(y_N).index_copy(0, order, y_N)   # entry order (t, k)
        y_sKD = y_sorted.view(s, K, -1)
        out = y_sKD[:, 0].float() * w_sK[:, :1]
        for k in range(1, K):                                    # fixed order k = 0..K-1
            out = out + y_sKD[:, k].float() * w_sK[:, k:k + 1]
        out = out.to(x_sD.dtype)
        if self.shared is not None:
            out = out + self.shared(x_sD)
        self._record(recv_l, in_splits)
        return out

    @torch.compiler.disable
    def _record(self, recv_l, in_splits) -> None:
        self.last_recv_rows = sum(map(sum, recv_l))
        self.last_sent_remote = sum(in_splits) - in_splits[self.rank]

    def reduce_router_grad(self) -> None:
        """All-reduce (sum) the replicated router's and shared expert's grads over the group."""
        if self.group is None:
            return
        params = list(self.router.parameters()) + (list(self.shared.parameters()) if self.shared else [])
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)


__all__ = ["AllToAllEPMoE"]
