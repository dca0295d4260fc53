"""Invariants every valid plan satisfies (every policy).  Returns a list of violations.

Exact policies ("moonep", "lean", "cost" without slack): every rank receives exactly its cap.
Policy "cost" with a slack: every rank receives at most slack_cap(ceil(T/R)) copies."""
from __future__ import annotations

import torch

from moonep_ops.geometry import ceil_div, receive_caps, slack_cap


def plan_violations(res, topk, E, tp):
    errs = []
    plans, gp, tpe = res.plans, res.group, res.tokens_per_expert
    R = len(plans)
    B = E // R
    K = plans[0].K
    NvS, S = plans[0].NvS, plans[0].S
    total = sum(int(t.shape[0]) for t in topk) * K
    caps = receive_caps(total, R)
    alloc = gp.alloc_ER
    alloc_l = alloc.tolist()
    etc = plans[0].experts_to_copy

    for p in plans:
        if not torch.equal(p.experts_to_copy, etc):
            errs.append(f"rank {p.rank}: experts_to_copy differs between ranks")
    # conservation and exact caps
    if not torch.equal(alloc.sum(1), tpe.long().sum(0)):
        errs.append("alloc does not conserve per-expert counts")
    if (alloc < 0).any():
        errs.append("negative alloc")
    slack_ppm = plans[0].slack_ppm
    if slack_ppm:
        limit = slack_cap(ceil_div(total, R), slack_ppm)
        if int(alloc.sum()) != total or int(alloc.sum(0).max()) > limit:
            errs.append(f"received {alloc.sum(0).tolist()}: not <= {limit} summing to {total}")
        if gp.max_receive != limit:
            errs.append(f"group plan's max_receive {gp.max_receive} != {limit}")
    elif alloc.sum(0).tolist() != caps:
        errs.append(f"received {alloc.sum(0).tolist()} != caps {caps}")
    # single donor, <= B slots, ascending, -1 packed right
    for d in range(R):
        row = etc[d].tolist()
        used = [e for e in row if e >= 0]
        if row[:len(used)] != used or any(e != -1 for e in row[len(used):]):
            errs.append(f"rank {d}: experts_to_copy not packed left: {row}")
        if used != sorted(used) or len(set(used)) != len(used):
            errs.append(f"rank {d}: experts_to_copy not strictly ascending: {row}")
        if any(e // B == d for e in used):
            errs.append(f"rank {d}: own expert in a redundant slot")
        donors = {e // B for e in used}
        if len(donors) > 1:
            errs.append(f"rank {d}: {len(donors)} donors {donors}")
        remote = [e for e in range(E) if e // B != d and alloc_l[e][d] > 0]
        if remote != used:
            errs.append(f"rank {d}: slots {used} != remote experts with tokens {remote}")
    # layout per destination
    seg_of = []
    for d, p in enumerate(plans):
        if p.cu_seqlens.dtype != torch.int32 or p.cu_seqlens.numel() != 2 * B:
            errs.append(f"rank {d}: cu_seqlens dtype/shape")
        cu = p.cu_seqlens.tolist()
        starts = [0] + cu[:-1]
        lens = [c - st for c, st in zip(cu, starts)]
        if any(n < 0 or n % tp for n in lens):
            errs.append(f"rank {d}: segments not non-decreasing multiples of tp: {cu}")
        if cu[-1] > p.nvs_s or p.nvs_s > NvS:
            errs.append(f"rank {d}: cu[-1]={cu[-1]} > nvs_s={p.nvs_s} or nvs_s > NvS={NvS}")
        experts = [d * B + j for j in range(B)] + etc[d].tolist()
        zfs = p.zero_fill_ranges.tolist()
        segs = {}
        for g, e in enumerate(experts):
            c = alloc_l[e][d] if e >= 0 else 0
            if lens[g] != (c + tp - 1) // tp * tp:
                errs.append(f"rank {d} seg {g}: length {lens[g]} for {c} tokens")
            zf = zfs[g]
            want = [starts[g] + c, lens[g] - c] if lens[g] > c else [0, 0]
            if zf != want:
                errs.append(f"rank {d} seg {g}: zero_fill {zf} != {want}")
            if e >= 0:
                segs[e] = (starts[g], c)
        seg_of.append(segs)
    # every entry: exactly one slot, in a non-padding row of its expert's segment, ordered by
    # (source rank, flat index); duplicates marked per token
    seen = {}
    for r, p in enumerate(plans):
        ids = topk[r].reshape(-1).tolist()
        dest = p.dest_rank.tolist()
        slot = p.slot.tolist()
        prim = p.is_primary.tolist()
        for i, e in enumerate(ids):
            d, l = dest[i], slot[i]
            if not 0 <= d < R:
                errs.append(f"rank {r} entry {i}: dest {d}")
                continue
            if e not in seg_of[d]:
                errs.append(f"rank {r} entry {i}: expert {e} has no segment on rank {d}")
                continue
            st, c = seg_of[d][e]
            if not st <= l < st + c:
                errs.append(f"rank {r} entry {i}: slot {l} outside [{st}, {st + c})")
            if (d, l) in seen:
                errs.append(f"slot ({d}, {l}) assigned twice")
            seen[(d, l)] = (e, r, i)
        for t in range(len(ids) // K):
            ds = dest[t * K:(t + 1) * K]
            for k in range(K):
                if prim[t * K + k] != (ds[k] not in ds[:k]):
                    errs.append(f"rank {r} token {t} k {k}: wrong duplicate marking")
    if len(seen) != total:
        errs.append(f"{len(seen)} slots for {total} entries")
    # order within a segment: (source rank, flat index) ascending
    by_seg = {}
    for (d, l), (e, r, i) in seen.items():
        by_seg.setdefault((d, e), []).append((l, r, i))
    for key, rows in by_seg.items():
        rows.sort()
        if [(r, i) for _, r, i in rows] != sorted((r, i) for _, r, i in rows):
            errs.append(f"segment {key}: slots not ordered by (source rank, flat index)")
    return errs
