"""The reference planner: the whole group's plan (steps 1-3) and one rank's slots (step 4), for
the three policies, on torch tensors of any device (docs/planner.md, "Algorithm").

  1. rank-level greedy on balance[h] = group[h] - cap[h] -> quota z[h, d]      (greedy.py)
  2. each owner splits its quotas into expert chunks -> alloc[e, d]             (greedy.py)
     (policy "lean": the best of four greedy variants; "cost": cost.py)
  3. per destination: redundant experts, padded segments, cu_seqlens, expert offsets
  4. per entry: global rank within its expert ordered by (source rank, flat index) -> dst
Steps 1-3 depend only on the histogram and are recomputed identically on every rank (no
broadcast); step 4 needs only this rank's top-k.  Every loop has a fixed trip count and masked
updates, so the same code runs on CUDA tensors without a host sync and under capture.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..geometry import ceil_div, slack_cap
from .cost import cost_plan
from .greedy import leanest, rank_quotas, split_quotas

POLICIES = ("moonep", "lean", "cost")


class Layout(NamedTuple):
    experts_to_copy_RB: Tensor   # [R, B] int64, -1 padded
    cu_seqlens_RG: Tensor        # [R, G]
    zero_fill_RG2: Tensor        # [R, G, 2]
    expert_off_RE: Tensor        # [R, E] first row of expert e's segment on d (-1: none)
    remote_stats_R2: Tensor      # [R, 2]
    n_remote_R: Tensor           # [R] redundant experts per destination (<= B by the theorem)


def layout(alloc_ER: Tensor, R: int, tp: int) -> Layout:
    """Step 3: every destination's segments (home experts, then its redundant ones), each padded
    to a multiple of ``tp``."""
    E = alloc_ER.shape[0]
    B = E // R
    dev = alloc_ER.device
    e_ids = torch.arange(E, device=dev)
    r_ids = torch.arange(R, device=dev)
    a_RE = alloc_ER.t()
    remote_RE = (a_RE > 0) & ((e_ids // B)[None, :] != r_ids[:, None])
    n_remote_R = remote_RE.sum(1)
    # Remote experts in ascending global id, packed left; more than B cannot happen for a valid
    # plan (single donor); if it did, extra experts would be dropped, so callers check n_remote.
    key = torch.where(remote_RE, e_ids[None, :], e_ids[None, :] + E)
    first = torch.sort(key, dim=1).values[:, :B]
    etc_RB = torch.where(first < E, first, torch.full_like(first, -1))
    local_cnt = a_RE.gather(1, (r_ids[:, None] * B + torch.arange(B, device=dev)[None, :]))
    slot_cnt = torch.where(etc_RB >= 0, a_RE.gather(1, etc_RB.clamp(min=0)), torch.zeros_like(etc_RB))
    cnt_RG = torch.cat([local_cnt, slot_cnt], dim=1)
    padded = (cnt_RG + tp - 1) // tp * tp
    cu_RG = torch.cumsum(padded, dim=1)
    start = cu_RG - padded
    pad_rows = padded - cnt_RG
    zf = torch.stack([torch.where(pad_rows > 0, start + cnt_RG, torch.zeros_like(start)),
                      pad_rows], dim=2)
    # expert_off[d, e]: scatter the segment starts into an [R, E+1] table (column E = dump)
    seg_expert = torch.cat([r_ids[:, None] * B + torch.arange(B, device=dev)[None, :],
                            torch.where(etc_RB >= 0, etc_RB, torch.full_like(etc_RB, E))], dim=1)
    off = torch.full((R, E + 1), -1, dtype=alloc_ER.dtype, device=dev)
    off.scatter_(1, seg_expert, torch.where(cnt_RG > 0, start, torch.full_like(start, -1)))
    owner_of_slot = torch.where(etc_RB >= 0, etc_RB // B, torch.full_like(etc_RB, R))
    # scatter_add, not bincount: CUDA bincount reads max() on the host to size its output
    copies_R = torch.zeros(R + 1, dtype=etc_RB.dtype, device=dev).scatter_add_(
        0, owner_of_slot.reshape(-1), torch.ones_like(owner_of_slot).reshape(-1))[:R]
    stats = torch.stack([n_remote_R.clamp(max=B), copies_R], dim=1)
    return Layout(etc_RB, cu_RG, zf, off[:, :E], stats, n_remote_R)



def assign_slots(topk_sK: Tensor, tpe_RE: Tensor, rank: int, alloc_ER: Tensor,
                 expert_off_RE: Tensor, NvS: int) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (dst_N encoded with duplicates negated, dest_N, loff_N), all int64."""
    s, K = topk_sK.shape
    N = s * K
    dev = topk_sK.device
    e_N = topk_sK.reshape(-1).long()
    # local_idx: earlier entries of this rank with the same expert (stable sort by expert)
    order = torch.sort(e_N, stable=True).indices
    tpe_r = tpe_RE[rank]
    first_of_e = torch.cumsum(tpe_r, 0) - tpe_r
    local_idx = torch.empty_like(e_N)
    local_idx[order] = torch.arange(N, device=dev) - first_of_e[e_N[order]]
    before_r = tpe_RE[:rank].sum(0)                           # tpe_cumsum[rank-1]
    gr = before_r[e_N] + local_idx                            # global order: (rank, flat index)
    acum_ER = torch.cumsum(alloc_ER, dim=1)                   # over destinations 0..R-1
    dest = torch.searchsorted(acum_ER[e_N], gr[:, None], right=True).squeeze(1)
    dest = dest.clamp(max=alloc_ER.shape[1] - 1)              # only for invalid input
    prev = (acum_ER - alloc_ER)[e_N, dest]
    loff = expert_off_RE[dest, e_N] + (gr - prev)
    dst = dest * NvS + loff
    # Dedup: an entry whose destination already appeared earlier in the same token.
    d_sK = dest.view(s, K)
    k_ids = torch.arange(K, device=dev)
    earlier_KK = k_ids[None, :] < k_ids[:, None]                           # [k, j]: j < k
    dup = ((d_sK[:, :, None] == d_sK[:, None, :]) & earlier_KK).any(-1).reshape(-1)
    return torch.where(dup, -dst - 1, dst), dest, loff



