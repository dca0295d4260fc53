"""Shapes: the static sizes of an EP group (the legend: docs/architecture.md#shape-legend).

Every tensor name ends in its shape, one letter per dimension (torchtitan style), each letter
with one meaning everywhere: the one legend is docs/architecture.md#shape-legend.

Why NvS = align_up(S*K + (tp-1)*G, tp): every rank receives exactly its cap (<= S*K) token copies,
spread over at most G non-empty segments (B home + at most B redundant experts, the theorem of
docs/planner.md), and each segment wastes at most tp-1 padding rows.  With a slack (policy
"cost", eps > 0) a rank receives at most slack_cap(S*K) copies, so S*K becomes slack_cap(S*K)
there (and ceil(T/R) becomes slack_cap(ceil(T/R)) in nvs_s); eps = 0 leaves both unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

# Fake kernels under dynamic shapes see SymInts where eager code sees ints.
_INT = (int, torch.SymInt)


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


PPM = 1_000_000          # slack_ppm units: parts per million


def slack_cap(copies, slack_ppm: int):
    """ceil(copies * (1 + slack_ppm / 1e6)) in integer arithmetic (ints or SymInts)."""
    return ceil_div(copies * (PPM + slack_ppm), PPM)


def slack_to_ppm(slack) -> int:
    """The slack eps (a float in [0, 1]) as the integer parts per million the planner takes."""
    if isinstance(slack, bool) or not isinstance(slack, (int, float)):
        raise TypeError(f"slack must be a float in [0, 1], got {type(slack).__name__}")
    if not 0.0 <= slack <= 1.0:
        raise ValueError(f"slack must lie in [0, 1], got {slack!r}")
    return int(round(slack * PPM))


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
    slack_ppm: int = 0          # cap slack of policy "cost" (parts per million, 0..PPM)

    def __post_init__(self):
        for name in ("R", "E", "S", "K", "token_padding"):
            v = getattr(self, name)
            if not isinstance(v, _INT) or isinstance(v, bool):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if not isinstance(self.slack_ppm, _INT) or isinstance(self.slack_ppm, bool):
            raise TypeError(f"slack_ppm must be an int, got {type(self.slack_ppm).__name__}")
        if not 0 <= self.slack_ppm <= PPM:
            raise ValueError(f"slack_ppm must lie in [0, {PPM}] (a slack of 0 to 100 %), "
                             f"got {self.slack_ppm}")
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
        return align_up(self.max_receive(self.S * self.K) + (tp - 1) * self.G, tp)

    def max_receive(self, even_cap):
        """The most token copies one rank may receive when the even share is ``even_cap``
        copies (ceil(T/R)): even_cap itself, or slack_cap(even_cap) with a slack."""
        return slack_cap(even_cap, self.slack_ppm) if self.slack_ppm else even_cap

    def total_tokens(self, s: int, total_num_tokens: int | None) -> int:
        """Total tokens over the group this call (uniform s unless total_num_tokens is given;
        None or -1, the ops' spelling of None, mean uniform)."""
        uniform = total_num_tokens is None or total_num_tokens == -1
        return self.R * s if uniform else total_num_tokens

    def nvs_s(self, s: int, total_num_tokens: int | None = None) -> int:
        """Receive rows this call: align_up(ceil(T/R) + (tp-1)*2*epn, tp), T = total*K, with
        ceil(T/R) raised by the slack (``max_receive``).  Works on SymInts (the fake kernels
        call it)."""
        T = self.total_tokens(s, total_num_tokens) * self.K
        tp = self.token_padding
        return align_up(self.max_receive(ceil_div(T, self.R)) + (tp - 1) * self.G, tp)

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


MAX_REPLICA_COST = 1 << 40     # keeps the planner's int64 scores far from overflow


def check_cost_args(policy: str, slack_ppm: int, replica_cost: int) -> None:
    """The slack and replica cost are inputs of policy "cost" only (ints, in range)."""
    for name, v in (("slack_ppm", slack_ppm), ("replica_cost", replica_cost)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if not 0 <= slack_ppm <= PPM:
        raise ValueError(f"slack_ppm must lie in [0, {PPM}], got {slack_ppm}")
    if not 0 <= replica_cost < MAX_REPLICA_COST:
        raise ValueError(f"replica_cost must lie in [0, 2^40) token copies, got {replica_cost}")
    if policy != "cost" and (slack_ppm or replica_cost):
        raise ValueError(f"a slack and a replica cost are inputs of policy 'cost' only; policy "
                         f"{policy!r} plans exact caps (got slack_ppm={slack_ppm}, "
                         f"replica_cost={replica_cost})")


_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class GroupSpec(Geometry):
    """Everything about one EP group that must be the same on every rank: the geometry plus the
    model dim, the token dtype, the planner policy (with the slack and the replica cost of
    policy "cost") and the backend kind.  A Buffer's backend is bound to one; its
    :meth:`fingerprint` is compared across ranks when the Buffer is built."""

    D: int = 1
    dtype: torch.dtype = torch.bfloat16
    policy: str = "moonep"
    backend: str = ""
    replica_cost: int = 0       # policy "cost": one replica's transfer time in token copies

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.D, int) or isinstance(self.D, bool) or self.D < 1:
            raise ValueError(f"the model dim D must be a positive int, got {self.D!r}")
        if self.dtype not in _DTYPES:
            raise TypeError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        check_cost_args(self.policy, self.slack_ppm, self.replica_cost)

    FINGERPRINT_FIELDS = ("R", "E", "S", "K", "D", "token_padding", "dtype", "policy", "backend",
                          "slack_ppm", "replica_cost")

    def fingerprint(self) -> tuple:
        """The settings every rank must share, as plain Python values (exchanged with
        all_gather_object when a Buffer is built)."""
        return tuple(str(v) if isinstance(v, torch.dtype) else v
                     for v in (getattr(self, n) for n in self.FINGERPRINT_FIELDS))


REJECTED = "moonep: rejected"


def rejection(reason: str) -> tuple:
    """What a rank whose Buffer arguments failed a local check sends in place of its
    fingerprint: it still takes part in the exchange, so no peer is left waiting in it."""
    return (REJECTED, str(reason))


def _check_agreement(fingerprints: Sequence[Sequence], fields: Sequence[str], who: str,
                     args: str, not_built: str, malformed, agree: str) -> None:
    """The same ValueError on every rank (each holds every rank's fingerprint, in rank order):
    naming a rank that sent a :func:`rejection` (its ``args`` arguments) and its reason first,
    then a rank whose fingerprint is not one of ``fields`` (``malformed(f)``: why, "" when it
    is), then the first field the ranks disagree on and every rank's value."""
    for r, f in enumerate(fingerprints):
        if len(f) == 2 and f[0] == REJECTED:
            raise ValueError(f"{who}: rank {r} rejected its {args} arguments ({f[1]}); {not_built}")
    for r, f in enumerate(fingerprints):
        why = malformed(f)
        if why:
            raise ValueError(f"{who}: rank {r} {why}")
    for i, name in enumerate(fields):
        vals = [f[i] for f in fingerprints]
        if any(v != vals[0] for v in vals):
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(vals))
            raise ValueError(f"{who}: the ranks disagree on {name} ({shown}); {agree}")


