"""The MoE layer: router -> dispatch -> routed SwiGLU experts -> weights -> combine (+ shared).

Shape legend: s tokens on this rank, D model dim (= the Buffer's H), F expert FFN dim,
E experts, K top-k, R ranks, B = epn = E/R home experts per rank, G = 2*epn segments,
M = nvs_s dispatched rows on this rank.

    ids_sK, w_sK      = router(x_sD)                                   fp32 router
    h_MD, w_M, cu_G   = dispatch(x_sD, ids_sK, w_sK)                   exactly cap rows real
    y_MD              = moonep::moe_experts(h_MD, cu_G, experts_to_copy, w1, w3, w2)
    out_sD            = combine(y_MD * w_M) [+ shared_expert(x_sD)]

Expert weights (nn.Linear layout, [out, in]): w1 (gate) and w3 (up) [B, F, D], w2 (down)
[B, D, F], this rank's home experts only.  Groups 0..B-1 of the grouped GEMMs use them, groups
B..2B-1 use the *redundant slots*: an ``ExpertPool`` of the same three shapes, filled by
``prefetch_weight`` from the owners before the GEMMs.

Memory.  One ExpertPool per (Buffer, D, F, dtype) and process, shared by every layer:
    slot weights  3 * B * D * F * sizeof(dtype)      (bf16: 6*B*D*F bytes)
    slot grads    3 * B * D * F * sizeof(dtype)      (the reduce_grad landing area)
e.g. B=48, D=7168, F=2048: 4.2 GB + 4.2 GB per process whatever the number of layers.  Layers
share the slots, so a layer's backward re-runs prefetch_weight before its dgrad (the slots may
hold a later layer's experts by then), exactly as upstream MoonEP's ExpertPools protocol.

Backward of moe_experts (one op, so the pool never appears in an autograd graph): re-prefetch,
dgrad/wgrad of the three GEMMs, slot weight-grads land in the pool and ``reduce_grad`` adds them
into the owners' local grads in a fixed order (deterministic) and zeroes the consumed slots.
Weight grads are written once in the weights' dtype (``grouped_mm_wgrad_into``: fp32
accumulation in the GEMM, one rounding); reduce_grad sums an expert's local grad and its
replicas' grads in fp32 and rounds once more.  Per weight element that is 2 bytes written
(+ the replicas), against 18 for fp32 zero-fill, fp32 += and a cast to bf16.  The SwiGLU is
one fused kernel each way (moonep_ops/swiglu.py).
The returned weight grads therefore already hold every rank's contribution for this rank's home
experts.  The router is replicated like any data-parallel parameter: all-reduce its grad over
the EP group (the layer's ``reduce_router_grad``) as DDP/FSDP would.

On CUDA the shared expert runs on a side stream, overlapping dispatch, the routed GEMMs and
combine (events only, no host sync; eager mode, torch.compile keeps one stream).
"""
from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from . import grouped_gemm as _gg  # noqa: F401  (registers moonep::grouped_mm*)
from .buffer import Buffer
from .router import Router
from .swiglu import swiglu, swiglu_backward

_POOLS: "weakref.WeakValueDictionary[str, ExpertPool]" = weakref.WeakValueDictionary()
_POOL_IDS = itertools.count()
_POOL_BY_KEY: dict = {}


class ExpertPool:
    """Redundant-expert slots of one process: weights and grad landing area (see module doc)."""

    def __init__(self, buffer: Buffer, D: int, F: int, dtype: torch.dtype):
        B = buffer.epn
        self.buffer_name = buffer.name
        self.D, self.F, self.dtype = D, F, dtype
        # symmetric on the CUDA backend: owners push weights into / pull grads from the slots
        z = buffer.symmetric_zeros
        self.w1 = z((B, F, D), dtype)
        self.w3 = z((B, F, D), dtype)
        self.w2 = z((B, D, F), dtype)
        self.g1 = z((B, F, D), dtype)
        self.g3 = z((B, F, D), dtype)
        self.g2 = z((B, D, F), dtype)
        self.name = f"moonep_pool_{next(_POOL_IDS)}"
        _POOLS[self.name] = self

    @staticmethod
    def shared(buffer: Buffer, D: int, F: int, dtype: torch.dtype) -> "ExpertPool":
        key = (buffer.name, D, F, dtype)
        pool = _POOL_BY_KEY.get(key)
        if pool is None:
            pool = _POOL_BY_KEY[key] = ExpertPool(buffer, D, F, dtype)
        return pool

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.w1, self.w3, self.w2, self.g1, self.g3, self.g2))


