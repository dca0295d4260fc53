"""Token routers: the contract every router meets, and the built-in top-k router.

The router contract (what ``MoonEPMoE`` calls; any ``nn.Module`` that meets it can be passed as
``MoonEPMoE(..., router=...)``)::

    topk_ids_sK, topk_weights_sK, router_logits_sE = router(x_sD)

  x_sD              [s, D] this rank's tokens, the layer's dtype
  topk_ids_sK       [s, K] int32 expert ids in [0, E); a token may name an expert twice
  topk_weights_sK   [s, K] float32 weights the experts' outputs are multiplied by
  router_logits_sE  [s, E] the pre-activation scores (any float dtype); the layer keeps them for
                    auxiliary losses and Quantile Balancing and never differentiates through the
                    ids.  Gradients flow to the router through topk_weights_sK (and the logits).

The built-in ``Router`` computes, in this order (each step an option, so that it reproduces the
routers of DeepSeek-V3, Qwen2/Qwen3-MoE, Mixtral, OLMoE and gpt-oss op for op):

    logits_sE  = x_sD @ gate^T (+ gate bias)          in the gate's dtype (``router_dtype``)
    top-k after scoring (default):
        scores_sE = softmax(logits.float()) | sigmoid(logits.float())
        choice_sE = scores_sE + expert_bias_E          the bias steers selection only
        group-limited (num_expert_groups > 1, DeepSeek-V3): keep the num_limited_groups groups
            with the largest sum of their top-2 choice scores, -inf elsewhere
        ids_sK    = topk(choice_sE, K)
        w_sK      = scores_sE.gather(ids_sK)           unbiased scores
    top-k before scoring (``topk_before_score``, gpt-oss): ids, v = topk(logits, K), w = softmax(v)
    w_sK = w_sK / (w_sK.sum(-1) + route_norm_eps)      if route_norm
    w_sK = w_sK * route_scale
    w_sK = w_sK rounded to the logits' dtype           if round_weights (Qwen, OLMoE in bf16)

Quantile Balancing (QB, the router half of Kimi K3's balancing; MoonEP is the system half).
Token t picks expert e iff its biased score clears the token's threshold
tau_t = (K-th + (K+1)-th largest biased score of t) / 2.  With margins m_te = scores_te + bias_e
- tau_t, expert e's load is #{t : m_te > 0}; shifting bias_e by the (1 - K/E) quantile q_e of
its margins would give it exactly its share s*K/E if the thresholds stood still.  QB takes a
damped step towards that after each training step, the quantiles averaged over the EP group so
every rank keeps the same bias:  bias_E <- bias_E - rate * (q_E - mean(q_E)).
Tokens whose scores are not finite are left out of the step (counted in ``nonfinite_tokens``,
warned about once), and a step that would make the bias non-finite is skipped: one NaN batch
cannot poison the routing of every later batch.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.functional import linear

SCORE_FUNCS = ("softmax", "sigmoid")


class Router(nn.Module):
    """The built-in top-k router (see the module docstring for the math and the contract).

    Args:
      dim: model dim D.
      num_experts: E.
      top_k: K (<= E).
      score_func: ``"softmax"`` or ``"sigmoid"``.
      topk_before_score: top-k on the logits, then softmax over the K (gpt-oss); softmax only,
        no groups, no expert bias.
      route_norm: renormalise the K weights to sum 1 (HF ``norm_topk_prob``).
      route_norm_eps: added to the renormalisation's denominator (DeepSeek-V3: 1e-20).
      route_scale: factor on the final weights (DeepSeek-V3 ``routed_scaling_factor``).
      num_expert_groups, num_limited_groups: group-limited top-k (DeepSeek-V3 ``n_group``,
        ``topk_group``): E is split into num_expert_groups = H groups and each token picks its K
        experts from the num_limited_groups groups with the largest top-2 score sum.
      sorted_topk: the ``sorted`` flag of the top-k calls (DeepSeek-V3 uses False; the set of ids
        is the same, their order differs).
      router_dtype: dtype of the gate weight and of the logits matmul (the input is cast to it):
        float32 (default) or None for the layer's dtype (Qwen, Mixtral, OLMoE compute bf16 logits
        in bf16 models).
      round_weights: round the final weights to the logits' dtype (Qwen, OLMoE).
      gate_bias: give the gate linear layer a bias (gpt-oss).
      balance_rate: Quantile-Balancing step size in [0, 1] (0: off).
      balance_group: process group whose ranks average the QB quantiles (None: no averaging).
      dtype: the layer's dtype (used when ``router_dtype`` is None).
    Buffers: ``expert_bias [E]`` fp32 (selection bias: QB, DeepSeek's e_score_correction_bias;
    saved with the model, never trained).
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 topk_before_score: bool = False, route_norm: bool = False,
                 route_norm_eps: float = 0.0, route_scale: float = 1.0,
                 num_expert_groups: int = 1, num_limited_groups: int = 1,
                 sorted_topk: bool = True, router_dtype: Optional[torch.dtype] = torch.float32,
                 round_weights: bool = False, gate_bias: bool = False,
                 balance_rate: float = 0.0, balance_group: Optional[dist.ProcessGroup] = None,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        E, K = num_experts, top_k
        if not 1 <= K <= E:
            raise ValueError(f"top_k={K} must lie in [1, num_experts={E}]")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if not 0.0 <= balance_rate <= 1.0:
            raise ValueError(f"balance_rate must lie in [0, 1], got {balance_rate}")
        H, Hk = num_expert_groups, num_limited_groups
        if H < 1 or not 1 <= Hk <= H:
            raise ValueError(f"need 1 <= num_limited_groups={Hk} <= num_expert_groups={H}")
        if H > 1 and (E % H or E // H < 2):
            raise ValueError(f"num_experts={E} must split into num_expert_groups={H} groups of at "
                             "least 2 experts")
        if H > 1 and Hk * (E // H) < K:
            raise ValueError(f"the {Hk} kept groups of {E // H} experts hold fewer than top_k={K}")
        if topk_before_score and (score_func != "softmax" or H > 1):
            raise ValueError("topk_before_score is defined for softmax scores without expert groups")
        self.E, self.K = E, K
        self.score_func, self.topk_before_score = score_func, topk_before_score
        self.route_norm, self.route_norm_eps, self.route_scale = route_norm, route_norm_eps, route_scale
        self.num_expert_groups, self.num_limited_groups = H, Hk
        self.sorted_topk, self.round_weights = sorted_topk, round_weights
        self.balance_rate, self.balance_group = balance_rate, balance_group
        self.gate = nn.Linear(dim, E, bias=gate_bias, device=device,
                              dtype=router_dtype if router_dtype is not None else dtype)
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32, device=device))
        self.nonfinite_tokens = 0          # tokens QB left out for non-finite scores, so far
        self._warned = False

    # -- routing ------------------------------------------------------------------------------
    def logits(self, x_sD: Tensor) -> Tensor:
        w = self.gate.weight
        return linear(x_sD.to(w.dtype), w, self.gate.bias)

    def scores(self, logits_sE: Tensor) -> Tensor:
        """fp32 scores (softmax or sigmoid) of the logits."""
        if self.score_func == "softmax":
            return torch.softmax(logits_sE.float(), dim=-1)
        return torch.sigmoid(logits_sE.float())

    def forward(self, x_sD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(topk_ids_sK int32, topk_weights_sK fp32, router_logits_sE)."""
        K = self.K
        logits_sE = self.logits(x_sD)
        if self.topk_before_score:
            vals_sK, ids_sK = torch.topk(logits_sE, K, dim=-1, sorted=self.sorted_topk)
            w_sK = torch.softmax(vals_sK.float(), dim=-1)
        else:
            scores_sE = self.scores(logits_sE)
            choice_sE = scores_sE.detach() + self.expert_bias
            if self.num_expert_groups > 1:
                choice_sE = self._limit_groups(choice_sE)
            ids_sK = torch.topk(choice_sE, K, dim=-1, sorted=self.sorted_topk).indices
            w_sK = scores_sE.gather(1, ids_sK)
        if self.route_norm:
            denom = w_sK.sum(dim=-1, keepdim=True)
            w_sK = w_sK / (denom + self.route_norm_eps if self.route_norm_eps else denom)
        if self.route_scale != 1.0:
            w_sK = w_sK * self.route_scale
        if self.round_weights:
            w_sK = w_sK.to(logits_sE.dtype).float()
        return ids_sK.to(torch.int32), w_sK, logits_sE

    def _limit_groups(self, choice_sE: Tensor) -> Tensor:
        H, E = self.num_expert_groups, self.E
        group_sH = choice_sE.view(-1, H, E // H).topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.topk(group_sH, self.num_limited_groups, dim=-1, sorted=self.sorted_topk)[1]
        mask_sH = torch.zeros_like(group_sH).scatter_(1, keep, 1.0)
        mask_sE = mask_sH.unsqueeze(-1).expand(-1, H, E // H).reshape(-1, E)
        return choice_sE.masked_fill(mask_sE == 0, float("-inf"))

    # -- Quantile Balancing --------------------------------------------------------------------
    @torch.no_grad()
    def update_balance(self, scores_sE: Tensor) -> None:
        """One Quantile-Balancing step from this step's router scores (call after backward)."""
        if self.balance_rate == 0.0 or self.topk_before_score:
            return
        biased_sE = scores_sE.detach().float() + self.expert_bias
        finite_s = torch.isfinite(biased_sE).all(dim=1)
        n_bad = int((~finite_s).sum())          # a host read: QB runs once per step, eagerly
        if n_bad:
            self.nonfinite_tokens += n_bad
            if not self._warned:
                self._warned = True
                warnings.warn(f"moonep Router: {n_bad} token(s) with non-finite router scores were "
                              "left out of the Quantile-Balancing step (counted in "
                              "Router.nonfinite_tokens; warned once)", RuntimeWarning,
                              stacklevel=2)
            biased_sE = biased_sE[finite_s]
        K, E = self.K, self.E
        if biased_sE.shape[0] == 0:
            q_E = torch.zeros(E, dtype=torch.float32, device=scores_sE.device)
            valid = torch.zeros((), dtype=torch.float32, device=scores_sE.device)
        else:
            kth = torch.topk(biased_sE, min(K + 1, E), dim=-1).values
            tau_s = kth[:, K - 1] if K == E else (kth[:, K - 1] + kth[:, K]) / 2
            q_E = torch.quantile(biased_sE - tau_s[:, None], 1.0 - K / E, dim=0)
            valid = torch.ones((), dtype=torch.float32, device=scores_sE.device)
        group = self.balance_group
        if group is not None and dist.is_initialized():
            # Ranks with no finite token contribute nothing: average over the ranks that have.
            both = torch.cat([q_E * valid, valid.view(1)])
            dist.all_reduce(both, group=group)
            q_E, valid = both[:E] / both[E].clamp_min(1.0), both[E]
        if float(valid) == 0.0:
            return
        step_E = self.balance_rate * (q_E - q_E.mean())
        if bool(torch.isfinite(step_E).all()):
            self.expert_bias -= step_E


__all__ = ["Router", "SCORE_FUNCS"]
