"""Data-plane backends: how one EP group moves token rows, expert weights and weight grads.

The custom ops (dispatch_combine.py, expert_weights.py) validate their arguments, resolve the
``Buffer`` by name and call one of the five methods of :class:`Backend` below.  A backend sees
only tensors and Python ints; every layout decision has already been made by the planner.

  Backend (abstract seam)
    CollectiveBackend  implements all five with two primitives, all_gather and all_to_all_v
      TorchDistBackend   torch.distributed process group (gloo on CPU, NCCL on GPU)
      SingleRankBackend  R = 1: the primitives are local copies, nothing is communicated
    SymmBackend        (symm_backend.py) CUDA kernels over symmetric memory, no host reads;
                       the default on CUDA devices when libmoonep_ep.so is built

CollectiveBackend reads split sizes on the host (``tolist``): fine on CPU and in eager CUDA
code, but it cannot run inside CUDA-graph capture and says so (``_no_capture``).  The ops carry
no ``cudagraph_unsafe`` tag, because with SymmBackend they are capturable.  Every collective it
issues is issued by every rank in the same order with the same count, whatever the routing
(split sizes may be zero).

Shape legend as in geometry.py: R ranks, B = epn, s tokens, K top-k, N = s*K entries,
H hidden, NvS receive rows at capacity, nvs_s receive rows this call.
"""
from __future__ import annotations

import abc
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def decode_dst(dst_N: Tensor, NvS: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dest rank, row on dest, is_primary) of every entry, int64/bool, from the planner's dst."""
    d = dst_N.long()
    primary = d >= 0
    raw = torch.where(primary, d, -d - 1)
    return raw // NvS, raw % NvS, primary


