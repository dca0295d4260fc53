"""Per (step, layer) accounting of one routing for both builds, from the planner's tables.

MoonEP's layer plans with the same op as ``plan_all_ranks`` (bit-exact, tests/test_planner.py),
so the loads and slots below are the ones the layers run with.  Bytes count one training step
(forward and backward) of one layer, summed over the ranks, off-rank traffic only:

  baseline tokens  4 * remote entries * D * b     dispatch + combine, and their transposes
  MoonEP tokens    2 * (remote rows + remote entries) * D * b
                   dispatch sends a token's row once per destination rank (rows), combine
                   returns every entry (entries); backward: combine-transpose, dispatch-transpose
  MoonEP weights   slots * 3*D*F * (2*b + 4)   prefetch in forward and again in backward
                   (the slots are shared by the layers), fp32 reduce_grad
  (b = bytes per element of the activations/weights; the planner's histogram all-gather and the
  slot metadata are not counted here -- the job's "wire" column measures every byte.)
"""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from moonep_ops.planner import plan_all_ranks, replication_cost


def routing_stats(topk_per_rank: Sequence[Tensor], E: int, D: int, F: int, elem_bytes: int,
                  token_padding: int = 1, policy: str = "moonep", slack_ppm: int = 0,
                  replica_cost: int = 0) -> dict:
    R = len(topk_per_rank)
    B = E // R
    res = plan_all_ranks(list(topk_per_rank), E, token_padding, policy=policy,
                         slack_ppm=slack_ppm, replica_cost=replica_cost)
    tpe = res.tokens_per_expert.long()
    base_recv = tpe.sum(0).view(R, B).sum(1)
    moon_recv = res.group.alloc_ER.long().sum(0)
    redundant, moved = (int(v) for v in replication_cost(res.group.alloc_ER))
    remote_entries_base = 0
    remote_rows_moon = remote_entries_moon = 0
    for r, (tk, p) in enumerate(zip(topk_per_rank, res.plans)):
        remote_entries_base += int((tk.long() // B != r).sum())
        remote = p.dest_rank != r
        remote_entries_moon += int(remote.sum())
        remote_rows_moon += int((remote & p.is_primary).sum())
    cnt = tpe.sum(0).double()
    return dict(
        maxvio=float(cnt.max() / cnt.mean() - 1),
        base_recv=base_recv.tolist(),
        moonep_recv=moon_recv.tolist(),
        redundant=redundant,
        moved_copies=moved,
        base_token_bytes=4 * remote_entries_base * D * elem_bytes,
        moonep_token_bytes=2 * (remote_rows_moon + remote_entries_moon) * D * elem_bytes,
        moonep_weight_bytes=redundant * 3 * D * F * (2 * elem_bytes + 4),
    )
