"""What the planner's cost policy predicts: the experts' grouped GEMMs (cost_model.py, at the
config the device selector picks) and the replicas' bytes over the link (links.py).

One MoE layer's training step, per rank (moonep_ops/ops/moe_experts.py):
  GEMMs      fwd gate, up [F, D] and down [D, F]; backward dgrad of the three and wgrad of the
             three (bf16 out: the cost model's "wgrad_lp"), all over the rank's G segments;
  replicas   each redundant slot's weights (3*D*F elements) are pushed by their owner before the
             forward GEMMs and again before the backward ones (the pool is shared by the
             layers, so the backward re-stages it), and the slot's grads (3*D*F, in the weights'
             dtype) are pulled back by the owner after the wgrads.
A link is one GPU's NVLink in one direction; the pushes out of an owner share its egress, the
pushes into a receiver its ingress (grads run the other way).  So a step's replica traffic
takes  max_r max(replicas of r's experts elsewhere, slots on r) * replica_bytes / link_bw.

  layer time = max_r gemm_r(segment rows) + busiest link's replicas * replica_bytes / link_bw

Token rows (dispatch and combine) are not counted: they move the same copies whatever the plan;
only which rank receives them changes (docs/planner.md, "What is not modelled").

The planner itself runs on the device with no host reads, so it cannot evaluate the cost model
per candidate: it uses one integer, ``replica_cost`` = one replica's link time in units of one
token copy's GEMM time (the slope of gemm_r in the rank's copies, fitted here on the host from
the static shapes only).  Its score of a plan is max_r copies_r + replica_cost * busiest link.
Since both a copy's FLOPs and a replica's bytes scale with D*F, the ratio is nearly shape-free:
~PEAK * eta / LINK (about 1,600 copies on the H200 in training).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..geometry import align_up
from . import cost_model, links
from . import tuning as gemm_tuning


def expert_gemms(D: int, F: int, training: bool = True) -> list[tuple[str, int, int]]:
    """(kind, O, I) of one layer's expert GEMMs: fwd gate, up, down; with training also their
    dgrads and (bf16-out) wgrads.  [O, I] is the weight's shape for every kind."""
    shapes = [(F, D), (F, D), (D, F)]
    kinds = ("fwd", "dgrad", "wgrad_lp") if training else ("fwd",)
    return [(k, O, I) for k in kinds for (O, I) in shapes]


@functools.lru_cache(maxsize=1 << 16)
def _selected_us(counts: tuple, O: int, I: int, kind: str, sm_count: Optional[int]) -> float:
    c = np.asarray(counts, dtype=np.int64)
    if not c.any():
        return 0.0
    rows, G = int(c.sum()), len(c)
    names = cost_model.candidates(kind, rows, G)
    pred = cost_model.predict(c, O, I, kind, sm_count=sm_count, configs=names)
    vol = {n: cost_model.mma_volume(c, O, I, kind, n) for n in pred}
    return pred[cost_model.pick(pred, vol, kind, cost_model.tie_tolerance(kind, rows, G))]


def expert_gemm_us(counts: Sequence[int], D: int, F: int, *, training: bool = True,
                   sm_count: Optional[int] = None) -> float:
    """Predicted µs of one rank's expert GEMMs over segments of ``counts`` rows (padding
    included), each GEMM at the config the device selector picks.  0 for a rank with no rows."""
    key = tuple(int(x) for x in counts)
    return sum(_selected_us(key, O, I, k, sm_count) for k, O, I in expert_gemms(D, F, training))


def replica_bytes(D: int, F: int, dtype: torch.dtype = torch.bfloat16, *,
                  training: bool = True) -> int:
    """Bytes one replica moves over the link in one step: its weights (3*D*F elements) pushed
    once per pass (forward, and the backward's re-stage), its grads pulled once (training)."""
    w = 3 * D * F * torch.empty((), dtype=dtype).element_size()
    return 3 * w if training else w


def link_us(busiest: int, D: int, F: int, dtype: torch.dtype = torch.bfloat16, *,
            link_gbps: Optional[float] = None, training: bool = True) -> float:
    """µs the replicas of a step take on the busiest link (``busiest`` replicas through it)."""
    bw = float(links.LINK_GBPS if link_gbps is None else link_gbps)
    if bw == float("inf"):
        return 0.0
    return busiest * replica_bytes(D, F, dtype, training=training) / (bw * 1e3)


def copy_us(D: int, F: int, *, B: int, cap: int, token_padding: int = 1, training: bool = True,
            sm_count: Optional[int] = None) -> float:
    """µs one more token copy adds to a rank's expert GEMMs around a load of ``cap`` copies over
    its B home segments: the least-squares slope of expert_gemm_us against the segments' padded
    rows, over loads 0.5..1.5 cap (a copy adds one padded row on average; fitting on padded
    rows keeps the padding's staircase out of the slope).  The segments get unequal shares (a
    ramp 1..2) so that their tile steps do not coincide."""
    w = 1.0 + np.arange(B) / max(B - 1, 1)
    w /= w.sum()
    xs, ts = [], []
    for L in np.linspace(0.5, 1.5, 21) * max(cap, 1):
        rows = np.floor(w * L).astype(np.int64)
        rows[-1] += int(round(L)) - int(rows.sum())
        segs = [align_up(int(r), token_padding) if r else 0 for r in rows]
        xs.append(sum(segs))
        ts.append(expert_gemm_us(segs, D, F, training=training, sm_count=sm_count))
    x = np.asarray(xs, dtype=np.float64)
    x -= x.mean()
    y = np.asarray(ts, dtype=np.float64)
    var = float(x @ x)
    slope = float(x @ (y - y.mean())) / var if var > 0 else 0.0
    if not slope > 0:     # a shape too small for the model to resolve: the FLOP rate instead
        flops = 2 * 3 * D * F * (3 if training else 1)
        slope = flops / (float(gemm_tuning.PEAK_TFLOPS) * 1e6)
    return slope