def _row_bytes(t: Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _as_bytes(t: Tensor) -> Tensor:
    """[n, ...] contiguous tensor -> [n, bytes per row] uint8 view (bit-exact transport)."""
    if t.numel() == 0:
        return t.new_empty((t.shape[0], _row_bytes(t)), dtype=torch.uint8)
    return t.reshape(t.shape[0], -1).view(torch.uint8)


class Backend(abc.ABC):
    """The data-plane method set.  ``buf`` is the owning ``Buffer`` (geometry + persistent
    buffers).  Inputs are already validated; implementations may assume the documented shapes.
    """

    rank: int
    world_size: int

    @abc.abstractmethod
    def gather_rows(self, row: Tensor) -> Tensor:
        """All-gather one int64 row per rank -> [R, n] (same n on every rank)."""

    @abc.abstractmethod
    def scatter(self, buf, x_sH: Tensor, w_sK: Optional[Tensor], dst_N: Tensor, nvs_s: int
                ) -> tuple[Tensor, Tensor]:
        """Dispatch: every entry's token row (x[n // K]) and route weight (w[n]) to its slot.
        Returns fresh (h [nvs_s, H], w [nvs_s] fp32) of this rank; rows and weights of slots no
        entry names (padding, tail) are zero.  Duplicate entries reuse their primary's row."""

    @abc.abstractmethod
    def gather(self, buf, h_rH: Tensor, w_r: Optional[Tensor], dst_N: Tensor
               ) -> tuple[Tensor, Optional[Tensor]]:
        """Combine: y[t] = sum_k h[slot(t, k)] accumulated in fp32 (fp64 for fp64 h) in the
        order k = 0..K-1, rounded once to h's dtype ([s, H]); and w_sK[t, k] = w[slot(t, k)]
        when w is given.  ``h_rH`` has nvs_s or NvS rows."""

    @abc.abstractmethod
    def push_weights(self, buf, etc_RB: Tensor, local: Sequence[Tensor],
                     slots: Sequence[Tensor]) -> None:
        """prefetch_weight: slots[i][b] = owner's local[i][e % epn] for e = etc[rank, b] >= 0."""

    @abc.abstractmethod
    def reduce_grads(self, buf, etc_RB: Tensor, local: Sequence[Tensor],
                     slots: Sequence[Tensor]) -> None:
        """reduce_grad: local[i][le] += slots of every rank holding expert rank*epn + le, added
        one by one in ascending (src*epn + b) in fp32 (bf16 grads: one rounding at the end);
        then zero this rank's consumed slots."""


class CollectiveBackend(Backend):
    """The data plane on top of ``all_gather`` and ``all_to_all_v`` (split sizes on the host)."""

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

    # -- the data plane ----------------------------------------------------------------------
    def gather_rows(self, row: Tensor) -> Tensor:
        self._no_capture(row)
        return self.all_gather(row.contiguous())

    def scatter(self, buf, x_sH, w_sK, dst_N, nvs_s):
        self._no_capture(x_sH)
        R, K, NvS = self.world_size, buf.K, buf.NvS
        s, H = x_sH.shape
        N = s * K
        dest, loff, primary = decode_dst(dst_N, NvS)
        # The primary of an entry: the first k' of the same token bound for the same rank.
        d_sK = dest.view(s, K)
        first_k = (d_sK[:, :, None] == d_sK[:, None, :]).to(torch.int8).argmax(-1)
        ploff = loff.view(s, K).gather(1, first_k).view(-1)
        if w_sK is None:
            wbits = torch.zeros(N, dtype=torch.long, device=x_sH.device)
        else:
            wbits = w_sK.reshape(-1).view(torch.int32).long()
        order = torch.sort(dest, stable=True).indices           # by destination, then entry
        meta = torch.stack([loff, ploff, wbits], 1).index_select(0, order)   # [N, 3] int64
        p_order = order[primary.index_select(0, order)]          # primaries only, same order
        rows = x_sH.index_select(0, p_order // K)                 # each row once per (t, d)
        send = torch.stack([torch.bincount(dest, minlength=R),
                            torch.bincount(dest[primary], minlength=R)], 1)
        recv = self._exchange_counts(send)
        send_l, recv_l = send.tolist(), recv.tolist()
        n_meta = sum(r[0] for r in recv_l)
        n_rows = sum(r[1] for r in recv_l)
        if n_meta > nvs_s or n_rows > buf.recv_rows.shape[0]:
            raise RuntimeError(f"moonep dispatch: rank {self.rank} would receive {n_meta} entries "
                               f"> nvs_s={nvs_s}: plans of the ranks disagree")
        meta_in = buf.recv_meta[:n_meta]
        self.all_to_all_v(meta_in, meta, [r[0] for r in recv_l], [c[0] for c in send_l])
        rows_in = buf.recv_rows[:n_rows]
        self._a2a_bytes(rows_in, rows, [r[1] for r in recv_l], [c[1] for c in send_l])
        # Land in a fresh, zeroed [nvs_s] layout: padding and tail rows are exactly zero.
        r_loff, r_ploff, r_w = meta_in.unbind(1)
        h = x_sH.new_zeros((nvs_s, H))
        w = torch.zeros(nvs_s, dtype=torch.int32, device=x_sH.device)
        w[r_loff] = r_w.to(torch.int32)
        is_p = r_loff == r_ploff
        h[r_loff[is_p]] = rows_in
        dup = ~is_p
        h[r_loff[dup]] = h[r_ploff[dup]]                          # epilogue: local duplication
        return h, w.view(torch.float32)

    def gather(self, buf, h_rH, w_r, dst_N):
        self._no_capture(h_rH)
        R, K, NvS = self.world_size, buf.K, buf.NvS
        N = dst_N.numel()
        s, H = N // K, h_rH.shape[1]
        dest, loff, _ = decode_dst(dst_N, NvS)
        order = torch.sort(dest, stable=True).indices
        send = torch.bincount(dest, minlength=R)[:, None]
        recv = self._exchange_counts(send)
        send_l = send[:, 0].tolist()
        recv_l = recv[:, 0].tolist()
        n_req = sum(recv_l)
        req = torch.empty(n_req, dtype=torch.long, device=h_rH.device)
        self.all_to_all_v(req, loff.index_select(0, order), recv_l, send_l)
        if n_req and int(req.max()) >= h_rH.shape[0]:
            raise RuntimeError(f"moonep combine: a peer requested row {int(req.max())} of "
                               f"rank {self.rank}'s {h_rH.shape[0]} rows: plans disagree")
        # Reply: the requested rows (plus their fp32 weight bits) back to each requester.
        reply = h_rH.index_select(0, req)
        landing = buf.recv_rows[:N]
        self._a2a_bytes(landing, reply, send_l, recv_l)
        rows_N = torch.empty_like(landing)
        rows_N[order] = landing
        rows = rows_N.view(s, K, H)
        acc_t = torch.promote_types(h_rH.dtype, torch.float32)    # fp32 (fp64 stays fp64)
        acc = rows[:, 0].to(acc_t)
        for k in range(1, K):                                     # fixed order k = 0..K-1
            acc = acc + rows[:, k].to(acc_t)
        y = acc.to(h_rH.dtype)
        w_sK = None
        if w_r is not None:
            w_land = buf.recv_weights[:N]
            self.all_to_all_v(w_land, w_r.index_select(0, req), send_l, recv_l)
            w_N = torch.empty_like(w_land)
            w_N[order] = w_land
            w_sK = w_N.view(s, K)
        return y, w_sK

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

    def _slot_routes(self, etc_RB: Tensor, epn: int):
        """Host-side tables (etc is tiny): per destination rank, the slots this rank owns."""
        etc = etc_RB.tolist()
        me = self.rank
        # Outgoing (I own): for each d in rank order, (b, local expert) of slots on d I feed.
        out = [[(b, e % epn) for b, e in enumerate(etc[d]) if e >= 0 and e // epn == me]
               for d in range(self.world_size)]
        # Incoming (my slots): for each owner o in rank order, my slot ids b fed by o.
        inc = [[b for b, e in enumerate(etc[me]) if e >= 0 and e // epn == o]
               for o in range(self.world_size)]
        return etc, out, inc

    def push_weights(self, buf, etc_RB, local, slots):
        if not local:
            return
        self._no_capture(local[0])
        dev = local[0].device
        etc, out, inc = self._slot_routes(etc_RB, buf.epn)
        src_rows = torch.tensor([le for lst in out for _, le in lst], dtype=torch.long, device=dev)
        dst_rows = torch.tensor([b for lst in inc for b in lst], dtype=torch.long, device=dev)
        block = self._pack(local, src_rows)
        landing = torch.empty((dst_rows.numel(), block.shape[1]), dtype=torch.uint8, device=dev)
        self.all_to_all_v(landing, block, [len(x) for x in inc], [len(x) for x in out])
        for t, part in zip(slots, self._unpack(landing, slots)):
            t[dst_rows] = part

    def reduce_grads(self, buf, etc_RB, local, slots):
        if not local:
            return
        self._no_capture(local[0])
        dev = local[0].device
        epn, me = buf.epn, self.rank
        etc, _, _ = self._slot_routes(etc_RB, epn)
        # Outgoing: my consumed slots, grouped by owner in rank order, ascending b inside.
        outgoing = [[b for b, e in enumerate(etc[me]) if e >= 0 and e // epn == o]
                    for o in range(self.world_size)]
        # Incoming: (src, b, local expert) of every slot holding one of my experts, ascending
        # (src, b) == ascending src*epn + b: the fixed accumulation order.
        incoming = [[(b, e % epn) for b, e in enumerate(etc[src]) if e >= 0 and e // epn == me]
                    for src in range(self.world_size)]
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

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchDistBackend needs an initialised torch.distributed group")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def all_gather(self, t):
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)

    def all_to_all_v(self, out, inp, out_splits, in_splits):
        dist.all_to_all_single(out, inp, output_split_sizes=list(out_splits),
                               input_split_sizes=list(in_splits), group=self.group)


class SingleRankBackend(CollectiveBackend):
    """R = 1: the whole group is this process; the primitives are copies."""

    def __init__(self):
        self.rank = 0
        self.world_size = 1

    def all_gather(self, t):
        return t.reshape(1, -1).clone()

    def all_to_all_v(self, out, inp, out_splits, in_splits):
        out.copy_(inp)


def make_backend(kind: str, group: Optional[dist.ProcessGroup], device=None) -> Backend:
    """kind: "auto", "symm", "torch" or "single".

    "auto": on a CUDA device (``device``, or the current GPU when the group is NCCL) with
    libmoonep_ep.so built -> "symm" (CUDA kernels over symmetric memory); otherwise a single
    rank when there is no group or it has one rank, else "torch"."""
    if kind not in ("auto", "symm", "torch", "single"):
        raise ValueError(f"backend must be 'auto', 'symm', 'torch' or 'single', got {kind!r}")
    if kind == "single":
        return SingleRankBackend()
    if kind == "torch":
        return TorchDistBackend(group)
    dev = resolve_device(device, group)
    if kind == "symm" or dev.type == "cuda":
        from . import _native
        if kind == "symm" or _native.ep_lib() is not None:
            if dev.type != "cuda":
                raise ValueError(f"backend='symm' needs a CUDA device, got {dev}")
            from .symm_backend import SymmBackend, default_heap
            with torch.cuda.device(dev):
                return SymmBackend(default_heap(group, dev))
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return SingleRankBackend()
    if dist.get_world_size(group if group is not None else dist.group.WORLD) == 1:
        return SingleRankBackend()
    return TorchDistBackend(group)


def resolve_device(device, group: Optional[dist.ProcessGroup]) -> torch.device:
    """The Buffer's device: ``device`` if given, else the current GPU for an NCCL group, else CPU."""
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    if (dist.is_available() and dist.is_initialized() and torch.cuda.is_available()
            and "nccl" in str(dist.get_backend(group if group is not None else dist.group.WORLD))):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
