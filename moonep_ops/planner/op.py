"""The op ``moonep::plan`` (schema, implementation on the reference planner, fake kernel) and
the Python API: ``plan`` (one rank, through the op) and ``plan_all_ranks`` (the whole group in
one process, steps 1-3 once).  The op's outputs, per rank (int32, shapes as in docs/planner.md):

  dst_N              [N]      slot of every entry: d*NvS + loff on destination rank d (loff: the
                              row in d's expert-grouped receive buffer).  The second and later
                              entries of one token bound for the same d are stored as
                              -(d*NvS + loff) - 1: they own a slot (and a route-weight slot) but
                              their row is filled on d by a local copy of the first one.
  cu_seqlens_G       [G]      inclusive end offsets of this rank's 2*epn segments (0..epn-1:
                              home experts, epn..: redundant slots)
  experts_to_copy_RB [R, B]   global table, identical on every rank: slot b of rank d runs
                              expert experts_to_copy[d, b] (ascending ids, -1 padded right)
  zero_fill_G2       [G, 2]   (first row, rows) of each segment's padding, (0, 0) if none
  remote_stats_2     [2]      (redundant experts this rank runs, slots elsewhere holding one of
                              this rank's home experts)
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .. import runtime
from ..geometry import Geometry
from .checks import check_int_tensor, check_plan_args, check_plan_values
from .reference import GroupPlan, assign_slots, plan_group


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
def plan_op(tpe_RE: Tensor, topk_sK: Tensor, rank: int, R: int, S: int, token_padding: int,
             total_num_tokens: int, policy: str, slack_ppm: int = 0, replica_cost: int = 0
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    total = _total(total_num_tokens)
    geo, s = check_plan_args(tpe_RE, topk_sK, rank, R, S, token_padding, total, policy,
                             slack_ppm, replica_cost)
    if runtime.should_validate(tpe_RE):
        check_plan_values(tpe_RE, topk_sK, rank, geo, s, total)
    gp = plan_group(tpe_RE, geo.total_tokens(s, total) * geo.K, token_padding, policy,
                    slack_ppm, replica_cost)
    return _rank_outputs(gp, tpe_RE, topk_sK, rank, geo.NvS)


def _rank_outputs(gp: GroupPlan, tpe_RE: Tensor, topk_sK: Tensor, rank: int, NvS: int
                  ) -> tuple[Tensor, ...]:
    """Step 4 for one rank of a group plan: the op's five outputs, int32 and contiguous (the
    fake kernel's strides)."""
    lay = gp.layout
    dst_N, _, _ = assign_slots(topk_sK, tpe_RE.long(), rank, gp.alloc_ER, lay.expert_off_RE, NvS)
    out = (dst_N, lay.cu_seqlens_RG[rank], lay.experts_to_copy_RB, lay.zero_fill_RG2[rank],
           lay.remote_stats_R2[rank])
    return tuple(t.to(torch.int32).contiguous() for t in out)


@plan_op.register_fake
def _plan_fake(tpe_RE, topk_sK, rank, R, S, token_padding, total_num_tokens, policy,
               slack_ppm=0, replica_cost=0):
    geo, s = check_plan_args(tpe_RE, topk_sK, rank, R, S, token_padding,
                             _total(total_num_tokens), policy, slack_ppm, replica_cost)
    N = s * geo.K
    new = lambda *shape: tpe_RE.new_empty(shape, dtype=torch.int32)   # noqa: E731
    return new(N), new(geo.G), new(R, geo.epn), new(geo.G, 2), new(2)


def decode_raw_dst(dst_N: Tensor) -> Tensor:
    """The one decode of the planner's dst: [N] int64 slots (rank * NvS + row), the duplicate
    marking (a non-primary copy is stored as -slot - 1) undone."""
    d = dst_N.long()
    return torch.where(d < 0, -d - 1, d)


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
        return decode_raw_dst(self.dst)

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
    return make_plan(outs, geo, rank, topk_ids_sK.shape[0], total_num_tokens)


def make_plan(outs, geo: Geometry, rank: int, s: int, total_num_tokens: Optional[int]) -> Plan:
    """The one constructor of a ``Plan``: moonep::plan's (or a dispatch op's) five plan tensors
    and the ints of ``geo`` (a Geometry or the Buffer's GroupSpec), for ``s`` tokens on ``rank``
    (``total_num_tokens`` None or -1: every rank passes s)."""
    return Plan(*outs, rank=rank, R=geo.R, E=geo.E, S=geo.S, K=geo.K, s=s,
                token_padding=geo.token_padding,
                total_num_tokens=-1 if total_num_tokens is None else total_num_tokens,
                NvS=geo.NvS, nvs_s=geo.nvs_s(s, total_num_tokens), slack_ppm=geo.slack_ppm)


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
        check_int_tensor(f"topk_per_rank[{r}]", t, 2)
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
    plans = [make_plan(_rank_outputs(gp, tpe_RE, tk[r], r, geo.NvS), geo, r, sizes[r],
                        total_num_tokens) for r in range(R)]
    return GroupResult(plans, gp, tpe_RE)
