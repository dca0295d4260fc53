"""Argument checks of the planner: shapes, dtypes, devices and ints (no data reads), and the
value checks that read the histograms (on CUDA a sync: run when validation is on,
runtime.should_validate)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..geometry import Geometry, check_cost_args
from .reference import POLICIES


def check_int_tensor(name: str, t, ndim: Optional[int] = None) -> None:
    """``t`` is an int32 tensor (of ``ndim`` dimensions when given)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_plan_args(tpe_RE: Tensor, topk_sK: Tensor, rank: int, R: int, S: int,
                    token_padding: int, total_num_tokens: Optional[int], policy: str,
                    slack_ppm: int = 0, replica_cost: int = 0) -> tuple[Geometry, int]:
    """Shape/dtype/device/int checks (no data reads).  Returns (geometry, s)."""
    check_int_tensor("tokens_per_expert (gathered [R, E])", tpe_RE, 2)
    check_int_tensor("topk_ids [s, K]", topk_sK, 2)
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