def _pool(name: str) -> ExpertPool:
    pool = _POOLS.get(name)
    if pool is None:
        raise ValueError(f"no live ExpertPool named {name!r}")
    return pool


def _prefetch(pool: ExpertPool, etc: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> None:
    torch.ops.moonep.prefetch_weight(etc, [w1.detach(), w3.detach(), w2.detach()],
                                     [pool.w1, pool.w3, pool.w2], pool.buffer_name)


def _check_expert_args(h: Tensor, cu: Tensor, etc: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
                       pool: ExpertPool) -> None:
    B, Fd, D = w1.shape
    if w3.shape != w1.shape or tuple(w2.shape) != (B, D, Fd):
        raise ValueError(f"expert weights must be w1, w3 [B, F, D] and w2 [B, D, F]; got "
                         f"{tuple(w1.shape)}, {tuple(w3.shape)}, {tuple(w2.shape)}")
    if (D, Fd, w1.dtype) != (pool.D, pool.F, pool.dtype):
        raise ValueError(f"weights (D={D}, F={Fd}, {w1.dtype}) do not match the pool "
                         f"(D={pool.D}, F={pool.F}, {pool.dtype})")
    if h.dim() != 2 or h.shape[1] != D or h.dtype != w1.dtype:
        raise ValueError(f"h must be [M, D={D}] {w1.dtype}, got {tuple(h.shape)} {h.dtype}")
    if cu.dtype != torch.int32 or tuple(cu.shape) != (2 * B,):
        raise ValueError(f"cu_seqlens must be int32 [2*epn = {2 * B}]")
    if etc.dtype != torch.int32 or etc.dim() != 2 or etc.shape[1] != B:
        raise ValueError(f"experts_to_copy must be int32 [R, epn={B}]")


# Capturable when the Buffer's backend is (the CUDA symmetric-memory one); the host-reading
# torch.distributed backend raises under capture.
_TAGS = ()


@torch.library.custom_op("moonep::moe_experts", mutates_args=(), tags=_TAGS)
def _moe_experts(h: Tensor, cu_seqlens: Tensor, experts_to_copy: Tensor, w1: Tensor, w3: Tensor,
                 w2: Tensor, pool: str) -> tuple[Tensor, Tensor, Tensor]:
    """SwiGLU over 2*epn groups; stages the redundant slots first.  Returns (y, gate, up)."""
    p = _pool(pool)
    _check_expert_args(h, cu_seqlens, experts_to_copy, w1, w3, w2, p)
    _prefetch(p, experts_to_copy, w1, w3, w2)
    g = torch.ops.moonep.grouped_mm(h, w1, p.w1, cu_seqlens)
    u = torch.ops.moonep.grouped_mm(h, w3, p.w3, cu_seqlens)
    return torch.ops.moonep.grouped_mm(swiglu(g, u), w2, p.w2, cu_seqlens), g, u


@_moe_experts.register_fake
def _(h, cu_seqlens, experts_to_copy, w1, w3, w2, pool):
    M, Fd = h.shape[0], w1.shape[1]
    return h.new_empty(M, w2.shape[1]), h.new_empty(M, Fd), h.new_empty(M, Fd)


@torch.library.custom_op("moonep::moe_experts_backward", mutates_args=(), tags=_TAGS)
def _moe_experts_backward(dy: Tensor, h: Tensor, g: Tensor, u: Tensor, cu_seqlens: Tensor,
                          experts_to_copy: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, pool: str
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dh, dw1, dw3, dw2) for this rank's home experts, every rank's slot grads included."""
    p = _pool(pool)
    _check_expert_args(h, cu_seqlens, experts_to_copy, w1, w3, w2, p)
    _prefetch(p, experts_to_copy, w1, w3, w2)         # slots may hold another layer by now
    cu = cu_seqlens
    dy = dy.contiguous()
    da = torch.ops.moonep.grouped_mm_dgrad(dy, w2, p.w2, cu)
    dg, du, a = swiglu_backward(g, u, da)
    # One bf16 add (fp32 math, one rounding) of the two dgrads.
    dh = torch.ops.moonep.grouped_mm_dgrad(dg, w1, p.w1, cu) \
        + torch.ops.moonep.grouped_mm_dgrad(du, w3, p.w3, cu)
    # Weight grads written once in the weights' dtype (fp32 accumulation inside the GEMM); slot
    # grads land in the shared pool, whose slots are zero outside a backward (reduce_grad
    # re-zeroes what it consumes), so empty slot groups are not rewritten.
    d1, d3, d2 = (torch.empty_like(w) for w in (w1, w3, w2))
    torch.ops.moonep.grouped_mm_wgrad_into(dg, h, cu, d1, p.g1)
    torch.ops.moonep.grouped_mm_wgrad_into(du, h, cu, d3, p.g3)
    torch.ops.moonep.grouped_mm_wgrad_into(dy, a, cu, d2, p.g2)
    torch.ops.moonep.reduce_grad(experts_to_copy, [d1, d3, d2], [p.g1, p.g3, p.g2],
                                 p.buffer_name)
    return dh, d1, d3, d2


@_moe_experts_backward.register_fake
def _(dy, h, g, u, cu_seqlens, experts_to_copy, w1, w3, w2, pool):
    return h.new_empty(h.shape), w1.new_empty(w1.shape), w3.new_empty(w3.shape), \
        w2.new_empty(w2.shape)


def _experts_setup(ctx, inputs, output):
    h, cu, etc, w1, w3, w2, pool = inputs
    _, g, u = output
    ctx.pool = pool
    ctx.save_for_backward(h, g, u, cu, etc, w1, w3, w2)


def _experts_backward(ctx, dy, _dg, _du):
    h, g, u, cu, etc, w1, w3, w2 = ctx.saved_tensors
    dh, d1, d3, d2 = torch.ops.moonep.moe_experts_backward(dy, h, g, u, cu, etc, w1, w3, w2,
                                                           ctx.pool)
    return dh, None, None, d1, d3, d2, None


_moe_experts.register_autograd(_experts_backward, setup_context=_experts_setup)


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
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoonEPMoE(nn.Module):
    """Drop-in MoE layer over a MoonEP ``Buffer`` (see the module docstring)."""

    def __init__(self, buffer: Buffer, hidden_dim: int, *, score_func: str = "softmax",
                 route_norm: bool = False, route_scale: float = 1.0, balance_rate: float = 0.0,
                 num_shared_experts: int = 0, shared_hidden_dim: Optional[int] = None,
                 init_std: float = 0.02, side_stream: bool = True):
        super().__init__()
        if not isinstance(buffer, Buffer):
            raise TypeError("buffer must be a moonep_ops.Buffer")
        D, E, K, R, B = buffer.H, buffer.E, buffer.K, buffer.R, buffer.epn
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
                             balance_group=getattr(buffer.backend, "group", None))
        self.router.to(dev)
        self.w1 = nn.Parameter(torch.randn(B, hidden_dim, D, device=dev).mul_(init_std).to(dt))
        self.w3 = nn.Parameter(torch.randn(B, hidden_dim, D, device=dev).mul_(init_std).to(dt))
        self.w2 = nn.Parameter(torch.randn(B, D, hidden_dim, device=dev).mul_(init_std).to(dt))
        self.pool_name = ExpertPool.shared(buffer, D, hidden_dim, dt).name
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
        group = getattr(self.buffer.backend, "group", None)
        if group is None or not dist.is_initialized():
            return
        params = list(self.router.parameters()) + (list(self.shared.parameters()) if self.shared else [])
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)


def reference_moe(x_TD: Tensor, ids_TK: Tensor, w_TK: Tensor, w1_EFD: Tensor, w3_EFD: Tensor,
                  w2_EDF: Tensor) -> Tensor:
    """Dense single-process reference: y_t = sum_k w_tk * SwiGLU_{e_tk}(x_t) (fp32 math)."""
    x = x_TD.float()
    out = torch.zeros_like(x)
    for k in range(ids_TK.shape[1]):
        e = ids_TK[:, k].long()
        g = torch.einsum("td,tfd->tf", x, w1_EFD[e].float())
        u = torch.einsum("td,tfd->tf", x, w3_EFD[e].float())
        y = torch.einsum("tf,tdf->td", F.silu(g) * u, w2_EDF[e].float())
        out = out + w_TK[:, k:k + 1].float() * y
    return out