class GroupPlan(NamedTuple):
    """Everything steps 1-3 produce for the whole group (int64 tensors)."""
    z_RR: Tensor
    alloc_ER: Tensor
    layout: Layout
    caps_R: Tensor               # the exact caps (floor/ceil split of the total)
    max_receive: int = -1        # the most copies a rank may receive (policy "cost": the slack
                                 # cap; -1: every rank receives exactly its cap)


def plan_group(tpe_RE: Tensor, total_entries: int, token_padding: int, policy: str,
               slack_ppm: int = 0, replica_cost: int = 0) -> GroupPlan:
    """Steps 1-3 for the whole group from the gathered histogram; ``total_entries`` = T*K."""
    R, E = tpe_RE.shape
    t = tpe_RE.long()
    cnt_E = t.sum(0)
    base, extra = divmod(total_entries, R)      # caps: floor/ceil split (geometry.receive_caps)
    caps_R = base + (torch.arange(R, device=t.device) < extra).long()   # built on device: no H2D
    balance_R = cnt_E.view(R, E // R).sum(1) - caps_R
    limit = -1
    if policy == "moonep" or (policy == "cost" and slack_ppm == 0):
        # policy "cost" without slack IS MoonEP (static branch on a Python int)
        z_RR = rank_quotas(balance_R, "max")
        alloc_ER = split_quotas(cnt_E, z_RR, "max")
    elif policy == "lean":
        z_RR, alloc_ER = leanest(cnt_E, balance_R)
    else:
        even = ceil_div(total_entries, R)
        limit = slack_cap(even, slack_ppm)
        z_RR, alloc_ER = cost_plan(cnt_E, caps_R, even, limit, replica_cost)
    return GroupPlan(z_RR, alloc_ER, layout(alloc_ER, R, token_padding), caps_R, limit)

