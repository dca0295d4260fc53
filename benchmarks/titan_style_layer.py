"""A torchtitan-style MoE layer on one device: the reference MoonEP's R = 1 layer is timed against.

What "torchtitan-style" means here (the layer most eager training code runs; written for this
benchmark from a description of torchtitan's MoE, not copied from it):

    logits_sE      = x_sD @ gate^T                         (the gate in ``router_dtype``)
    scores_sE      = softmax(fp32(logits_sE))
    w_sK, ids_sK   = topk(scores_sE, K)                     (optionally renormalised)
    counts_E       = histogram of ids_sK                    (scatter_add of ones: fixed size)
    offs_E         = cumsum(counts_E)                       int32, torch._grouped_mm's ``offs``
    order_N        = argsort(ids_sK.flatten(), stable)      token copies grouped by expert
    tok_N          = order_N // K                           the token of each copy
    h_ND           = x_sD[tok_N]
    y_ND           = _grouped_mm(silu(_grouped_mm(h, w1^T)) * _grouped_mm(h, w3^T), w2^T)
    out_sD         = shared(x_sD).index_add_(0, tok_N, bf16(fp32(y_ND) * w_sK.flatten()[order_N]))

No padding rows, no capacity, no expert parallelism: every row of h is a real token copy.  The
weights use MoonEPMoE's layout (w1, w3 [E, F, D], w2 [E, D, F], the nn.Linear layout), so
``copy_from`` takes a one-rank MoonEPMoE's weights as they are and both layers route every
token to the same experts.

Usable on CPU (torch._grouped_mm has a CPU path) for the smoke test; the numbers that matter are
taken on the GPU (benchmarks/bench_layer_r1.py, benchmarks/bench_host_cost.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn.functional import linear, silu


class TitanStyleMoE(nn.Module):
    """Softmax top-k router, argsort permutation, torch._grouped_mm experts (gate / up / down),
    a weighted ``index_add_`` un-permute and an optional shared SwiGLU expert.

    Args:
      dim, hidden_dim: D and the experts' F.
      num_experts, top_k: E and K.
      shared_hidden_dim: width of the shared expert (0: none).
      route_norm: renormalise the K weights to sum 1.
      router_dtype: the gate's dtype (None: ``dtype``).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, *,
                 shared_hidden_dim: int = 0, route_norm: bool = False,
                 router_dtype: Optional[torch.dtype] = None, dtype: torch.dtype = torch.bfloat16,
                 device=None, init_std: float = 0.02):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
        self.dim, self.hidden_dim, self.E, self.K = dim, hidden_dim, num_experts, top_k
        self.route_norm = route_norm
        kw = dict(dtype=dtype, device=device)
        self.gate = nn.Linear(dim, num_experts, bias=False, device=device,
                              dtype=router_dtype if router_dtype is not None else dtype)
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim, **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim, **kw))
        self.shared = None
        if shared_hidden_dim:
            self.shared = nn.ModuleDict({
                "w1": nn.Linear(dim, shared_hidden_dim, bias=False, **kw),
                "w3": nn.Linear(dim, shared_hidden_dim, bias=False, **kw),
                "w2": nn.Linear(shared_hidden_dim, dim, bias=False, **kw)})
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, init_std)

    # -- the pieces (timed one by one in bench_host_cost.py) ------------------------------------
    def route(self, x_sD: Tensor) -> tuple[Tensor, Tensor]:
        """(w_sK fp32, ids_sK int64)."""
        logits = linear(x_sD.to(self.gate.weight.dtype), self.gate.weight)
        scores = torch.softmax(logits.float(), dim=-1)
        w_sK, ids_sK = torch.topk(scores, self.K, dim=-1)
        if self.route_norm:
            w_sK = w_sK / w_sK.sum(dim=-1, keepdim=True)
        return w_sK, ids_sK

    def permute(self, x_sD: Tensor, w_sK: Tensor, ids_sK: Tensor
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(h_ND, w_N fp32, tok_N, offs_E int32): the token copies grouped by expert."""
        flat = ids_sK.reshape(-1)
        counts = torch.zeros(self.E, dtype=torch.int32, device=x_sD.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        order = torch.argsort(flat, stable=True)
        tok = order // self.K
        return x_sD[tok], w_sK.reshape(-1)[order], tok, offs

    def experts(self, h_ND: Tensor, offs: Tensor) -> Tensor:
        g = torch._grouped_mm(h_ND, self.w1.transpose(-2, -1), offs=offs)
        u = torch._grouped_mm(h_ND, self.w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(silu(g) * u, self.w2.transpose(-2, -1), offs=offs)

    def shared_out(self, x_sD: Tensor) -> Tensor:
        s = self.shared
        return s["w2"](silu(s["w1"](x_sD)) * s["w3"](x_sD))

    def unpermute(self, y_ND: Tensor, w_N: Tensor, tok_N: Tensor, out_sD: Tensor) -> Tensor:
        """out_sD += the weighted expert rows of every token (in place on ``out_sD``)."""
        return out_sD.index_add_(0, tok_N, (y_ND.float() * w_N[:, None]).to(out_sD.dtype))

    def forward(self, x: Tensor) -> Tensor:
        x_sD = x.reshape(-1, self.dim)
        w_sK, ids_sK = self.route(x_sD)
        h, w_N, tok, offs = self.permute(x_sD, w_sK, ids_sK)
        y = self.experts(h, offs)
        out = self.shared_out(x_sD) if self.shared is not None else torch.zeros_like(x_sD)
        return self.unpermute(y, w_N, tok, out).view(x.shape)

    # -- weights --------------------------------------------------------------------------------
    @torch.no_grad()
    def copy_from(self, layer) -> "TitanStyleMoE":
        """Take a one-rank ``MoonEPMoE``'s gate, experts and shared expert (same routing)."""
        if layer.num_local_experts != self.E:
            raise ValueError(f"the MoonEPMoE holds {layer.num_local_experts} experts, not all "
                             f"{self.E} (copy from a layer bound at R = 1)")
        self.gate.weight.copy_(layer.router.gate.weight)
        for n in ("w1", "w3", "w2"):
            getattr(self, n).copy_(getattr(layer, n))
        if (self.shared is None) != (layer.shared is None):
            raise ValueError("one layer has a shared expert, the other none")
        if self.shared is not None:
            for n in ("w1", "w3", "w2"):
                self.shared[n].weight.copy_(getattr(layer.shared, n).weight)
        return self


__all__ = ["TitanStyleMoE"]
