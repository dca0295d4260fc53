"""Steps 1-2 of the planner: the allocation alloc[e, d] (tokens of expert e computed on rank d)
by MoonEP's greedy rules, and policy "lean" (docs/planner.md, "Algorithm", "Policy lean").

Every loop has a fixed trip count over R or B with masked updates, so the same code runs on
CUDA tensors without a host sync and under capture.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _first_min_where(values: Tensor, ok: Tensor, dim: int = -1) -> Tensor:
    """argmin of values over entries where ok (ties -> lowest index); garbage where none is ok."""
    big = torch.iinfo(values.dtype).max
    return torch.argmin(torch.where(ok, values, torch.full_like(values, big)), dim=dim)


def rank_quotas(balance_R: Tensor, donor_rule: str) -> Tensor:
    """Step 1.  balance = group - cap (sums to 0).  Returns z[h, d] >= 0, at most one non-zero
    per column (each receiver is refilled completely by a single donor).
    donor_rule: "max" (MoonEP: largest surplus) or "fit" (smallest surplus >= the deficit)."""
    R = balance_R.numel()
    bal = balance_R.clone()
    z_RR = torch.zeros(R, R, dtype=bal.dtype, device=bal.device)
    # At most R-1 rounds: each retires one receiver for good, and the last donor is never one.
    for _ in range(R - 1):
        # [1]-shaped indices and gather/index_add only: indexing with a 0-d tensor is an .item()
        # (a host sync on CUDA).
        u = torch.argmin(bal).view(1)              # largest deficit, ties -> lowest rank
        need = -bal.gather(0, u)
        if donor_rule == "max":
            h = torch.argmax(bal).view(1)          # largest surplus, ties -> lowest rank
        else:                                      # best fit: smallest surplus that covers need
            fits = bal >= need
            h = torch.where(fits.any(), _first_min_where(bal, fits), torch.argmax(bal)).view(1)
        m = torch.where(bal.gather(0, h) > 0, need, torch.zeros_like(need))   # 0 once balanced
        z_RR.view(-1).index_add_(0, h * R + u, m)
        bal.index_add_(0, h, -m)
        bal.index_add_(0, u, m)
    return z_RR


def split_quotas_batched(cnt_E: Tensor, z_VRR: Tensor, expert_rule: str = "max") -> Tensor:
    """Step 2, every owner of V quota matrices at once: alloc [V, E, R].  Each round every
    owner refills its largest quota from one of its experts, emptying the quota or the expert.
    expert_rule: "max" (MoonEP: most tokens left) or "fit" (smallest expert covering the quota
    in one piece)."""
    V, R, _ = z_VRR.shape
    E = cnt_E.numel()
    B = E // R
    dev = cnt_E.device
    rem = cnt_E.view(1, R, B).repeat(V, 1, 1).view(V * R, B)       # row v*R + h: owner h of v
    q = z_VRR.reshape(V * R, R).clone()
    moved = torch.zeros(V * E * R, dtype=cnt_E.dtype, device=dev)          # [v, h, le, d]
    own = torch.arange(V * R, device=dev)
    for _ in range(R - 1 + B):                    # at most quotas + B experts to empty
        d = torch.argmax(q, dim=1)                                   # largest quota first
        qd = q.gather(1, d[:, None]).squeeze(1)
        if expert_rule == "max":
            le = torch.argmax(rem, dim=1)
        else:
            fits = rem >= qd[:, None]
            le = torch.where(fits.any(1), _first_min_where(rem, fits), torch.argmax(rem, 1))
        rl = rem.gather(1, le[:, None]).squeeze(1)
        t = torch.where(qd > 0, torch.minimum(rl, qd), torch.zeros_like(qd))
        chunk = own * B + le
        moved.index_add_(0, chunk * R + d, t)
        rem.view(-1).index_add_(0, chunk, -t)
        q.view(-1).index_add_(0, own * R + d, -t)
    moved = moved.view(V, E, R)
    at_home = (torch.arange(E, device=dev) // B)[:, None] == torch.arange(R, device=dev)[None, :]
    return moved + at_home[None] * (cnt_E - moved.sum(2))[:, :, None]


def split_quotas(cnt_E: Tensor, z_RR: Tensor, expert_rule: str) -> Tensor:
    """Step 2 for one quota matrix: alloc [E, R]."""
    return split_quotas_batched(cnt_E, z_RR[None], expert_rule)[0]


def replication_cost(alloc_ER: Tensor) -> tuple[Tensor, Tensor]:
    """(replicated experts, token copies computed off their home rank) of an allocation."""
    E, R = alloc_ER.shape
    dev = alloc_ER.device
    home_E = torch.arange(E, device=dev) // (E // R)
    # a mask product, not an index_put of a Python 0 (which stages a host scalar on CUDA)
    away = alloc_ER * (home_E[:, None] != torch.arange(R, device=dev)[None, :])
    return (away > 0).sum(), away.sum()


def leanest(cnt_E: Tensor, balance_R: Tensor) -> tuple[Tensor, Tensor]:
    """Policy "lean": (z [R, R], alloc [E, R]) of the best of four greedy variants (donor rule x
    expert rule): the fewest replicated experts, then the fewest moved copies; MoonEP's own plan
    comes first, so it wins ties.  A replica costs a full weight copy (3*D*F*2 bytes) against
    D*2 bytes per moved copy, hence the order.  The choice is a tensor argmin: no host sync."""
    zs, allocs, scores = [], [], []
    for donor_rule in ("max", "fit"):
        z_RR = rank_quotas(balance_R, donor_rule)
        for expert_rule in ("max", "fit"):
            alloc_ER = split_quotas(cnt_E, z_RR, expert_rule)
            replicated, moved = replication_cost(alloc_ER)
            zs.append(z_RR)
            allocs.append(alloc_ER)
            # moved <= total entries < 2**40, so this orders by (replicated, moved)
            scores.append(replicated * (1 << 40) + moved)
    best = torch.argmin(torch.stack(scores)).view(1)          # first minimum: MoonEP on ties
    return (torch.stack(zs).index_select(0, best).squeeze(0),
            torch.stack(allocs).index_select(0, best).squeeze(0))