@dataclass(frozen=True)
class ReplicaCost:
    """A replica's transfer time against a token copy's GEMM time (``copies`` is the planner's
    integer input, ``round(us_per_replica / us_per_copy)``)."""
    us_per_copy: float
    us_per_replica: float
    copies: int
    link_gbps: float


def replica_cost(D: int, F: int, *, R: int, E: int, S: int, K: int, token_padding: int = 1,
                 dtype: torch.dtype = torch.bfloat16, link_gbps: Optional[float] = None,
                 training: bool = True) -> ReplicaCost:
    """The cost policy's constants for a Buffer's static shapes (no data): a rank at its cap
    S*K copies over its B = E/R home experts.  ``link_gbps`` None: links.LINK_GBPS; inf makes
    replication free (replica_cost 0: the plan is MoonEP's)."""
    bw = float(links.LINK_GBPS if link_gbps is None else link_gbps)
    if not bw > 0:
        raise ValueError(f"link_gbps must be > 0, got {link_gbps!r}")
    beta = copy_us(D, F, B=max(E // R, 1), cap=S * K, token_padding=token_padding,
                   training=training)
    rep = link_us(1, D, F, dtype, link_gbps=bw, training=training)
    return ReplicaCost(beta, rep, int(round(rep / beta)), bw)


# ---------------------------------------------------------------------------------------------
# A plan's predicted step time (benchmarks/planner_cost_table.py)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanTime:
    gemm_us: float          # the slowest rank's expert GEMMs
    link_us: float          # the replicas' weights and grads on the busiest link
    replicas: int           # redundant slots in use over the group
    busiest: int            # replicas through the busiest link
    moved: int              # token copies computed off their home rank
    wire_bytes: int         # replica bytes over all links in one step

    @property
    def total_us(self) -> float:
        return self.gemm_us + self.link_us


def _home_alloc(alloc_ER: torch.Tensor, plain: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(alloc [E, R] int64 on the CPU, home rank of each expert [E], away mask [E, R]: copies of
    e computed on a rank other than its home).  ``plain``: every expert at home."""
    a = alloc_ER.long().cpu()
    E, R = a.shape
    home = torch.arange(E) // (E // R)
    if plain:
        a = torch.zeros_like(a)
        a[torch.arange(E), home] = alloc_ER.long().cpu().sum(1)
    away = (a > 0) & (home[:, None] != torch.arange(R)[None, :])
    return a, home, away


def rank_segments(alloc_ER: torch.Tensor, d: int, *, token_padding: int = 1,
                  plain: bool = False) -> tuple[list[int], list[int]]:
    """Rank d's GEMM segments under a plan: (its B home experts' rows, its slots' rows in
    ascending expert id), each padded to ``token_padding`` (0 stays 0)."""
    a, _, away = _home_alloc(alloc_ER, plain)
    B = a.shape[0] // a.shape[1]
    rows = a[:, d]
    pad = [align_up(int(c), token_padding) if c else 0 for c in rows[d * B:(d + 1) * B].tolist()]
    return pad, [align_up(int(c), token_padding) if c else 0 for c in rows[away[:, d]].tolist()]


def plan_time(alloc_ER: torch.Tensor, D: int, F: int, *, token_padding: int = 1,
              dtype: torch.dtype = torch.bfloat16, link_gbps: Optional[float] = None,
              training: bool = True, sm_count: Optional[int] = None,
              plain: bool = False) -> PlanTime:
    """Predicted time of a plan's allocation ``alloc[e, d]`` (token copies of e computed on d).
    Each rank's segments: its home experts, then its slots (the experts of other ranks it runs),
    padded to ``token_padding`` (``rank_segments``).  ``plain``: plain EP, every expert at home,
    no replicas."""
    a, _, away = _home_alloc(alloc_ER, plain)
    E, R = a.shape
    B = E // R
    out_R = away.view(R, B, R).sum((1, 2))
    in_R = away.sum(0)
    busiest = int(torch.maximum(out_R, in_R).max())
    worst = 0.0
    for d in range(R):
        home_rows, slot_rows = rank_segments(a, d, token_padding=token_padding)
        worst = max(worst, expert_gemm_us(home_rows + slot_rows, D, F, training=training,
                                          sm_count=sm_count))
    n = int(away.sum())
    return PlanTime(worst, link_us(busiest, D, F, dtype, link_gbps=link_gbps, training=training),
                    n, busiest, int((a * away).sum()),
                    n * replica_bytes(D, F, dtype, training=training))
