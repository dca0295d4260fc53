"""Helpers for tests, benchmarks and the apps; the library never imports this package.

Here: synthetic routings, a skewed router, the dense single-process reference MoE.  Submodules:

  virtual_ranks    VirtualGroup (R ranks of the CUDA backend on one GPU), its primes, run_threads
  baseline         AllToAllEPMoE, plain all-to-all EP (the main job's comparison)
  train_step       a training step that compiles as one graph (sgd_step)
  torchtitan_cpu   shims that let torchtitan 0.3.0 run on a CPU-only torch over gloo

Routings are seeded, on the CPU, int32 [s, K] per rank.  Imbalance is reported as
maxvio = max_e T_e / mean_e T_e - 1 on the global per-expert counts (0: perfectly balanced;
k: the hottest expert receives (k+1)x the balanced load).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor
from torch.nn.functional import silu

from ..nn.router import Router

KINDS = ("uniform", "balanced", "zipf", "hot", "one_expert", "all_remote", "all_local",
         "duplicates", "one_group", "random_sparse")


def maxvio(tpe_RE: Tensor) -> float:
    cnt = tpe_RE.sum(0).double()
    return float(cnt.max() / cnt.mean() - 1) if cnt.sum() > 0 else 0.0


def _sample_without_replacement(probs_E: Tensor, s: int, K: int, g: torch.Generator) -> Tensor:
    # Gumbel top-k = sampling K distinct experts per token proportionally to probs.
    E = probs_E.numel()
    gumbel = -torch.log(-torch.log(torch.rand(s, E, generator=g).clamp_(1e-20, 1.0)))
    return torch.topk(torch.log(probs_E.clamp_min(1e-30))[None, :] + gumbel, K, dim=1).indices


def make_routing(kind: str, R: int, E: int, s: int | Sequence[int], K: int, *, seed: int = 0,
                 alpha: float = 1.0, hot_factor: float = 2.0) -> list[Tensor]:
    """Top-k ids of every rank.  s may be one int or a per-rank list.

    uniform: distinct experts drawn uniformly;  balanced: exact round-robin, every expert
    equal;  zipf: p_e ~ 1/(rank_e+1)^alpha over a seeded permutation;  hot: one expert gets
    hot_factor x the average load, the rest uniform;  one_expert: every entry -> expert 0
    (duplicates inside tokens);  all_remote / all_local: every entry to the next / own rank's
    home experts;  duplicates: tokens repeat one expert K times;  one_group: everything to rank
    0's home experts;  random_sparse: a random few experts carry all tokens.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown routing kind {kind!r}; choose from {KINDS}")
    sizes = [s] * R if isinstance(s, int) else list(s)
    g = torch.Generator().manual_seed(seed)
    B = E // R
    perm = torch.randperm(E, generator=g)
    out = []
    for r in range(R):
        n = sizes[r]
        t = torch.arange(n)[:, None]
        k = torch.arange(K)[None, :]
        if kind == "uniform":
            ids = _sample_without_replacement(torch.ones(E), n, min(K, E), g) if K <= E else \
                torch.randint(0, E, (n, K), generator=g)
        elif kind == "balanced":
            ids = (t * K + k + r * n * K) % E
        elif kind == "zipf":
            p = torch.empty(E)
            p[perm] = 1.0 / (torch.arange(E, dtype=torch.float64) + 1).pow(alpha).float()
            ids = _sample_without_replacement(p, n, K, g) if K <= E else \
                torch.multinomial(p, n * K, replacement=True, generator=g).view(n, K)
        elif kind == "hot":
            # hot expert probability so that its expected load is hot_factor x the mean
            hot = int(perm[0])
            frac = min(1.0, hot_factor / E)
            ids = torch.randint(0, max(E - 1, 1), (n, K), generator=g)
            ids = (ids + (ids >= hot).long()) % E                 # uniform over the others
            pick = torch.rand(n, K, generator=g) < frac
            ids = torch.where(pick, torch.full_like(ids, hot), ids)
        elif kind == "one_expert":
            ids = torch.zeros(n, K, dtype=torch.long)
        elif kind == "all_remote":
            ids = ((r + 1) % R) * B + (t + k) % B
        elif kind == "all_local":
            ids = r * B + (t + k) % B
        elif kind == "duplicates":
            ids = torch.randint(0, E, (n, 1), generator=g).expand(n, K)
        elif kind == "one_group":
            ids = (t * K + k) % B
        else:  # random_sparse
            few = perm[: max(1, E // 16)]
            ids = few[torch.randint(0, few.numel(), (n, K), generator=g)]
        out.append(ids.to(torch.int32).contiguous())
    return out


def histogram(topk_per_rank: Sequence[Tensor], E: int) -> Tensor:
    return torch.stack([torch.bincount(t.reshape(-1).long(), minlength=E)
                        for t in topk_per_rank]).to(torch.int32)


def make_hist_rx(tpe_RE: Tensor, s_per_rank, total_num_tokens: Optional[int] = None,
                 bad_flags=None) -> Tensor:
    """The [R, E+3] gathered rows the device planner reads (histogram, bad flag, s, total) from
    an [R, E] histogram, on its device."""
    R = tpe_RE.shape[0]
    sizes = [s_per_rank] * R if isinstance(s_per_rank, int) else list(s_per_rank)
    tot = -1 if total_num_tokens is None else total_num_tokens
    bad = [0] * R if bad_flags is None else list(bad_flags)
    meta = torch.tensor([[bad[r], sizes[r], tot] for r in range(R)], dtype=torch.int32)
    return torch.cat([tpe_RE.to(torch.int32).cpu(), meta], dim=1).contiguous().to(tpe_RE.device)


def routing_for_maxvio(target: float, R: int, E: int, s: int, K: int, *, seed: int = 0,
                       tol: Optional[float] = None) -> list[Tensor]:
    """A 'hot' routing whose measured maxvio is close to target (bisection on the hot factor)."""
    if target <= 0:
        return make_routing("balanced", R, E, s, K, seed=seed)
    tol = tol if tol is not None else max(0.05 * target, 0.05)
    lo, hi = 1.0, float(E)
    best = None
    for _ in range(30):
        mid = (lo + hi) / 2
        tk = make_routing("hot", R, E, s, K, seed=seed, hot_factor=mid)
        mv = maxvio(histogram(tk, E))
        if best is None or abs(mv - target) < abs(best[0] - target):
            best = (mv, tk)
        if abs(mv - target) <= tol:
            break
        lo, hi = (mid, hi) if mv < target else (lo, mid)
    return best[1]


def skewed_router(dim: int, num_experts: int, top_k: int, balance_rate: float, seed: int = 0
                  ) -> tuple[Router, Tensor]:
    """A synthetic skewed router (tests, benchmarks): its gate has a rank-one component aligned
    with the input mean, so later experts win most tokens.  Returns (router, input mean)."""
    torch.manual_seed(seed)
    router = Router(dim, num_experts, top_k, balance_rate=balance_rate)
    mu = torch.randn(dim) * 0.5
    with torch.no_grad():
        router.gate.weight.normal_(0, 0.3)
        router.gate.weight += torch.outer(torch.linspace(-1, 1, num_experts) * 2,
                                          mu / mu.norm() ** 2)
    return router, mu


def load_per_expert(topk_ids_TK: Tensor, num_experts: int) -> Tensor:
    return torch.bincount(topk_ids_TK.reshape(-1).long(), minlength=num_experts)


def maxvio_of(loads_E: Tensor) -> float:
    loads = loads_E.double()
    return float(loads.max() / loads.mean() - 1)


def reference_moe(x_TD: Tensor, ids_TK: Tensor, w_TK: Tensor, w1_EFD: Tensor, w3_EFD: Tensor,
                  w2_EDF: Tensor) -> Tensor:
    """Dense single-process reference: y_t = sum_k w_tk * SwiGLU_{e_tk}(x_t) (fp32 math)."""
    x = x_TD.float()
    out = torch.zeros_like(x)
    for k in range(ids_TK.shape[1]):
        e = ids_TK[:, k].long()
        g = torch.einsum("td,tfd->tf", x, w1_EFD[e].float())
        u = torch.einsum("td,tfd->tf", x, w3_EFD[e].float())
        y = torch.einsum("tf,tdf->td", silu(g) * u, w2_EDF[e].float())
        out = out + w_TK[:, k:k + 1].float() * y
    return out
