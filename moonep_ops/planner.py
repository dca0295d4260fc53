"""The MoonEP planner: from the gathered token histogram to every token copy's slot.

Op family ``moonep::plan`` — schema, fake kernel, implementation and Python API together.

Shape legend (see geometry.py): R ranks, E experts, B = epn = E/R, G = 2*epn segments,
s tokens this call (capacity S), K top-k, N = s*K entries of this rank.

Inputs of one rank
  tpe_RE     int32 [R, E]  gathered per-rank histograms (row r = bincount of rank r's top-k ids)
  topk_sK    int32 [s, K]  this rank's expert ids (duplicates inside a token are allowed)

Outputs (the tensors of a ``Plan``)
  dst_N            int32 [N]      slot of every entry: d*NvS + loff on destination rank d, where
                                  loff is the row in d's expert-grouped receive buffer.  The second
                                  and later entries of one token bound for the same d are stored
                                  as -(d*NvS + loff) - 1: they own a slot (and a route-weight slot)
                                  but their row is filled on d by a local copy of the first one.
  cu_seqlens_G     int32 [G]      inclusive end offsets of this rank's 2*epn segments
                                  (segments 0..epn-1: home experts, epn..: redundant slots)
  experts_to_copy_RB int32 [R, epn] global table, identical on every rank: slot b of rank d runs
                                  expert experts_to_copy[d, b] (ascending ids, -1 padded right)
  zero_fill_G2     int32 [G, 2]   (first row, rows) of each segment's padding, (0, 0) if none
  remote_stats_2   int32 [2]      (redundant experts this rank runs, slots elsewhere holding
                                  one of this rank's home experts)

Algorithm (docs/planner.md, bit-exact with upstream MoonEP for policy="moonep"):
  1. rank-level greedy on balance[h] = group[h] - cap[h] -> quota z[h, d]
  2. each owner splits its quotas into expert chunks -> alloc[e, d]
  3. per destination: redundant experts, padded segments, cu_seqlens, expert offsets
  4. per entry: global rank within its expert ordered by (source rank, flat index) -> dst
Steps 1-3 depend only on tpe and are recomputed identically on every rank (no broadcast);
step 4 needs only this rank's top-k.  Every loop is over R or epn with a fixed trip count and
masked updates, so the same code runs on CUDA tensors without a host sync and under capture.

policy="lean" keeps exact caps, the single-donor rule and <= epn slots.  It plans four greedy
variants -- step 1 donor = largest surplus (MoonEP) or best fit (smallest surplus covering the
deficit, no overshoot); step 2 expert = most tokens left (MoonEP) or best fit (smallest expert
covering the quota in one piece) -- and keeps the one with the fewest replicated experts, then
the fewest moved token copies (MoonEP's own plan wins ties).  So it is never worse than MoonEP
on either count (benchmarks/planner_policy_sweep.py has the sweep).  A replicated expert costs
a full weight copy (3*D*F*2 bytes, ~88 MB at D=7168, F=2048) against D*2 bytes per moved
copy, hence the order.  The choice is a tensor argmin: no host sync.

policy="cost" (inputs slack_ppm and replica_cost) lets a rank receive up to
U = ceil(ceil(T/R) * (1 + eps)) copies (NvS and nvs_s grow by the slack) and picks, by a
predicted cost in token copies (max rank load + replica_cost * replicas on the busiest link),
among MoonEP's plan and "level" plans that bring every rank to <= L <= U with one donor per
receiver (section "Policy cost" below; docs/planner.md has the proof and the table).  eps = 0
plans as "moonep" bit for bit; replica_cost = 0 gives MoonEP's plan at any slack.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from . import native, runtime
from .runtime import current_raw_stream, on_device_of
from .geometry import Geometry, ceil_div, check_cost_args, slack_cap

POLICIES = ("moonep", "lean", "cost")

# ---------------------------------------------------------------------------------------------
# Steps 1-2: the allocation alloc[e, d] (tokens of expert e computed on rank d)
# ---------------------------------------------------------------------------------------------


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


def split_quotas(cnt_E: Tensor, z_RR: Tensor, expert_rule: str) -> Tensor:
    """Step 2, all owners at once.  Returns alloc[e, d].
    expert_rule: "max" (MoonEP: most tokens left) or "fit" (smallest expert covering the quota)."""
    R = z_RR.shape[0]
    E = cnt_E.numel()
    B = E // R
    rem_RB = cnt_E.view(R, B).clone()
    q_RR = z_RR.clone()
    moved = torch.zeros(R * B * R, dtype=cnt_E.dtype, device=cnt_E.device)   # [h, le, d]
    owners = torch.arange(R, device=cnt_E.device)
    # Each round empties a quota or an expert: at most (R-1) + B rounds.
    for _ in range(R - 1 + B):
        d = torch.argmax(q_RR, dim=1)                                  # largest quota first
        qd = q_RR.gather(1, d[:, None]).squeeze(1)
        if expert_rule == "max":
            le = torch.argmax(rem_RB, dim=1)                           # most tokens left first
        else:                                                          # one piece if possible
            fits = rem_RB >= qd[:, None]
            le = torch.where(fits.any(1), _first_min_where(rem_RB, fits), torch.argmax(rem_RB, 1))
        rl = rem_RB.gather(1, le[:, None]).squeeze(1)
        t = torch.where(qd > 0, torch.minimum(rl, qd), torch.zeros_like(qd))
        moved.index_add_(0, (owners * B + le) * R + d, t)
        rem_RB.view(-1).index_add_(0, owners * B + le, -t)
        q_RR.view(-1).index_add_(0, owners * R + d, -t)
    moved_ER = moved.view(E, R)
    home_E = torch.arange(E, device=cnt_E.device) // B
    alloc_ER = moved_ER.clone()
    alloc_ER.view(-1).index_add_(0, torch.arange(E, device=cnt_E.device) * R + home_E,
                                 cnt_E - moved_ER.sum(1))
    return alloc_ER


# ---------------------------------------------------------------------------------------------
# Step 3: per-destination layout
# ---------------------------------------------------------------------------------------------


class Layout(NamedTuple):
    experts_to_copy_RB: Tensor   # [R, B] int64, -1 padded
    cu_seqlens_RG: Tensor        # [R, G]
    zero_fill_RG2: Tensor        # [R, G, 2]
    expert_off_RE: Tensor        # [R, E] first row of expert e's segment on d (-1: none)
    remote_stats_R2: Tensor      # [R, 2]
    n_remote_R: Tensor           # [R] redundant experts per destination (<= B by the theorem)


def layout(alloc_ER: Tensor, R: int, tp: int) -> Layout:
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


# ---------------------------------------------------------------------------------------------
# Step 4: per-entry slots of one source rank
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Whole-group planning core (shared by the op and plan_all_ranks)
# ---------------------------------------------------------------------------------------------


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
        z_RR, alloc_ER = _leanest(cnt_E, balance_R)
    else:
        even = ceil_div(total_entries, R)
        limit = slack_cap(even, slack_ppm)
        z_RR, alloc_ER = cost_plan(cnt_E, caps_R, even, limit, replica_cost)
    return GroupPlan(z_RR, alloc_ER, layout(alloc_ER, R, token_padding), caps_R, limit)


def replication_cost(alloc_ER: Tensor) -> tuple[Tensor, Tensor]:
    """(replicated experts, token copies computed off their home rank) of an allocation."""
    E, R = alloc_ER.shape
    dev = alloc_ER.device
    home_E = torch.arange(E, device=dev) // (E // R)
    # a mask product, not an index_put of a Python 0 (which stages a host scalar on CUDA)
    away = alloc_ER * (home_E[:, None] != torch.arange(R, device=dev)[None, :])
    return (away > 0).sum(), away.sum()


def _leanest(cnt_E: Tensor, balance_R: Tensor) -> tuple[Tensor, Tensor]:
    """policy="lean": the best of four greedy variants (MoonEP's first, so it wins ties)."""
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


# ---------------------------------------------------------------------------------------------
# Policy "cost": caps with slack, moves chosen by a predicted cost (docs/planner.md)
#
# Every rank may receive up to U = slack_cap(ceil(T/R)) copies.  Candidates:
#   MoonEP        MoonEP's own plan (exact caps);
#   level L       for L in [ceil(T/R), min(U, max group)]: ranks above L (donors) shed their
#                 excess group - L, each round the donor with the most excess left refilling
#                 one receiver that no donor used yet -- the smallest spare L - group that covers
#                 the excess, else the largest -- by min(excess, spare); then MoonEP's step 2
#                 splits each donor's quotas into expert chunks.  A level whose excess does not
#                 fit is infeasible (never chosen).  L = max group moves nothing.
# Score (int64, in token copies): max_r load_r + replica_cost * max_r links_r, links_r =
# max(replicas of r's experts on other ranks, slots on r): the slowest rank's grouped-GEMM time
# (linear in its copies) plus the weights and grads on the busiest link, both in units of one
# copy's GEMM time.  Search: COST_LEVELS levels evenly over the range, all independent of each
# other (so the device planner runs every level's quotas at once, during MoonEP's own step 1);
# the lowest score wins, ties to the earliest candidate (MoonEP first).  Fixed trip counts,
# masked updates, no host reads.
# ---------------------------------------------------------------------------------------------

COST_LEVELS = 16       # candidate levels of the search (docs/planner.md, "Search")
_INFEASIBLE = 1 << 62  # score of a level whose excess does not fit


def level_quotas(group_R: Tensor, level_C: Tensor) -> tuple[Tensor, Tensor]:
    """Step 1 of the level plans, for C levels at once ([C] int64).  Returns (z [C, R, R],
    feasible [C]).  Each receiver is refilled by one donor only (it retires after one round),
    so every column of z has at most one non-zero."""
    C, R = level_C.numel(), group_R.numel()
    dev = group_R.device
    g = group_R[None, :]
    L = level_C[:, None]
    excess = (g - L).clamp(min=0)                                   # [C, R] donors
    spare = (L - g).clamp(min=0)                                    # [C, R] receivers
    free = spare > 0
    z = torch.zeros(C * R * R, dtype=group_R.dtype, device=dev)
    c_R = torch.arange(C, device=dev) * R
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
        z.index_add_(0, (c_R + h) * R + u, m)
        excess.view(-1).index_add_(0, c_R + h, -m)
        free = free & ~((r_ids[None, :] == u[:, None]) & (m > 0)[:, None])   # u retires
    return z.view(C, R, R), excess.sum(1) == 0


def split_quotas_batched(cnt_E: Tensor, z_CRR: Tensor) -> Tensor:
    """Step 2 (MoonEP's "max" rule) for C quota matrices at once -> alloc [C, E, R]."""
    C, R, _ = z_CRR.shape
    E = cnt_E.numel()
    B = E // R
    dev = cnt_E.device
    rem = cnt_E.view(1, R, B).repeat(C, 1, 1)                               # [C, R, B]
    q = z_CRR.clone()
    moved = torch.zeros(C * E * R, dtype=cnt_E.dtype, device=dev)          # [c, h, le, d]
    own = (torch.arange(C, device=dev)[:, None] * R + torch.arange(R, device=dev)[None, :])
    for _ in range(R - 1 + B):
        d = torch.argmax(q, dim=2)                                          # [C, R]
        qd = q.gather(2, d[..., None]).squeeze(2)
        le = torch.argmax(rem, dim=2)
        rl = rem.gather(2, le[..., None]).squeeze(2)
        t = torch.where(qd > 0, torch.minimum(rl, qd), torch.zeros_like(qd)).reshape(-1)
        moved.index_add_(0, ((own * B + le) * R + d).reshape(-1), t)
        rem.view(-1).index_add_(0, (own * B + le).reshape(-1), -t)
        q.view(-1).index_add_(0, (own * R + d).reshape(-1), -t)
    moved = moved.view(C, E, R)
    e_ids = torch.arange(E, device=dev)
    at_home = (e_ids // B)[:, None] == torch.arange(R, device=dev)[None, :]    # [E, R]
    return moved + at_home[None] * (cnt_E - moved.sum(2))[:, :, None]


def plan_links(alloc_CER: Tensor) -> Tensor:
    """[C, R] max(replicas of rank r's experts on other ranks, redundant slots on r)."""
    C, E, R = alloc_CER.shape
    B = E // R
    dev = alloc_CER.device
    home = (torch.arange(E, device=dev) // B)[:, None] != torch.arange(R, device=dev)[None, :]
    away = ((alloc_CER > 0) & home[None]).long()                          # [C, E, R]
    out_R = away.view(C, R, B * R).sum(2)
    in_R = away.sum(1)
    return torch.maximum(out_R, in_R)


def plan_scores(alloc_CER: Tensor, replica_cost: int) -> Tensor:
    """[C] predicted cost in token copies: max_r load_r + replica_cost * max_r links_r."""
    return alloc_CER.sum(1).amax(1) + replica_cost * plan_links(alloc_CER).amax(1)


def cost_plan(cnt_E: Tensor, caps_R: Tensor, even: int, limit: int, replica_cost: int,
              levels: int = COST_LEVELS) -> tuple[Tensor, Tensor]:
    """Policy "cost": (z [R, R], alloc [E, R]) of the best candidate (see the section comment).
    ``even`` = ceil(T/R), ``limit`` = U >= even, ``replica_cost`` >= 0 in token copies."""
    R = caps_R.numel()
    dev = cnt_E.device
    group_R = cnt_E.view(R, -1).sum(1)
    z0 = rank_quotas(group_R - caps_R, "max")                       # MoonEP's own plan
    a0 = split_quotas(cnt_E, z0, "max")
    hi = group_R.amax().clamp(min=even, max=limit).view(1)   # above the max group nothing moves
    k = torch.arange(levels, device=dev)
    span = max(levels - 1, 1)
    lv = even + ((hi - even) * k + span - 1) // span           # [n]: even .. hi
    z_lv, ok = level_quotas(group_R, lv)
    a_lv = split_quotas_batched(cnt_E, z_lv)
    s_lv = torch.where(ok, plan_scores(a_lv, replica_cost), torch.full_like(lv, _INFEASIBLE))
    s0 = plan_scores(a0[None], replica_cost)
    best = torch.argmin(torch.cat([s0, s_lv])).view(1)         # first minimum: MoonEP on ties
    z = torch.cat([z0[None], z_lv]).index_select(0, best).squeeze(0)
    alloc = torch.cat([a0[None], a_lv]).index_select(0, best).squeeze(0)
    return z, alloc


# ---------------------------------------------------------------------------------------------
# Validation (clear Python errors before any work)
# ---------------------------------------------------------------------------------------------


def _check_int_tensor(name: str, t, ndim: int) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_plan_args(tpe_RE: Tensor, topk_sK: Tensor, rank: int, R: int, S: int,
                    token_padding: int, total_num_tokens: Optional[int], policy: str,
                    slack_ppm: int = 0, replica_cost: int = 0) -> tuple[Geometry, int]:
    """Shape/dtype/device/int checks (no data reads).  Returns (geometry, s)."""
    _check_int_tensor("tokens_per_expert (gathered [R, E])", tpe_RE, 2)
    _check_int_tensor("topk_ids [s, K]", topk_sK, 2)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    check_cost_args(policy, slack_ppm, replica_cost)
    geo = Geometry(R=R, E=tpe_RE.shape[1], S=S, K=topk_sK.shape[1], token_padding=token_padding,
                   slack_ppm=slack_ppm)
    if tuple(tpe_RE.shape) != (geo.R, geo.E):
        raise ValueError(f"tokens_per_expert must be [R, E] = [{geo.R}, {geo.E}], got {tuple(tpe_RE.shape)}")
    if topk_sK.shape[1] != geo.K:
        raise ValueError(f"topk_ids must be [s, K={geo.K}], got {tuple(topk_sK.shape)}")
    if tpe_RE.device != topk_sK.device:
        raise ValueError(f"tokens_per_expert is on {tpe_RE.device} but topk_ids on {topk_sK.device}")
    if not isinstance(rank, int) or not 0 <= rank < geo.R:
        raise ValueError(f"rank={rank} outside [0, R={geo.R})")
    s = topk_sK.shape[0]
    geo.check_s(s, total_num_tokens)
    return geo, s


def check_plan_values(tpe_RE: Tensor, topk_sK: Tensor, rank: int, geo: Geometry, s: int,
                      total_num_tokens: Optional[int]) -> None:
    """Data checks.  They read tensor values, so on CUDA they synchronise (config.validate)."""
    if topk_sK.numel():
        lo, hi = int(topk_sK.min()), int(topk_sK.max())
        if lo < 0 or hi >= geo.E:
            raise ValueError(f"expert ids must lie in [0, E={geo.E}); got values in [{lo}, {hi}]")
    if bool((tpe_RE < 0).any()):
        raise ValueError("tokens_per_expert has negative counts")
    own = torch.bincount(topk_sK.reshape(-1).long(), minlength=geo.E)
    if not torch.equal(own, tpe_RE[rank].long()):
        bad = int((own != tpe_RE[rank].long()).nonzero()[0])
        raise ValueError(
            f"tokens_per_expert[rank={rank}] disagrees with the histogram of topk_ids "
            f"(expert {bad}: {int(tpe_RE[rank, bad])} vs {int(own[bad])})")
    rows = tpe_RE.long().sum(1)
    if bool((rows > geo.S * geo.K).any()):
        raise ValueError(f"a rank's histogram sums above S*K={geo.S * geo.K} (capacity)")
    if total_num_tokens is None:
        if bool((rows != s * geo.K).any()):
            raise ValueError(
                f"every rank must pass s={s} tokens (histogram row sums {rows.tolist()} != s*K); "
                "pass total_num_tokens for per-rank s")
    elif int(rows.sum()) != total_num_tokens * geo.K:
        raise ValueError(f"histograms sum to {int(rows.sum())} entries, expected "
                         f"total_num_tokens*K = {total_num_tokens * geo.K}")


# ---------------------------------------------------------------------------------------------
# The custom op
# ---------------------------------------------------------------------------------------------


def _total(total_num_tokens: int) -> Optional[int]:
    """The schema carries "no total" (uniform s) as -1."""
    return None if total_num_tokens < 0 else total_num_tokens


# Explicit schema: plain `int`s (not inferred SymInts), so sizes are static in traces.
# slack_ppm and replica_cost are policy "cost"'s inputs (0 for the other policies).
@torch.library.custom_op(
    "moonep::plan", mutates_args=(),
    schema="(Tensor tpe_RE, Tensor topk_sK, int rank, int R, int S, int token_padding, "
           "int total_num_tokens, str policy, int slack_ppm=0, int replica_cost=0) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def _plan_op(tpe_RE: Tensor, topk_sK: Tensor, rank: int, R: int, S: int, token_padding: int,
             total_num_tokens: int, policy: str, slack_ppm: int = 0, replica_cost: int = 0
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    total = _total(total_num_tokens)
    geo, s = check_plan_args(tpe_RE, topk_sK, rank, R, S, token_padding, total, policy,
                             slack_ppm, replica_cost)
    if runtime.should_validate(tpe_RE):
        check_plan_values(tpe_RE, topk_sK, rank, geo, s, total)
    gp = plan_group(tpe_RE, geo.total_tokens(s, total) * geo.K, token_padding, policy,
                    slack_ppm, replica_cost)
    lay = gp.layout
    dst, _, _ = assign_slots(topk_sK, tpe_RE.long(), rank, gp.alloc_ER, lay.expert_off_RE, geo.NvS)
    return _rank_outputs(dst, lay, rank)


def _rank_outputs(dst_N: Tensor, lay: Layout, rank: int) -> tuple[Tensor, ...]:
    """The op's five outputs for one rank: int32, contiguous (fake kernel strides)."""
    out = (dst_N, lay.cu_seqlens_RG[rank], lay.experts_to_copy_RB, lay.zero_fill_RG2[rank],
           lay.remote_stats_R2[rank])
    return tuple(t.to(torch.int32).contiguous() for t in out)


@_plan_op.register_fake
def _plan_fake(tpe_RE, topk_sK, rank, R, S, token_padding, total_num_tokens, policy,
               slack_ppm=0, replica_cost=0):
    geo, s = check_plan_args(tpe_RE, topk_sK, rank, R, S, token_padding,
                             _total(total_num_tokens), policy, slack_ppm, replica_cost)
    N = s * geo.K
    new = lambda *shape: tpe_RE.new_empty(shape, dtype=torch.int32)   # noqa: E731
    return new(N), new(geo.G), new(R, geo.epn), new(geo.G, 2), new(2)


# ---------------------------------------------------------------------------------------------
# Python API
# ---------------------------------------------------------------------------------------------


class Plan(NamedTuple):
    """One rank's plan: tensors from moonep::plan plus the Python ints that size everything."""
    dst: Tensor                 # [N] int32, see module docstring
    cu_seqlens: Tensor          # [G] int32
    experts_to_copy: Tensor     # [R, epn] int32 (global table)
    zero_fill_ranges: Tensor    # [G, 2] int32
    remote_stats: Tensor        # [2] int32
    rank: int
    R: int
    E: int
    S: int
    K: int
    s: int
    token_padding: int
    total_num_tokens: int       # -1: uniform s on every rank
    NvS: int
    nvs_s: int
    slack_ppm: int = 0          # policy "cost": the cap slack NvS and nvs_s were sized with

    @property
    def epn(self) -> int:
        return self.E // self.R

    @property
    def raw_dst(self) -> Tensor:
        """[N] int64 slot encoding with the duplicate marking undone."""
        d = self.dst.long()
        return torch.where(d < 0, -d - 1, d)

    @property
    def dest_rank(self) -> Tensor:
        """[N] int64 destination rank of every entry."""
        return self.raw_dst // self.NvS

    @property
    def slot(self) -> Tensor:
        """[N] int64 row of every entry in its destination's receive buffer."""
        return self.raw_dst % self.NvS

    @property
    def is_primary(self) -> Tensor:
        """[N] bool: this entry carries the token row to its destination."""
        return self.dst >= 0

    @property
    def my_experts_to_copy(self) -> Tensor:
        """[epn] int32: the experts this rank runs in its redundant slots."""
        return self.experts_to_copy[self.rank]


def plan(tokens_per_expert_RE: Tensor, topk_ids_sK: Tensor, rank: int, *, num_ranks: int,
         capacity: int, token_padding: int = 1, total_num_tokens: Optional[int] = None,
         policy: str = "moonep", slack_ppm: int = 0, replica_cost: int = 0) -> Plan:
    """Plan this rank's dispatch from the gathered [R, E] histogram and this rank's top-k ids.

    Every rank calling with the same histogram gets the same global tables; the result does not
    depend on the routing for any shape.  With ``total_num_tokens`` ranks may pass different s.
    Policy "cost": ``slack_ppm`` (the cap slack eps in parts per million; geometry.slack_to_ppm)
    and ``replica_cost`` (one replica's transfer time in token copies;
    moonep_ops.gemm.plan_cost.replica_cost derives it); with slack_ppm = 0 it plans as "moonep".
    """
    if not isinstance(topk_ids_sK, Tensor) or not isinstance(tokens_per_expert_RE, Tensor):
        raise TypeError("tokens_per_expert and topk_ids must be tensors")
    tot = -1 if total_num_tokens is None else total_num_tokens
    outs = torch.ops.moonep.plan(tokens_per_expert_RE, topk_ids_sK, rank, num_ranks, capacity,
                                 token_padding, tot, policy, slack_ppm, replica_cost)
    geo = Geometry(R=num_ranks, E=tokens_per_expert_RE.shape[1], S=capacity,
                   K=topk_ids_sK.shape[1], token_padding=token_padding, slack_ppm=slack_ppm)
    s = topk_ids_sK.shape[0]
    return Plan(*outs, rank=rank, R=num_ranks, E=geo.E, S=capacity, K=geo.K, s=s,
                token_padding=token_padding, total_num_tokens=tot, NvS=geo.NvS,
                nvs_s=geo.nvs_s(s, total_num_tokens), slack_ppm=slack_ppm)


class GroupResult(NamedTuple):
    plans: list            # list[Plan], one per rank
    group: GroupPlan       # whole-group tables (z, alloc, layout, caps)
    tokens_per_expert: Tensor   # [R, E] int32


def plan_all_ranks(topk_per_rank: Sequence[Tensor] | Tensor, num_experts: int,
                   token_padding: int = 1, *, capacity: Optional[int] = None,
                   total_num_tokens: Optional[int] = None, policy: str = "moonep",
                   slack_ppm: int = 0, replica_cost: int = 0) -> GroupResult:
    """Plan for all R ranks at once from their top-k ids (a list of [s_r, K] or an [R, s, K]).

    Ranks with different s switch to per-rank mode (total_num_tokens = sum of s_r).  capacity
    defaults to the largest s_r.  Uses the same steps as the per-rank op (the tests check that
    both agree bit for bit) but runs steps 1-3 once instead of once per rank.  ``slack_ppm``,
    ``replica_cost``: policy "cost"'s inputs, as in ``plan``.
    """
    tk = list(topk_per_rank)
    if not tk:
        raise ValueError("topk_per_rank is empty")
    R = len(tk)
    sizes = [int(t.shape[0]) if isinstance(t, Tensor) and t.dim() == 2 else -1 for t in tk]
    if min(sizes) < 0:
        raise ValueError("every rank's top-k ids must be a 2-D [s, K] tensor")
    uniform = len(set(sizes)) == 1
    if total_num_tokens is None and not uniform:
        total_num_tokens = sum(sizes)
    elif total_num_tokens is not None and total_num_tokens != sum(sizes):
        raise ValueError(f"total_num_tokens={total_num_tokens} but the ranks' top-k ids hold "
                         f"s = {sizes} tokens (sum {sum(sizes)})")
    S = capacity if capacity is not None else max(sizes)
    if num_experts % R:
        raise ValueError(f"num_experts={num_experts} must be divisible by R={R}")
    for r, t in enumerate(tk):
        _check_int_tensor(f"topk_per_rank[{r}]", t, 2)
        # one K and one device for the group: a rank with another K would be planned with
        # the last rank's K (its dst would not match its Plan)
        if t.shape[1] != tk[0].shape[1]:
            raise ValueError(f"topk_per_rank[{r}] has K={t.shape[1]} but topk_per_rank[0] "
                             f"K={tk[0].shape[1]}: every rank passes the same top-k")
        if t.device != tk[0].device:
            raise ValueError(f"topk_per_rank[{r}] is on {t.device}, topk_per_rank[0] on "
                             f"{tk[0].device}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_experts):
            raise ValueError(f"topk_per_rank[{r}] has expert ids outside [0, {num_experts})")
    tpe_RE = torch.stack([torch.bincount(t.reshape(-1).long(), minlength=num_experts)
                          for t in tk]).to(torch.int32)
    for r in range(R):     # same argument checks the op runs
        geo, _ = check_plan_args(tpe_RE, tk[r], r, R, S, token_padding, total_num_tokens, policy,
                                 slack_ppm, replica_cost)
    # Steps 1-3 once for the group (the per-rank op recomputes them identically on every rank).
    total = geo.total_tokens(sizes[0], total_num_tokens) * geo.K
    gp = plan_group(tpe_RE, total, token_padding, policy, slack_ppm, replica_cost)
    lay = gp.layout
    tot = -1 if total_num_tokens is None else total_num_tokens
    plans = []
    for r in range(R):
        dst, _, _ = assign_slots(tk[r], tpe_RE.long(), r, gp.alloc_ER, lay.expert_off_RE, geo.NvS)
        plans.append(Plan(*_rank_outputs(dst, lay, r), rank=r, R=R, E=num_experts, S=S, K=geo.K, s=sizes[r],
                          token_padding=token_padding, total_num_tokens=tot, NvS=geo.NvS,
                          nvs_s=geo.nvs_s(sizes[r], total_num_tokens), slack_ppm=slack_ppm))
    return GroupResult(plans, gp, tpe_RE)


# ---------------------------------------------------------------------------------------------
# The device planner: moonep_plan of libmoonep_ep.so (csrc/plan_kernels.cu)
#
# Bit-exact with moonep::plan(hist[:, :E], topk, rank, R, S, tp, total, "moonep") -- or with
# policy "cost" and its slack_ppm / replica_cost (R <= 64, E/R <= 256: cost_device_limit) -- for
# every histogram that passes validation, with no host synchronisation and no allocation inside
# the library, so it can be captured in a CUDA graph.  Its input hist_RX is [R, E+3] int32 on the
# device; row r = [bincount of rank r's top-k ids (E), bad_ids_flag, s_r, total_num_tokens
# (-1: uniform s)].  Validation runs on the device and ORs native.ERR_* bits into the int32
# ``err`` word instead of raising: a row not summing to s_r*K, s_r outside [1, S], an s / total
# disagreement, a negative count (ERR_HIST); a set bad flag or an id outside [0, E) in topk
# (ERR_BAD_IDS); hist[rank] not the histogram of topk (ERR_HIST); a slot outside the plan
# (ERR_PLAN, impossible for a valid histogram).  The outputs stay in range whatever the input
# (an invalid histogram plans as an empty one).
# ---------------------------------------------------------------------------------------------

DEVICE_POLICIES = ("moonep", "cost")     # the policies csrc/plan_kernels.cu implements

# Policy "cost" with a slack on the device: one warp per candidate keeps every per-rank value in
# two registers a lane (R <= 64), and each warp one row of B token counts in shared memory
# (csrc/plan_kernels.cu kCostMaxR, kCostMaxB).  Beyond them plan_on_device raises, and
# plan_from_rows plans with the torch reference (cost_device_limit says why).
COST_DEVICE_MAX_R = 64
COST_DEVICE_MAX_B = 256


def cost_device_limit(R: int, E: int, slack_ppm: int) -> Optional[str]:
    """None when the device planner can plan policy "cost" with this slack for R ranks and E
    experts, else why not (slack_ppm = 0 plans as MoonEP: always served)."""
    if slack_ppm == 0:
        return None
    if R > COST_DEVICE_MAX_R:
        return f"R={R} > {COST_DEVICE_MAX_R}"
    if E // R > COST_DEVICE_MAX_B:
        return f"E/R={E // R} > {COST_DEVICE_MAX_B}"
    return None


def device_planner_available() -> bool:
    """True when libmoonep_ep.so is loaded (it always exports the planner)."""
    return native.ep() is not None


@functools.lru_cache(maxsize=1024, typed=True)   # a function of the sizes: once per shape
def workspace_bytes(R: int, E: int, s: int, K: int) -> int:
    n = int(native.require_ep().plan_workspace_bytes(R, E, s, K))
    if n == 0:
        raise ValueError(f"invalid planner sizes R={R}, E={E}, s={s}, K={K}")
    return n


class DevicePlanBuffers(NamedTuple):
    dst: Tensor          # [s*K]
    cu: Tensor           # [2*epn]
    etc: Tensor          # [R, epn]
    zf: Tensor           # [2*epn, 2]
    stats: Tensor        # [2]
    workspace: Tensor    # [workspace_bytes] uint8


def _check_device_args(hist_RX: Tensor, topk_sK: Tensor, rank, R, S, token_padding, NvS,
           err: Tensor) -> tuple[int, int, int]:
    """Argument checks (no data reads).  Returns (E, s, K)."""
    for name, t in (("hist_RX", hist_RX), ("topk_sK", topk_sK), ("err", err)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
        if t.device != hist_RX.device:
            raise ValueError(f"{name} is on {t.device} but hist_RX on {hist_RX.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    for name, v in (("rank", rank), ("R", R), ("S", S), ("token_padding", token_padding),
                    ("NvS", NvS)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if hist_RX.dim() != 2 or hist_RX.shape[0] != R or hist_RX.shape[1] < 4:
        raise ValueError(f"hist_RX must be [R={R}, E+3], got {tuple(hist_RX.shape)}")
    if topk_sK.dim() != 2 or topk_sK.shape[0] < 1 or topk_sK.shape[1] < 1:
        raise ValueError(f"topk_sK must be a non-empty [s, K], got {tuple(topk_sK.shape)}")
    if err.numel() < 1:
        raise ValueError("err must hold at least one int32")
    s, K = topk_sK.shape
    return hist_RX.shape[1] - 3, int(s), int(K)


# Ints in, a frozen Geometry out (an error is raised again on every call: lru_cache keeps
# results only), so a dispatch validates its sizes once per shape, not on every call.
@functools.lru_cache(maxsize=1024, typed=True)
def _geometry(R, E, S, K, token_padding, NvS, rank, s, slack_ppm=0, replica_cost=0) -> Geometry:
    check_cost_args("cost", slack_ppm, replica_cost)
    # E % R, R*NvS, K <= 127; NvS with the slack's larger receive bound
    geo = Geometry(R=R, E=E, S=S, K=K, token_padding=token_padding, slack_ppm=slack_ppm)
    why = cost_device_limit(R, E, slack_ppm)
    if why is not None:
        raise ValueError(f"the device planner cannot plan policy 'cost' with a slack for {why} "
                         f"(limits R <= {COST_DEVICE_MAX_R}, E/R <= {COST_DEVICE_MAX_B}); plan "
                         f"with the torch reference planner.plan(..., policy='cost')")
    if not 0 <= rank < R:
        raise ValueError(f"rank={rank} outside [0, R={R})")
    geo.check_s(s)
    if NvS < geo.NvS or R * NvS >= 2**31:
        raise ValueError(f"NvS={NvS} must be >= the geometry's NvS={geo.NvS} with R*NvS < 2^31")
    if R * S * K >= 2**31:
        raise ValueError(f"R*S*K = {R * S * K} does not fit in int32")
    return geo


def allocate(hist_RX: Tensor, s: int, K: int, R: int) -> DevicePlanBuffers:
    """Output and workspace tensors for one plan (torch.empty: no sync, capture-safe)."""
    E = hist_RX.shape[1] - 3
    B = E // R
    new = lambda *shape: torch.empty(shape, dtype=torch.int32, device=hist_RX.device)  # noqa: E731
    ws = torch.empty(workspace_bytes(R, E, s, K), dtype=torch.uint8, device=hist_RX.device)
    return DevicePlanBuffers(new(s * K), new(2 * B), new(R, B), new(2 * B, 2), new(2), ws)


def plan_into(hist_RX: Tensor, topk_sK: Tensor, rank: int, R: int, S: int, token_padding: int,
              NvS: int, err: Tensor, bufs: DevicePlanBuffers, group_only: bool = False, *,
              slack_ppm: int = 0, replica_cost: int = 0) -> None:
    """Launch moonep_plan (or moonep_plan_group) into preallocated buffers on the current stream.
    ``slack_ppm`` > 0: policy "cost" with that slack and ``replica_cost`` (as ``plan``);
    0: policy "moonep" (and "cost" without slack, the same plan)."""
    E, s, K = _check_device_args(hist_RX, topk_sK, rank, R, S, token_padding, NvS, err)
    _geometry(R, E, S, K, token_padding, NvS, rank, s, slack_ppm, replica_cost)
    B = E // R
    want = {"dst": (s * K,), "cu": (2 * B,), "etc": (R, B), "zf": (2 * B, 2), "stats": (2,)}
    for name, shape in want.items():
        t = getattr(bufs, name)
        if t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous() \
                or t.device != hist_RX.device:
            raise ValueError(f"buffer {name} must be contiguous int32 {shape} on {hist_RX.device}")
    ws = bufs.workspace
    if ws.device != hist_RX.device or not ws.is_contiguous() or \
            ws.numel() * ws.element_size() < workspace_bytes(R, E, s, K):
        raise ValueError("workspace too small or not on the device")
    _plan_into(hist_RX, topk_sK, rank, R, E, S, s, K, token_padding, NvS, err, bufs,
               group_only, slack_ppm, replica_cost)


def _plan_into(hist_RX, topk_sK, rank, R, E, S, s, K, token_padding, NvS, err, bufs, group_only,
               slack_ppm, replica_cost) -> None:
    """plan_into's launch, its arguments checked (plan_into, or plan_on_device, which made the
    buffers)."""
    stream = current_raw_stream(hist_RX.device)
    ws = bufs.workspace
    nbytes = ws.numel() * ws.element_size()
    lib = native.require_ep()
    with on_device_of(hist_RX.device):          # the library launches on the current device
        _launch(lib, group_only, hist_RX, topk_sK, s, K, rank, R, E, S, token_padding, NvS, bufs,
                ws, nbytes, err, stream, slack_ppm, replica_cost)


def _launch(lib, group_only, hist_RX, topk_sK, s, K, rank, R, E, S, token_padding, NvS, bufs, ws,
            nbytes, err, stream, slack_ppm=0, replica_cost=0):
    if group_only:
        rc = lib.plan_group(hist_RX.data_ptr(), s, K, rank, R, E, S, token_padding, NvS,
                            slack_ppm, replica_cost, bufs.cu.data_ptr(), bufs.etc.data_ptr(),
                            bufs.zf.data_ptr(), bufs.stats.data_ptr(), ws.data_ptr(), nbytes,
                            err.data_ptr(), stream)
        if rc:
            native.ep_check(rc, "moonep_plan_group")
    else:
        rc = lib.plan(hist_RX.data_ptr(), topk_sK.data_ptr(), s, K, rank, R, E, S, token_padding,
                      NvS, slack_ppm, replica_cost, bufs.dst.data_ptr(), bufs.cu.data_ptr(),
                      bufs.etc.data_ptr(), bufs.zf.data_ptr(), bufs.stats.data_ptr(),
                      ws.data_ptr(), nbytes, err.data_ptr(), stream)
        if rc:
            native.ep_check(rc, "moonep_plan")


def plan_on_device(hist_RX: Tensor, topk_sK: Tensor, rank: int, R: int, S: int,
                   token_padding: int, NvS: int, err: Tensor, *, slack_ppm: int = 0,
                   replica_cost: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Plan this rank's dispatch on the device: (dst [s*K], cu [2*epn], etc [R, epn],
    zf [2*epn, 2], stats [2]), all int32 on hist_RX's device, launched on the current stream.

    Same values as ``torch.ops.moonep.plan(hist_RX[:, :E], topk_sK, rank, R, S, token_padding,
    total, "moonep")`` with ``total = hist_RX[rank, E+2]``, when the histogram is valid;
    otherwise ``err`` gets MOONEP_ERR_* bits and the outputs are in range but meaningless.
    With ``slack_ppm`` > 0: the same as policy "cost" with that slack and ``replica_cost``
    (NvS must then be the slack's, ``Geometry(..., slack_ppm=slack_ppm).NvS``); a ValueError
    when the kernel cannot take R or E/R with a slack (``cost_device_limit``).
    """
    E, s, K = _check_device_args(hist_RX, topk_sK, rank, R, S, token_padding, NvS, err)
    _geometry(R, E, S, K, token_padding, NvS, rank, s, slack_ppm, replica_cost)
    bufs = allocate(hist_RX, s, K, R)          # the buffers plan_into would check, made here
    _plan_into(hist_RX, topk_sK, rank, R, E, S, s, K, token_padding, NvS, err, bufs, False,
               slack_ppm, replica_cost)
    return bufs.dst, bufs.cu, bufs.etc, bufs.zf, bufs.stats


def plan_from_rows(rows_RX: Tensor, topk_sK: Tensor, rank: int, spec, total: int,
                   err: Optional[Tensor], *, device: bool = True, clamp_ids: bool = False):
    """The plan from the gathered [R, E+3] rows, as both data-plane backends make it.

    The device planner when it can serve (``device``, CUDA rows, ``spec.policy`` in
    DEVICE_POLICIES, the library loaded, and for policy "cost" with a slack R <= 64 and
    E/R <= 256: ``cost_device_limit``; ``err`` gets its error bits, so it must be given for
    CUDA rows), else the torch planner on the rows' device (``total`` as moonep::plan takes it;
    ``clamp_ids``: ids that a histogram kernel flagged as bad are clamped so its indexing stays
    in bounds).  Same plan either way (tests).
    Returns (the five plan tensors, whether the device planner made them)."""
    slack_ppm = getattr(spec, "slack_ppm", 0) if spec.policy == "cost" else 0
    replica_cost = getattr(spec, "replica_cost", 0) if spec.policy == "cost" else 0
    if device and rows_RX.is_cuda and spec.policy in DEVICE_POLICIES and \
            cost_device_limit(spec.R, spec.E, slack_ppm) is None and device_planner_available():
        hist_RX = rows_RX.to(torch.int32).contiguous()
        return plan_on_device(hist_RX, topk_sK, rank, spec.R, spec.S, spec.token_padding,
                              spec.NvS, err, slack_ppm=slack_ppm,
                              replica_cost=replica_cost), True
    ids = topk_sK.clamp(0, spec.E - 1) if clamp_ids else topk_sK
    tpe_RE = rows_RX[:, :spec.E].to(torch.int32).contiguous()
    return torch.ops.moonep.plan(tpe_RE, ids, rank, spec.R, spec.S, spec.token_padding, total,
                                 spec.policy, getattr(spec, "slack_ppm", 0),
                                 getattr(spec, "replica_cost", 0)), False


def plan_from_host_rows(rows_RX: Tensor, topk_sK: Tensor, rank: int, spec, total: int):
    """The host backends' plan from host-validated gathered rows.  On CUDA (NCCL groups) the
    device planner serves (two launches, ~40 us at R = 8, E = 384, against ~12 ms for the torch
    planner's hundreds of small kernels); the rows were validated on the host, so its error
    word can only flag an internal error, read when validation is on (MOONEP_VALIDATE=1)."""
    err = torch.zeros(1, dtype=torch.int32, device=rows_RX.device) if rows_RX.is_cuda else None
    out, on_device = plan_from_rows(rows_RX, topk_sK, rank, spec, total, err)
    if on_device and runtime.should_validate(err) and int(err.item()) != 0:
        raise RuntimeError(f"moonep dispatch: the device planner flagged error bits "
                           f"{int(err.item()):#x} on host-validated input (a bug)")
    return out


def make_hist_rx(tpe_RE: Tensor, s_per_rank, total_num_tokens: Optional[int] = None,
                 bad_flags=None) -> Tensor:
    """Build the [R, E+3] histogram rows (helper for tests and benchmarks; on tpe's device)."""
    R = tpe_RE.shape[0]
    sizes = [s_per_rank] * R if isinstance(s_per_rank, int) else list(s_per_rank)
    tot = -1 if total_num_tokens is None else total_num_tokens
    bad = [0] * R if bad_flags is None else list(bad_flags)
    meta = torch.tensor([[bad[r], sizes[r], tot] for r in range(R)], dtype=torch.int32)
    return torch.cat([tpe_RE.to(torch.int32).cpu(), meta], dim=1).contiguous().to(tpe_RE.device)
