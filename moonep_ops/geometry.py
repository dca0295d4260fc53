"""Buffer geometry: every static size in moonep_ops is a function of Python ints only.

Legend (used as shape suffixes across the package, torchtitan style):
  R   EP ranks              E    routed experts           B = epn = E // R  home experts per rank
  G   2*epn segments        S    token capacity per rank   s    tokens this call (1 <= s <= S)
  K   top-k                 N    s*K entries of one rank   H    hidden size
  tp  token_padding         NvS  receive rows of a rank at capacity
  nvs_s  receive rows this call (depends on the *total* token count, not on this rank's s)

Why NvS = align_up(S*K + (tp-1)*2*epn, tp): every rank receives exactly its cap (<= S*K) token
copies, spread over at most 2*epn non-empty segments (epn local + at most epn redundant experts,
the theorem of docs/planner.md), and each segment wastes at most tp-1 padding rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Fake kernels under dynamic shapes see SymInts where eager code sees ints.
_INT = (int, torch.SymInt)


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def receive_caps(total_entries: int, R: int) -> list[int]:
    """Per-rank receive targets: floor/ceil split of the total, the first T mod R ranks get one more."""
    base, extra = divmod(total_entries, R)
    return [base + (1 if r < extra else 0) for r in range(R)]


@dataclass(frozen=True)
class Geometry:
    """Static sizes of one EP group.  All fields are Python ints (safe for fake kernels)."""

    R: int
    E: int
    S: int
    K: int
    token_padding: int = 1

    def __post_init__(self):
        for name in ("R", "E", "S", "K", "token_padding"):
            v = getattr(self, name)
            if not isinstance(v, _INT) or isinstance(v, bool):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.E % self.R:
            raise ValueError(f"num_experts E={self.E} must be divisible by the EP size R={self.R}")
        if self.K > 127:
            raise ValueError(f"top-k K={self.K} > 127 is not supported")
        if self.R * self.NvS >= 2**31:
            raise ValueError(f"R*NvS = {self.R * self.NvS} does not fit in int32 slot encoding")

    @property
    def epn(self) -> int:
        return self.E // self.R

    @property
    def G(self) -> int:
        return 2 * self.epn

    @property
    def NvS(self) -> int:
        tp = self.token_padding
        return align_up(self.S * self.K + (tp - 1) * self.G, tp)

    def total_tokens(self, s: int, total_num_tokens: int | None) -> int:
        """Total tokens over the group this call (uniform s unless total_num_tokens is given)."""
        return self.R * s if total_num_tokens is None else total_num_tokens

    def nvs_s(self, s: int, total_num_tokens: int | None = None) -> int:
        """Receive rows this call: align_up(ceil(T/R) + (tp-1)*2*epn, tp), T = total*K."""
        T = self.total_tokens(s, total_num_tokens) * self.K
        tp = self.token_padding
        return align_up(ceil_div(T, self.R) + (tp - 1) * self.G, tp)

    def check_s(self, s: int, total_num_tokens: int | None = None) -> None:
        if not isinstance(s, _INT) or isinstance(s, bool):
            raise TypeError(f"s must be an int, got {type(s).__name__}")
        if not 1 <= s <= self.S:
            raise ValueError(f"s={s} tokens is outside [1, S={self.S}] (the buffer capacity)")
        if total_num_tokens is not None:
            if not isinstance(total_num_tokens, int) or isinstance(total_num_tokens, bool):
                raise TypeError("total_num_tokens must be an int or None")
            if not s <= total_num_tokens <= self.R * self.S:
                raise ValueError(
                    f"total_num_tokens={total_num_tokens} must lie in [s={s}, R*S={self.R * self.S}]")