def check_fingerprints(fingerprints: Sequence[Sequence]) -> None:
    """Raise the same ValueError on every rank when the ranks' fingerprints differ
    (``fingerprints``: every rank's :meth:`GroupSpec.fingerprint` in rank order, as every rank
    receives them), naming the first field that differs and every rank's value.  A rank that
    sent a :func:`rejection` is named first, with its reason."""
    n = len(GroupSpec.FINGERPRINT_FIELDS)
    _check_agreement(
        fingerprints, GroupSpec.FINGERPRINT_FIELDS, "moonep Buffer", "Buffer",
        "no rank of the group built its Buffer",
        lambda f: "" if len(f) == n else (f"sent a fingerprint of {len(f)} fields, this rank "
                                          f"expects {n} (different moonep_ops versions?)"),
        "every rank of an EP group must build its Buffer with the same R, E, S, K, D, "
        "token_padding, dtype, policy, backend, slack and replica cost")


# The expert pools of a Buffer: per layer shape and precision, compared when each layer binds
# (Buffer.expert_pool).  Precision and pow2 scales are settings of a layer, not of its Buffer
# (layers of several precisions may share one Buffer), but they change the bytes of every
# dispatched row and the tensors prefetch_weight / reduce_grad move: every rank's layers must
# agree on them, or the all-to-alls would move rows of different sizes.
# The layer's expert settings beside them (EXPERT_SETTINGS, in that order): expert biases change
# the tensors prefetch_weight / reduce_grad move (a rank without them would hang or abort the
# exchange), the activation and fp8_wgrad change the math of the slot experts' grads that
# reduce_grad adds into their owners' (silently mixed results otherwise).
EXPERT_SETTINGS = "(expert_bias, activation, swiglu_alpha, swiglu_limit, fp8_wgrad)"
POOL_FINGERPRINT_FIELDS = ("what", "D", "F", "dtype", "precision", "pow2_scales",
                           "expert settings " + EXPERT_SETTINGS)
_POOL = "moonep expert pool"


def expert_settings(expert_bias: bool, activation: str, swiglu_alpha: float,
                    swiglu_limit: float, fp8_wgrad: bool) -> tuple:
    """A layer's EXPERT_SETTINGS as the ranks compare them: alpha and limit only where the
    activation reads them (the clamped SwiGLU), so an unread value is no disagreement."""
    clamp = (swiglu_alpha, swiglu_limit) if activation == "swiglu_clamped" else (None, None)
    return (expert_bias, activation, *clamp, fp8_wgrad)


def pool_fingerprint(D: int, F: int, dtype: torch.dtype, precision: str,
                     pow2_scales: bool, expert_settings: tuple = ()) -> tuple:
    """What every rank must share for one ``Buffer.expert_pool`` call, as plain values."""
    return (_POOL, D, F, str(dtype), precision, pow2_scales, tuple(expert_settings))


def check_pool_fingerprints(fingerprints: Sequence[Sequence]) -> None:
    """The same ValueError on every rank when the ranks' pool fingerprints (every rank's, in
    rank order) differ, naming the first field that differs and every rank's value; a rank that
    sent a :func:`rejection` is named first, with its reason."""
    n = len(POOL_FINGERPRINT_FIELDS)
    _check_agreement(
        fingerprints, POOL_FINGERPRINT_FIELDS, "moonep Buffer.expert_pool", "expert pool",
        "no rank built the pool",
        lambda f: "" if len(f) == n and f[0] == _POOL else (
            f"is not building an expert pool (it sent {f!r}): every rank binds the same layers "
            "in the same order"),
        "every rank of an EP group builds the same expert pools: its MoE layers' D, F, dtype, "
        "precision, fp8_pow2_scales and expert settings must match across the group")
