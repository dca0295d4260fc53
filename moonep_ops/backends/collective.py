"""Backends built on two message primitives: ``all_gather`` and ``all_to_all_v``.

``CollectiveBackend`` implements the whole contract (moonep_ops/backends/base.py) from them; its
subclasses supply the primitives:

  TorchDistBackend   a torch.distributed process group: gloo (CPU tensors) or NCCL (CUDA tensors)
  SingleRankBackend  R = 1: the primitives are local copies, nothing is communicated

Split sizes are read on the host (``tolist``): fine on CPU and in eager CUDA code, but these
backends cannot run inside CUDA-graph capture and say so (``_no_capture``; ``capturable`` is
False).  Every collective is issued by every rank in the same order with the same count, whatever
the routing (split sizes may be zero), so a rank's bad input makes every rank raise instead of
leaving its peers inside a collective.

The first collective of every op carries a rejection flag (``reject``: a rank whose arguments
failed a check takes part in it flagged, and every rank raises) and what the ranks must agree
on (``_settle``, ``_agree``):

  op                   first collective                     carries
  dispatch(_fp8)       all_gather [E + 4] int64             histogram, flag, s, total, row format
  dispatch_with_plan   all_to_all of the counts [R, 3]      counts, flag
  combine              all_to_all of the counts [R, 2]      counts, flag
  prefetch_weight,     all_gather [4] int64 (one more        flag, op, tensors, bytes an expert
  reduce_grad          collective than the data needs)

The row format (Buffer dtype, FP8, FP8 with pow2 scales) and the prefetch / reduce header
catch ranks whose layers differ in precision (their rows or slot tensors differ in bytes): the
same ValueError on every rank instead of an all-to-all of mismatched sizes (gloo aborts the
process).  A flagged exchange costs one ``all_gather_object`` more (every rank learns the
reason); the agreeing path costs nothing more but the prefetch / reduce header.

Shape legend: moonep_ops/geometry.py.
"""
from __future__ import annotations

import abc
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..geometry import GroupSpec
from .. import planner as _plan
from .base import Backend, DispatchFP8Result


# The format of the rows a dispatch moves, agreed on in its histogram exchange.
ROWS_DTYPE, ROWS_FP8, ROWS_FP8_POW2 = 0, 1, 2
ROW_FORMATS = {ROWS_DTYPE: "rows in the Buffer's dtype (dispatch)",
               ROWS_FP8: "FP8 rows (dispatch_fp8)",
               ROWS_FP8_POW2: "FP8 rows with pow2 scales (dispatch_fp8, pow2_scales=True)"}
# Which collective an op starts with (``CollectiveBackend.reject``).
FIRST_COLLECTIVE = {"dispatch": "plan", "dispatch_fp8": "plan", "dispatch_with_plan": "scatter",
                    "combine": "combine", "prefetch_weight": "slots", "reduce_grad": "slots"}
_SLOT_OPS = ("prefetch_weight", "reduce_grad")


def decode_dst(dst_N: Tensor, NvS: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dest rank, row on dest, is_primary) of every entry, int64/bool, from the planner's dst."""
    raw = _plan.decode_raw_dst(dst_N)
    return raw // NvS, raw % NvS, dst_N >= 0


