"""Token router with Quantile Balancing.

Shape legend: T tokens (= s on one rank), D model dim, E routed experts, K top-k.

    scores_TE   = softmax(x_TD @ W_router^T) or sigmoid(...)            (fp32)
    topk_ids_TK = topk(scores_TE + bias_E, K)        -- the bias steers *selection* only
    weights_TK  = scores_TE.gather(topk_ids_TK) [/ sum, if renormalised] * route_scale

Quantile Balancing (QB, the router half of Kimi K3's balancing; MoonEP is the system half).
Token t picks expert e iff its biased score clears the token's threshold
tau_t = (K-th + (K+1)-th largest biased score of t) / 2.  With margins
m_te = scores_te + bias_e - tau_t, expert e's load is #{t : m_te > 0}; shifting bias_e by the
(1 - K/E) quantile q_e of its margins would give it exactly its share T*K/E if the thresholds
stood still.  QB takes a damped step towards that after each training step (quantiles averaged
over a process group when one is given, so every rank keeps the same bias):

    bias_E <- bias_E - rate * (q_E - mean(q_E))

No gradient flows through the bias and the route weights never see it: balancing changes
which experts are chosen, not how their outputs are weighted.  QB is statistical, not exact per
micro-batch; MoonEP still guarantees exact per-rank loads, and with QB the planner has less to
move (tests/test_router.py shows maxvio and redundant experts falling over steps).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 route_norm: bool = False, route_scale: float = 1.0,
                 balance_rate: float = 0.0, balance_group: Optional[dist.ProcessGroup] = None):
        super().__init__()
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} > num_experts={num_experts}")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if not 0.0 <= balance_rate <= 1.0:
            raise ValueError(f"balance_rate must lie in [0, 1], got {balance_rate}")
        self.E, self.K = num_experts, top_k
        self.score_func, self.route_norm, self.route_scale = score_func, route_norm, route_scale
        self.balance_rate = balance_rate
        self.balance_group = balance_group
        self.gate = nn.Linear(dim, num_experts, bias=False, dtype=torch.float32)
        # Selection bias (Quantile Balancing).  A buffer: saved with the model, never trained.
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))

    def scores(self, x_TD: Tensor) -> Tensor:
        logits_TE = self.gate(x_TD.float())
        if self.score_func == "softmax":
            return torch.softmax(logits_TE, dim=-1)
        return torch.sigmoid(logits_TE)

    def forward(self, x_TD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (topk_ids_TK int32, weights_TK fp32, scores_TE fp32)."""
        scores_TE = self.scores(x_TD)
        topk_ids_TK = torch.topk(scores_TE.detach() + self.expert_bias, self.K, dim=-1).indices
        weights_TK = scores_TE.gather(1, topk_ids_TK)
        if self.route_norm:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True).clamp_min(1e-20)
        return topk_ids_TK.to(torch.int32), weights_TK * self.route_scale, scores_TE

    @torch.no_grad()
    def update_balance(self, scores_TE: Tensor) -> None:
        """One Quantile-Balancing step from this step's router scores (call after backward)."""
        if self.balance_rate == 0.0:
            return
        biased_TE = scores_TE.detach().float() + self.expert_bias
        kth = torch.topk(biased_TE, min(self.K + 1, self.E), dim=-1).values
        tau_T = kth[:, self.K - 1] if self.K == self.E else (kth[:, self.K - 1] + kth[:, self.K]) / 2
        q_E = torch.quantile(biased_TE - tau_T[:, None], 1.0 - self.K / self.E, dim=0)
        if self.balance_group is not None and dist.is_initialized():
            dist.all_reduce(q_E, group=self.balance_group)
            q_E /= dist.get_world_size(self.balance_group)
        self.expert_bias -= self.balance_rate * (q_E - q_E.mean())


__all__ = ["Router"]
