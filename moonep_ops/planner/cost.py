"""Policy "cost": caps with slack, moves chosen by a predicted cost (docs/planner.md, "Policy
cost", which has the proof and the table).

Every rank may receive up to U = slack_cap(ceil(T/R)) copies.  Candidates:
  MoonEP        MoonEP's own plan (exact caps);
  level L       for L in [ceil(T/R), min(U, max group)]: ranks above L (donors) shed their
                excess group - L, each round the donor with the most excess left refilling
                one receiver that no donor used yet -- the smallest spare L - group that covers
                the excess, else the largest -- by min(excess, spare); then MoonEP's step 2
                splits each donor's quotas into expert chunks.  A level whose excess does not
                fit is infeasible (never chosen).  L = max group moves nothing.
Score (int64, in token copies): max_r load_r + replica_cost * max_r links_r, links_r =
max(replicas of r's experts on other ranks, slots on r): the slowest rank's grouped-GEMM time
(linear in its copies) plus the weights and grads on the busiest link, both in units of one
copy's GEMM time.  Search: COST_LEVELS levels evenly over the range, all independent of each
other (so the device planner runs every level's quotas at once, during MoonEP's own step 1);
the lowest score wins, ties to the earliest candidate (MoonEP first).  Fixed trip counts,
masked updates, no host reads.  Shape letter V: the candidate plans (architecture.md).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .greedy import rank_quotas, split_quotas_batched

COST_LEVELS = 16       # candidate levels of the search (docs/planner.md, "Search")
_INFEASIBLE = 1 << 62  # score of a level whose excess does not fit


def level_quotas(group_R: Tensor, level_V: Tensor) -> tuple[Tensor, Tensor]:
    """Step 1 of the level plans, for V levels at once ([V] int64).  Returns (z [V, R, R],
    feasible [V]).  Each receiver is refilled by one donor only (it retires after one round),
    so every column of z has at most one non-zero."""
    V, R = level_V.numel(), group_R.numel()
    dev = group_R.device
    g = group_R[None, :]
    L = level_V[:, None]
    excess = (g - L).clamp(min=0)                                   # [V, R] donors
    spare = (L - g).clamp(min=0)                                    # [V, R] receivers
    free = spare > 0
    z = torch.zeros(V * R * R, dtype=group_R.dtype, device=dev)
    row0_V = torch.arange(V, device=dev) * R            # candidate v's first row of [V * R]
    r_ids = torch.arange(R, device=dev)
    big = torch.full_like(spare, _INFEASIBLE)
    none = torch.full_like(spare, -1)
    # Each round with excess left retires one receiver, and there are at most R-1 of them.
    for _ in range(R - 1):
        h = torch.argmax(excess, dim=1)                             # most excess, ties: lowest
        eh = excess.gather(1, h[:, None]).squeeze(1)
        fits = free & (spare >= eh[:, None])
        best_fit = torch.argmin(torch.where(fits, spare, big), dim=1)
        largest = torch.argmax(torch.where(free, spare, none), dim=1)
        u = torch.where(fits.any(1), best_fit, largest)
        su = torch.where(free.gather(1, u[:, None]).squeeze(1),
                         spare.gather(1, u[:, None]).squeeze(1), torch.zeros_like(eh))
        m = torch.minimum(eh, su)                                   # 0 once done (or stuck)
        z.index_add_(0, (row0_V + h) * R + u, m)
        excess.view(-1).index_add_(0, row0_V + h, -m)
        free = free & ~((r_ids[None, :] == u[:, None]) & (m > 0)[:, None])   # u retires
    return z.view(V, R, R), excess.sum(1) == 0


def plan_links(alloc_VER: Tensor) -> Tensor:
    """[V, R] max(replicas of rank r's experts on other ranks, redundant slots on r)."""
    V, E, R = alloc_VER.shape
    B = E // R
    dev = alloc_VER.device
    home = (torch.arange(E, device=dev) // B)[:, None] != torch.arange(R, device=dev)[None, :]
    away_VER = ((alloc_VER > 0) & home[None]).long()
    out_VR = away_VER.view(V, R, B * R).sum(2)
    in_VR = away_VER.sum(1)
    return torch.maximum(out_VR, in_VR)


def plan_scores(alloc_VER: Tensor, replica_cost: int) -> Tensor:
    """[V] predicted cost in token copies: max_r load_r + replica_cost * max_r links_r."""
    return alloc_VER.sum(1).amax(1) + replica_cost * plan_links(alloc_VER).amax(1)


def cost_plan(cnt_E: Tensor, caps_R: Tensor, even: int, limit: int, replica_cost: int,
              levels: int = COST_LEVELS) -> tuple[Tensor, Tensor]:
    """Policy "cost": (z [R, R], alloc [E, R]) of the best candidate (the module docstring).
    ``even`` = ceil(T/R), ``limit`` = U >= even, ``replica_cost`` >= 0 in token copies."""
    R = caps_R.numel()
    group_R = cnt_E.view(R, -1).sum(1)
    z0 = rank_quotas(group_R - caps_R, "max")                       # MoonEP's own plan
    hi = group_R.amax().clamp(min=even, max=limit).view(1)   # above the max group nothing moves
    k = torch.arange(levels, device=cnt_E.device)
    span = max(levels - 1, 1)
    lv = even + ((hi - even) * k + span - 1) // span           # [levels]: even .. hi
    z_lv, ok = level_quotas(group_R, lv)
    z = torch.cat([z0[None], z_lv])                            # MoonEP first: it wins ties
    alloc = split_quotas_batched(cnt_E, z)
    score = plan_scores(alloc, replica_cost)
    score = torch.where(torch.cat([ok.new_ones(1), ok]), score, torch.full_like(score, _INFEASIBLE))
    best = torch.argmin(score).view(1)                         # first minimum
    return z.index_select(0, best).squeeze(0), alloc.index_select(0, best).squeeze(0)