def _row_bytes(t: Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _as_bytes(t: Tensor) -> Tensor:
    """[n, ...] contiguous tensor -> [n, bytes per row] uint8 view (bit-exact transport)."""
    if t.numel() == 0:
        return t.new_empty((t.shape[0], _row_bytes(t)), dtype=torch.uint8)
    return t.reshape(t.shape[0], -1).view(torch.uint8)


class CollectiveBackend(Backend):
    """The data plane on top of ``all_gather`` and ``all_to_all_v`` (split sizes on the host)."""

    supports_fp8_dispatch = True      # rows move as bytes: e4m3 rows and their scales together

    # -- primitives ---------------------------------------------------------------------------
    @abc.abstractmethod
    def all_gather(self, t: Tensor) -> Tensor:
        """[n] -> [R, n]."""

    @abc.abstractmethod
    def all_to_all_v(self, out: Tensor, inp: Tensor, out_splits: list[int],
                     in_splits: list[int]) -> None:
        """Row-wise all-to-all: inp rows [sum in_splits] -> out rows [sum out_splits]."""

    @staticmethod
    def _no_capture(t: Tensor) -> None:
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "moonep: the torch.distributed backend reads split sizes on the host and cannot "
                "be captured in a CUDA graph; use the CUDA symmetric-memory backend "
                "(Buffer(..., backend='symm'), the default on GPUs when libmoonep_ep.so is built)")

    def _exchange_counts(self, counts_RC: Tensor) -> Tensor:
        """counts[d, :] sent to rank d -> received[src, :] from every src (int64 [R, C])."""
        out = torch.empty_like(counts_RC)
        R = self.world_size
        self.all_to_all_v(out, counts_RC, [1] * R, [1] * R)
        return out

    def _a2a_bytes(self, out_rows: Tensor, inp: Tensor, out_splits, in_splits) -> None:
        self.all_to_all_v(_as_bytes(out_rows), _as_bytes(inp), out_splits, in_splits)

    @abc.abstractmethod
    def all_gather_object(self, obj) -> list:
        """Every rank's picklable ``obj``, in rank order (host, set-up only)."""

    # -- lifecycle ----------------------------------------------------------------------------
    def exchange_fingerprints(self, fingerprint):
        return self.all_gather_object(fingerprint)

    def _allocate(self, spec: GroupSpec) -> None:
        # Landing areas of the all-to-alls, sized for a rank's cap: never R*S*K rows.
        NvS, dev = spec.NvS, self.device
        self.recv_rows = torch.zeros((NvS, spec.D), dtype=spec.dtype, device=dev)
        self.recv_meta = torch.zeros((NvS, 3), dtype=torch.long, device=dev)
        self.recv_weights = torch.zeros((NvS,), dtype=torch.float32, device=dev)

    def release(self) -> None:
        self.recv_rows = self.recv_meta = self.recv_weights = None

    def symmetric_zeros(self, shape, dtype):
        return torch.zeros(tuple(shape), dtype=dtype, device=self.device)

    # -- rejections and agreement ----------------------------------------------------------------
    def reject(self, op, reason):
        kind = FIRST_COLLECTIVE.get(op)
        if kind is None:
            raise ValueError(f"moonep: no op {op!r} to reject (one of {tuple(FIRST_COLLECTIVE)})")
        if kind == "plan":
            E = self.spec.E
            hist = torch.zeros(E, dtype=torch.long, device=self.device)
            flags = self._gather_plan_rows(hist, 1, 0, -1, ROWS_DTYPE)[:, E]
        elif kind == "slots":
            flags = self._gather_slot_header(op, 1, 0, 0)[:, 0]
        else:                     # the counts exchange: dispatch_with_plan [R, 3], combine [R, 2]
            width = 3 if kind == "scatter" else 2
            counts = torch.zeros((self.world_size, width), dtype=torch.long, device=self.device)
            counts[:, -1] = 1
            flags = self._exchange_counts(counts)[:, -1]
        self._settle(op, flags.tolist(), reason)

    def _settle(self, op: str, flags: list, reason: str) -> None:
        """After an op's first collective: when a rank flagged a rejection, every rank learns
        every reason (one all_gather_object, on this error path only) and the others raise a
        ValueError naming the first rejecting rank and its reason; a rejecting rank returns
        (its caller raises its own error)."""
        if not any(flags):
            return
        reasons = self.all_gather_object(reason or "")
        if reason:
            return
        r = next(i for i, f in enumerate(flags) if f)
        raise ValueError(f"moonep {op}: rank {r} rejected its input ({reasons[r]}); no rank wrote "
                         "anything")

    @staticmethod
    def _agree(op: str, what: str, values: list, show) -> None:
        """The same ValueError on every rank (every rank holds ``values``, one per rank) when
        the ranks disagree on ``what``."""
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {show(v)}" for r, v in enumerate(values))
            raise ValueError(f"moonep {op}: the ranks disagree on {what} ({shown}); every rank "
                             "must make the same call (its layers' precision and "
                             "fp8_pow2_scales included); nothing was moved")

    def _gather_plan_rows(self, hist_E: Tensor, flag: int, s: int, total: int, fmt: int) -> Tensor:
        """dispatch's first collective: [R, E + 4] int64, every rank's histogram, rejection
        flag, s, total and row format."""
        extra = torch.tensor([flag, s, total, fmt], dtype=torch.long, device=hist_E.device)
        return self.all_gather(torch.cat([hist_E, extra]).contiguous())

    def _gather_slot_header(self, op: str, flag: int, n: int, row_bytes: int) -> Tensor:
        """prefetch_weight's / reduce_grad's first collective: [R, 4] int64 (flag, op, tensors,
        bytes an expert): the all-to-all after it has per-rank sizes that must agree."""
        h = torch.tensor([flag, _SLOT_OPS.index(op), n, row_bytes], dtype=torch.long,
                         device=self.device)
        return self.all_gather(h)

    def _slot_header(self, op: str, local) -> None:
        rb = sum(_row_bytes(t) for t in local)
        head = self._gather_slot_header(op, 0, len(local), rb).tolist()
        self._settle(op, [h[0] for h in head], "")
        self._agree(op, "the call and its tensors (op, how many, bytes an expert: a "
                    "precision-fp8 pool moves 6 tensors, a bf16 one 3)",
                    [tuple(h[1:]) for h in head],
                    lambda v: f"{_SLOT_OPS[v[0]]}, {v[1]} tensors, {v[2]} bytes")

    # -- the data plane ----------------------------------------------------------------------
    def _plan(self, x_sD, topk_sK, total, reject, fmt=ROWS_DTYPE, op="dispatch"):
        # ``fmt``: the rows' format, which every rank must agree on; ``op``: the name errors give
        self._no_capture(x_sD)
        spec = self.spec
        E, s = spec.E, x_sD.shape[0]
        # One all-gather carries the histogram plus (bad-input flag, s, total, row format) of
        # every rank, so a rank with bad input makes every rank raise instead of leaving its
        # peers in a collective, and ranks moving rows of different formats (bytes) raise
        # before the all-to-all.
        hist = torch.bincount(topk_sK.reshape(-1).long().clamp(0, E - 1), minlength=E)
        rows = self._gather_plan_rows(hist, int(bool(reject)), s, total, fmt)
        flags, s_R, tot_R, fmt_R = (list(c) for c in zip(*rows[:, E:].tolist()))
        self._settle(op, flags, f"ValueError: {reject} (rank {self.rank})" if reject else "")
        if reject:
            raise ValueError(f"moonep {op}: {reject} (rank {self.rank})")
        self._agree(op, "the rows' format", fmt_R, ROW_FORMATS.get)
        if len(set(tot_R)) != 1:
            raise ValueError(f"total_num_tokens differs across ranks: {tot_R}")
        if total == -1 and len(set(s_R)) != 1:
            raise ValueError(f"ranks pass different s {s_R}; pass total_num_tokens for per-rank s")
        if total != -1 and sum(s_R) != total:
            raise ValueError(f"total_num_tokens={total} but the ranks pass s={s_R} "
                             f"(sum {sum(s_R)})")
        outs = _plan.plan_from_host_rows(rows[:, :E + 3].contiguous(), topk_sK, self.rank, spec,
                                         total)
        return outs, spec.nvs_s(s, total)

    def dispatch_fp8(self, xq_sD, xs_sC, topk_sK, w_sK, total, reject, pow2_scales=False):
        fmt = ROWS_FP8_POW2 if pow2_scales else ROWS_FP8
        (dst, cu, etc, zf, stats), nvs_s = self._plan(xq_sD, topk_sK, total, reject, fmt,
                                                      "dispatch_fp8")
        # one row of bytes per token: its D e4m3 values, then its ceil(D/128) fp32 scales
        packed = torch.cat([_as_bytes(xq_sD), _as_bytes(xs_sC)], 1)
        hp, w = self._scatter(packed, w_sK, dst, nvs_s, "dispatch_fp8")
        D = xq_sD.shape[1]
        h = hp[:, :D].contiguous().view(xq_sD.dtype)
        hs = hp[:, D:].contiguous().view(xs_sC.dtype)
        return DispatchFP8Result(h, hs, w, cu, dst, etc, zf, stats)

    def _landing(self, n_rows: int, row_bytes: int) -> Tensor:
        """[n_rows, row_bytes] uint8 over the receive area (sized NvS*D*itemsize bytes; a
        narrower row, e.g. an FP8 row with its scales, fits in it)."""
        flat = self.recv_rows.view(-1).view(torch.uint8)
        if n_rows * row_bytes <= flat.numel():
            return flat[:n_rows * row_bytes].view(n_rows, row_bytes)
        return torch.empty((n_rows, row_bytes), dtype=torch.uint8, device=self.device)

    def dispatch_with_plan(self, x_sD, w_sK, dst_N, nvs_s):
        self._no_capture(x_sD)
        return self._scatter(x_sD, w_sK, dst_N, nvs_s, "dispatch_with_plan")

    def _scatter(self, x_sX, w_sK, dst_N, nvs_s, op="dispatch"):
        """Every entry's row x[n // K] (any dtype, moved as bytes) and weight w[n] to its slot:
        fresh (h [nvs_s, X] in x's dtype, w [nvs_s] fp32), rows no entry names zero.  Its
        counts exchange is dispatch_with_plan's first collective: it carries the rejection
        flag (column 2)."""
        R, K, NvS = self.world_size, self.spec.K, self.spec.NvS
        s, X = x_sX.shape
        N = s * K
        dest, loff, primary = decode_dst(dst_N, NvS)
        # The primary of an entry: the first k' of the same token bound for the same rank.
        d_sK = dest.view(s, K)
        first_k = (d_sK[:, :, None] == d_sK[:, None, :]).to(torch.int8).argmax(-1)
        ploff = loff.view(s, K).gather(1, first_k).view(-1)
        if w_sK is None:
            wbits = torch.zeros(N, dtype=torch.long, device=x_sX.device)
        else:
            wbits = w_sK.reshape(-1).view(torch.int32).long()
        order = torch.sort(dest, stable=True).indices           # by destination, then entry
        meta = torch.stack([loff, ploff, wbits], 1).index_select(0, order)   # [N, 3] int64
        p_order = order[primary.index_select(0, order)]          # primaries only, same order
        rows = x_sX.index_select(0, p_order // K)                 # each row once per (t, d)
        send = torch.stack([torch.bincount(dest, minlength=R),
                            torch.bincount(dest[primary], minlength=R),
                            torch.zeros(R, dtype=torch.long, device=dest.device)], 1)
        recv = self._exchange_counts(send)
        send_l, recv_l = send.tolist(), recv.tolist()
        self._settle(op, [r[2] for r in recv_l], "")
        n_meta = sum(r[0] for r in recv_l)
        n_rows = sum(r[1] for r in recv_l)
        if n_meta > nvs_s or n_rows > self.recv_rows.shape[0]:
            raise RuntimeError(f"moonep dispatch: rank {self.rank} would receive {n_meta} entries "
                               f"> nvs_s={nvs_s}: plans of the ranks disagree")
        meta_in = self.recv_meta[:n_meta]
        self.all_to_all_v(meta_in, meta, [r[0] for r in recv_l], [c[0] for c in send_l])
        row_bytes = _row_bytes(x_sX)
        landing = self._landing(n_rows, row_bytes)
        self.all_to_all_v(landing, _as_bytes(rows), [r[1] for r in recv_l],
                          [c[1] for c in send_l])
        rows_in = landing.view(x_sX.dtype) if row_bytes else x_sX.new_empty((n_rows, X))
        # Land in a fresh, zeroed [nvs_s] layout: padding and tail rows are exactly zero.
        r_loff, r_ploff, r_w = meta_in.unbind(1)
        h = x_sX.new_zeros((nvs_s, X))
        w = torch.zeros(nvs_s, dtype=torch.int32, device=x_sX.device)
        w[r_loff] = r_w.to(torch.int32)
        is_p = r_loff == r_ploff
        h[r_loff[is_p]] = rows_in
        dup = ~is_p
        h[r_loff[dup]] = h[r_ploff[dup]]                          # epilogue: local duplication
        return h, w.view(torch.float32)

    def combine(self, h_MD, w_M, dst_N, weighted=False):
        self._no_capture(h_MD)
        R, K, NvS = self.world_size, self.spec.K, self.spec.NvS
        N = dst_N.numel()
        s, D = N // K, h_MD.shape[1]
        dest, loff, _ = decode_dst(dst_N, NvS)
        order = torch.sort(dest, stable=True).indices
        # [R, 2]: the counts and the rejection flag (combine's first collective)
        send = torch.stack([torch.bincount(dest, minlength=R),
                            torch.zeros(R, dtype=torch.long, device=dest.device)], 1)
        recv = self._exchange_counts(send).tolist()
        self._settle("combine", [r[1] for r in recv], "")
        send_l = send[:, 0].tolist()
        recv_l = [r[0] for r in recv]
        n_req = sum(recv_l)
        req = torch.empty(n_req, dtype=torch.long, device=h_MD.device)
        self.all_to_all_v(req, loff.index_select(0, order), recv_l, send_l)
        if n_req and int(req.max()) >= h_MD.shape[0]:
            raise RuntimeError(f"moonep combine: a peer requested row {int(req.max())} of "
                               f"rank {self.rank}'s {h_MD.shape[0]} rows: plans disagree")
        # Reply: the requested rows (plus their fp32 weight bits) back to each requester.
        reply = h_MD.index_select(0, req)
        landing = self.recv_rows[:N]
        self._a2a_bytes(landing, reply, send_l, recv_l)
        rows_N = torch.empty_like(landing)
        rows_N[order] = landing
        rows = rows_N.view(s, K, D)
        w_sK = None
        if w_M is not None:
            w_land = self.recv_weights[:N]
            self.all_to_all_v(w_land, w_M.index_select(0, req), send_l, recv_l)
            w_N = torch.empty_like(w_land)
            w_N[order] = w_land
            w_sK = w_N.view(s, K)
        acc_t = torch.promote_types(h_MD.dtype, torch.float32)    # fp32 (fp64 stays fp64)
        w_acc = w_sK.to(acc_t) if weighted else None

        def term(k):                                              # row k of every token
            r = rows[:, k].to(acc_t)
            return r * w_acc[:, k, None] if weighted else r
        acc = term(0)
        for k in range(1, K):                                     # fixed order k = 0..K-1
            acc = acc + term(k)
        return acc.to(h_MD.dtype), w_sK

    @staticmethod
    def _pack(tensors: Sequence[Tensor], idx: Tensor) -> Tensor:
        """Rows idx of every tensor, as one [len(idx), total bytes] uint8 block."""
        return torch.cat([_as_bytes(t.index_select(0, idx)) for t in tensors], 1)

    @staticmethod
    def _unpack(block: Tensor, tensors: Sequence[Tensor]):
        """Inverse of _pack: one [n, *t.shape[1:]] tensor per entry of tensors."""
        col = 0
        for t in tensors:
            nb = _row_bytes(t)
            yield block[:, col:col + nb].contiguous().view(t.dtype).view(-1, *t.shape[1:])
            col += nb

    def _slot_routes(self, op: str, etc_RB: Tensor, local: Sequence[Tensor]):
        """The start of prefetch_weight and reduce_grad: the header exchange, then host-side
        tables of the slots (etc is tiny), per rank in rank order:
          feeds[d]  (b, local expert) of every slot on rank d that holds one of my experts;
          mine[o]   my slot ids b that hold one of rank o's experts;
        ascending b inside each."""
        self._no_capture(local[0])
        self._slot_header(op, local)
        etc, B, me = etc_RB.tolist(), self.spec.epn, self.rank
        feeds = [[(b, e % B) for b, e in enumerate(etc[d]) if e >= 0 and e // B == me]
                 for d in range(self.world_size)]
        mine = [[b for b, e in enumerate(etc[me]) if e >= 0 and e // B == o]
                for o in range(self.world_size)]
        return etc, feeds, mine

    def prefetch_weight(self, etc_RB, local, slots):
        if not local:
            return
        _, feeds, mine = self._slot_routes("prefetch_weight", etc_RB, local)
        dev = local[0].device
        src_rows = torch.tensor([le for lst in feeds for _, le in lst], dtype=torch.long,
                                device=dev)
        dst_rows = torch.tensor([b for lst in mine for b in lst], dtype=torch.long, device=dev)
        block = self._pack(local, src_rows)
        landing = torch.empty((dst_rows.numel(), block.shape[1]), dtype=torch.uint8, device=dev)
        self.all_to_all_v(landing, block, [len(x) for x in mine], [len(x) for x in feeds])
        for t, part in zip(slots, self._unpack(landing, slots)):
            t[dst_rows] = part

    def reduce_grad(self, etc_RB, local, slots):
        if not local:
            return
        # The reverse of prefetch_weight: my slots' grads go to their owners (outgoing, by
        # owner in rank order), the grads of my experts' slots come in ascending (src, b) ==
        # ascending src*B + b: the fixed accumulation order.
        etc, incoming, outgoing = self._slot_routes("reduce_grad", etc_RB, local)
        dev, me = local[0].device, self.rank
        send_idx = torch.tensor([b for lst in outgoing for b in lst], dtype=torch.long, device=dev)
        block = self._pack(slots, send_idx)
        flat_in = [le for lst in incoming for _, le in lst]
        landing = torch.empty((len(flat_in), block.shape[1]), dtype=torch.uint8, device=dev)
        self.all_to_all_v(landing, block, [len(x) for x in incoming], [len(x) for x in outgoing])
        for t, recv in zip(local, self._unpack(landing, slots)):
            acc = t if t.dtype == torch.float32 else t.float()    # fp32 sum, one rounding
            for j, le in enumerate(flat_in):                      # ascending (src, b)
                acc[le] += recv[j].float()
            if acc is not t:
                t.copy_(acc)            # untouched rows round-trip exactly (bf16 -> fp32 -> bf16)
        consumed = [b for b, e in enumerate(etc[me]) if e >= 0]
        if consumed:
            idx = torch.tensor(consumed, dtype=torch.long, device=dev)
            for t in slots:
                t.index_fill_(0, idx, 0)


class TorchDistBackend(CollectiveBackend):
    """A torch.distributed process group: gloo (CPU tensors) or NCCL (CUDA tensors)."""

    kind = "torch"

    def __init__(self, group: Optional[dist.ProcessGroup] = None, device=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistBackend needs an initialised torch.distributed group")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.device = torch.device("cpu") if device is None else torch.device(device)

    def all_gather(self, t):
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)

    def all_to_all_v(self, out, inp, out_splits, in_splits):
        dist.all_to_all_single(out, inp, output_split_sizes=list(out_splits),
                               input_split_sizes=list(in_splits), group=self.group)

    def all_gather_object(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


class SingleRankBackend(CollectiveBackend):
    """R = 1: the whole group is this process; the primitives are copies."""

    kind = "single"

    def __init__(self, device=None):
        self.rank = 0
        self.world_size = 1
        self.device = torch.device("cpu") if device is None else torch.device(device)

    def all_gather(self, t):
        return t.reshape(1, -1).clone()

    def all_to_all_v(self, out, inp, out_splits, in_splits):
        out.copy_(inp)

    def all_gather_object(self, obj):
        return [obj]
