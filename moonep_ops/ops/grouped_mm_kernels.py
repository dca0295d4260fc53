"""The backends of the grouped GEMM ops (moonep_ops/ops/grouped_mm.py: the ops, their checks,
schemas, fakes, autograd and the public API): which backend a call runs, and each backend's
launch.

  backend_for      from device, dtype and the feature dims only (never from data: no sync);
  reference        per-group loop on the host's view of cu_seqlens (any device, any float dtype);
  torch            torch._grouped_mm (CUDA bf16 without libmoonep_gemm.so);
  CUTLASS          libmoonep_gemm.so: one prep kernel and the family's fused GEMM per call; the
                   per-shape constants (tuning table, candidate mask, workspace bytes) looked up
                   once per call shape (_call_constants).
  run_mm, _wgrad_into_impl   an op's work after its checks, on any backend;
  rows_work / run_rows, grads_work / run_grads   a checked call's work made once per call shape
                   (the CUTLASS launch plan, or the above where none applies) and run;
  run_fwd, run_dgrad, run_wgrad_into   the ops without their checks, for moonep::moe_experts,
                   which checks every argument once for all its GEMMs.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from .. import native
from ..gemm import cost_model as gemm_cost_model
from ..gemm import tuning as gemm_tuning
from .. import settings
from ..runtime import current_device, current_raw_stream, on_device_of, sm_count

_KIND_ID = {"fwd": 0, "dgrad": 1, "wgrad": 2, "wgrad_lp": 3}
_KINDS = list(_KIND_ID)


# --------------------------------------------------------------------------------------------
# Backend choice (from device and dtype only)
# --------------------------------------------------------------------------------------------

def _aligned(*dims: int) -> bool:
    # 16-byte rows for TMA / torch._grouped_mm: bf16 dims must be multiples of 8.
    for d in dims:
        if d % 8 or d <= 0:
            return False
    return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _on_cuda(t: torch.Tensor) -> bool:
    # is_cuda costs a tenth of device.type; a subclass may report a device of its own
    return t.is_cuda if type(t) in _PLAIN else t.device.type == "cuda"


def backend_for(t: torch.Tensor, *dims: int) -> str:
    """'cutlass', 'torch' or 'reference' for data like ``t`` with these feature dims."""
    if not _on_cuda(t) or t.dtype != torch.bfloat16 or not _aligned(*dims):
        return "reference"
    forced = settings.get("MOONEP_GEMM_BACKEND").lower()
    if forced in ("torch", "reference"):
        return forced
    if forced == "cutlass" or native.gemm() is not None:
        return "cutlass"
    return "torch"


# --------------------------------------------------------------------------------------------
# Reference (any device, any float dtype; reads cu_seqlens on the host)
# --------------------------------------------------------------------------------------------

def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _bounds(cu: torch.Tensor):
    start = 0
    for g, end in enumerate(cu.tolist()):
        yield g, start, end
        start = max(start, end)


def _weight(w_local, w_slot, g):
    epn = w_local.shape[0]
    return w_local[g] if g < epn else w_slot[g - epn]


def _ref_fwd(x, w_local, w_slot, cu):
    acc = _acc_dtype(x.dtype)
    y = x.new_zeros(x.shape[0], w_local.shape[1])
    for g, s, e in _bounds(cu):
        if e > s:
            y[s:e] = (x[s:e].to(acc) @ _weight(w_local, w_slot, g).to(acc).t()).to(y.dtype)
    return y


def _ref_dgrad(dy, w_local, w_slot, cu):
    acc = _acc_dtype(dy.dtype)
    dx = dy.new_zeros(dy.shape[0], w_local.shape[2])
    for g, s, e in _bounds(cu):
        if e > s:
            dx[s:e] = (dy[s:e].to(acc) @ _weight(w_local, w_slot, g).to(acc)).to(dx.dtype)
    return dx


def _ref_group_dw(dy, x, cu):
    """(g, dW_g) for every non-empty group, dW_g in the accumulation dtype."""
    acc = _acc_dtype(dy.dtype)
    for g, s, e in _bounds(cu):
        if e > s:
            yield g, dy[s:e].to(acc).t() @ x[s:e].to(acc)


def _ref_wgrad_acc(dy, x, cu, grad_local, grad_slot):
    epn = grad_local.shape[0]
    for g, dw in _ref_group_dw(dy, x, cu):
        tgt = grad_local[g] if g < epn else grad_slot[g - epn]
        tgt += dw.to(tgt.dtype)


# --------------------------------------------------------------------------------------------
# torch._grouped_mm fallback (CUDA bf16 without the library); sync-free
# --------------------------------------------------------------------------------------------

def _zero_tail_rows(out: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm leaves rows past offs[-1] undefined; our contract says zero.
    rows = torch.arange(out.shape[0], device=out.device, dtype=torch.int32)
    return out.masked_fill_((rows >= cu[-1])[:, None], 0)


def _torch_fwd(x, w_local, w_slot, cu, zero_tail=True):
    w = torch.cat([w_local, w_slot])                       # [G, O, I]
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=cu)
    return _zero_tail_rows(y, cu) if zero_tail else y


def _torch_dgrad(dy, w_local, w_slot, cu, zero_tail=True):
    w = torch.cat([w_local, w_slot])
    dx = torch._grouped_mm(dy, w, offs=cu)
    return _zero_tail_rows(dx, cu) if zero_tail else dx


def _ref_wgrad_into(dy, x, cu, grad_local, grad_slot):
    epn = grad_local.shape[0]
    grad_local.zero_()                       # empty local groups read 0; empty slots untouched
    for g, dw in _ref_group_dw(dy, x, cu):
        (grad_local[g] if g < epn else grad_slot[g - epn]).copy_(dw)


def _nonempty_G11(cu: torch.Tensor) -> torch.Tensor:
    """[G, 1, 1] bool: group g has rows (sync-free, for masking [G, O, I] outputs)."""
    return (cu.diff(prepend=cu.new_zeros(1)) > 0)[:, None, None]


def _torch_wgrad_acc(dy, x, cu, grad_local, grad_slot):
    # dy^T as a column-major view: the layout for which empty groups are allowed.
    dw = torch._grouped_mm(dy.t(), x, offs=cu)              # [G, O, I] bf16
    epn = grad_local.shape[0]
    grad_local += dw[:epn]
    grad_slot += dw[epn:]


# --------------------------------------------------------------------------------------------
# CUTLASS (libmoonep_gemm.so)
# --------------------------------------------------------------------------------------------

_tables: dict[tuple[str, float], ctypes.Array] = {}


@functools.lru_cache(maxsize=None)
def _workspace_bytes(kind_id: int, G: int, sm_count: int) -> int:
    # Depends on (kind, G, SM count) only; the C side derives it from every config's CUTLASS
    # arguments, so it is asked once per shape, not on every call.
    return native.require_gemm().gemm_workspace_bytes(kind_id, G, sm_count)


def _tuning_table(kind: str, tie_tol: float):
    # Built once per constants file in force (use_tuning_of) and tie window.
    key = (kind, tie_tol, gemm_tuning.ACTIVE_FILE)
    if key not in _tables:
        vals = gemm_cost_model.tuning_table(kind, tie_tol)
        _tables[key] = (ctypes.c_float * len(vals))(*vals)
    return _tables[key]


@functools.lru_cache(maxsize=8192)
def _plan(kind: str, rows: int, groups: int, O: int | None, I: int | None, sm: int | None,
          family: str, names: str) -> int:
    cfgs = gemm_cost_model.CONFIGS[kind]
    if names:
        wanted = {n.strip() for n in names.split(",") if n.strip()}
        fams = {c.family for c in cfgs if c.name in wanted}
        if len(fams) > 1:
            raise ValueError(f"MOONEP_GEMM_CANDIDATES={names!r} names configs of both families "
                             f"({sorted(fams)}); one call runs one family's fused kernel")
    elif O is None or I is None:
        wanted = set(gemm_cost_model.candidates(kind, rows, groups))
    else:
        fam = None if family == "auto" else family
        if fam == "torch" and gemm_cost_model.torch_config(kind, rows, groups, O, I) is None:
            fam = "moonep"                                 # wgrad (fp32 +=): no torch family
        wanted = set(gemm_cost_model.call_candidates(kind, rows, groups, O, I, sm_count=sm,
                                                     family=fam)[1])
    mask = sum(1 << i for i, c in enumerate(cfgs) if c.name in wanted)
    return mask or sum(1 << i for i, c in enumerate(cfgs) if c.family == "moonep")


def candidate_mask(kind: str, rows: int, groups: int, O: int | None = None,
                   I: int | None = None, sm_count: int | None = None) -> int:
    """Configs the device selector chooses among (bit i = CONFIGS[kind][i]) for a call whose
    buffer holds ``rows`` rows in ``groups`` groups, of weights [O, I].

    With O and I: the never-lose rule's family (gemm_cost_model.call_candidates, on shapes only;
    cached per shape): torch._grouped_mm's config for the torch family (one config: the prep
    kernel skips the model), else the "moonep" candidates of the shape.  Without them: the
    "moonep" candidates.  The configs of a family are branches of one fused kernel, launched
    once; a candidate costs only its evaluation in the prep kernel (0.2-0.7 µs).  Env
    MOONEP_GEMM_FAMILY = moonep | torch forces the family, MOONEP_GEMM_CANDIDATES
    (comma-separated names, one family) the set."""
    family = settings.get("MOONEP_GEMM_FAMILY").strip().lower() or "auto"
    if family not in ("auto",) + gemm_cost_model.FAMILIES:
        raise ValueError(f"MOONEP_GEMM_FAMILY must be auto, moonep or torch, got {family!r}")
    return _plan(kind, int(rows), int(groups), None if O is None else int(O),
                 None if I is None else int(I), sm_count, family,
                 settings.get("MOONEP_GEMM_CANDIDATES"))


def clear_plan_cache() -> None:
    """Forget the per-shape plans and tuning tables (after changing gemm.tuning's constants in
    place) and the ops' per-signature entries."""
    _plan.cache_clear()
    _tables.clear()
    _CALLS.clear()
    ENTRIES.clear()
    WORK.clear()


# Per call signature of the ops (grouped_mm.py): what its calls run once its checks passed.
ENTRIES: dict[tuple, tuple] = {}
ENTRIES_MAX = 4096


def remember(key: Optional[tuple], entry: tuple, table: Optional[dict] = None) -> tuple:
    """``entry`` kept for ``key`` (None: not kept) in ``table`` (ENTRIES, or WORK); returns it."""
    table = ENTRIES if table is None else table
    if key is not None:
        if len(table) >= ENTRIES_MAX:
            table.clear()
        table[key] = entry
    return entry


def plain_on(dev: torch.device, *tensors) -> bool:
    """Every tensor of a plain type, on ``dev`` other than meta: what fastpath.route_plain
    takes for granted."""
    return dev.type != "meta" and all(type(t) in _PLAIN for t in tensors)


# The environment switches a GEMM call reads (should_validate, backend_for, _call_constants):
# part of each per-signature entry's key, so a changed switch is a new entry.
switches = settings.snapshot(("MOONEP_VALIDATE", "MOONEP_GEMM_BACKEND", "MOONEP_GEMM_FAMILY",
                              "MOONEP_GEMM_CANDIDATES", "MOONEP_GEMM_PDL"))


# Per call shape, what _launch passes besides the pointers: (kind id, tuning table, candidate
# mask, workspace bytes, PDL flag).  Keyed by the shape, the SM count and the three environment
# switches they read, so a changed switch is a new key; read on every call, built once.
_CALLS: dict[tuple, tuple] = {}
_CALLS_MAX = 4096


def _call_constants(kind: str, M: int, G: int, O: int, I: int, sm: int) -> tuple:
    key = (kind, M, G, O, I, sm, gemm_tuning.ACTIVE_FILE, settings.get("MOONEP_GEMM_FAMILY"),
           settings.get("MOONEP_GEMM_CANDIDATES"), settings.get("MOONEP_GEMM_PDL"))
    c = _CALLS.get(key)
    if c is None:
        kid = _KIND_ID[kind]
        c = (kid, _tuning_table(kind, gemm_cost_model.tie_tolerance(kind, M, G)),
             candidate_mask(kind, M, G, O, I, sm), _workspace_bytes(kid, G, sm), _pdl_flag())
        if len(_CALLS) >= _CALLS_MAX:
            _CALLS.clear()
        _CALLS[key] = c
    return c


_KEEP_EMPTY_SLOTS = 1      # moonep_gemm.h MOONEP_GEMM_KEEP_EMPTY_SLOTS
_PDL = 2                   # moonep_gemm.h MOONEP_GEMM_PDL
_KEEP_TAIL = 4             # moonep_gemm.h MOONEP_GEMM_KEEP_TAIL (library ABI >= 11)


def tail_flags(zero_tail: bool) -> int:
    """MOONEP_GEMM_KEEP_TAIL when the caller leaves the rows past cu_seqlens[-1] undefined and
    the library takes the flag (an older library zeroes them: also within the contract)."""
    return 0 if zero_tail or not native.gemm_keep_tail() else _KEEP_TAIL


def _pdl_flag() -> int:
    # on by default: 1.0-1.5 % gm over the zoo, far fewer calls below 0.98x torch (benchmarks.md)
    return _PDL if settings.flag("MOONEP_GEMM_PDL") else 0


# Device index -> the gemm.tuning constants file of its kind of GPU (tuning.file_for its name).
_TUNING_FILE: dict[int, str] = {}


def use_tuning_of(dev: torch.device) -> None:
    """Put the constants fitted on ``dev``'s kind of GPU in force (gemm.tuning.select); a change
    forgets every plan, table and entry made with the others (clear_plan_cache; the tables and
    call constants are keyed by the file too, so one another thread builds meanwhile is not
    reused).  One dictionary look-up when they already are; nothing off CUDA (the CPU stand-in
    of the CUDA path)."""
    if dev.type != "cuda":
        return
    idx = dev.index if dev.index is not None else current_device()
    f = _TUNING_FILE.get(idx)
    if f is None:
        f = _TUNING_FILE[idx] = gemm_tuning.file_for(torch.cuda.get_device_name(idx))
    if f != gemm_tuning.ACTIVE_FILE:
        gemm_tuning.select(f)
        clear_plan_cache()


def launch_plan(kind: str, dev: torch.device, M: int, G: int, O: int, I: int,
                flags: int = 0) -> tuple:
    """What a CUTLASS call of this shape on ``dev`` passes besides its pointers and config:
    (library function, kind id, tuning table, candidate mask, workspace bytes, ``flags`` with
    the PDL bit, SM count); the constants come from _call_constants (once per call shape), of
    ``dev``'s kind of GPU (use_tuning_of)."""
    use_tuning_of(dev)
    sm = sm_count(dev)
    kid, table, mask, nbytes, pdl = _call_constants(kind, M, G, O, I, sm)
    return native.require_gemm().grouped_gemm, kid, table, mask, nbytes, flags | pdl, sm


def launch(plan: tuple, dev: torch.device, config: int, a: int, b: int, b_slot: int, d: int,
           d_slot: int, cu: int, G: int, epn: int, M: int, O: int, I: int, raster: int = 0,
           workspace: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Run one CUTLASS grouped GEMM of ``plan`` (launch_plan) on the current stream of ``dev``,
    the operands given as data pointers (0: none); returns the workspace it used.  Host work:
    the workspace (a fresh allocation: a call in flight or captured in a CUDA graph keeps its
    own), the raw stream and the C call (inside runtime.on_device_of when ``dev`` is not the
    current device)."""
    idx = dev.index
    if idx is not None and idx != current_device():
        with on_device_of(dev):                        # (the stream read is the device's)
            return launch(plan, dev, config, a, b, b_slot, d, d_slot, cu, G, epn, M, O, I,
                          raster, workspace)
    fn, kid, table, mask, nbytes, flags, sm = plan
    if workspace is None or workspace.numel() < nbytes:
        workspace = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    rc = fn(kid, config, raster, a, b, b_slot, d, d_slot, cu, G, epn, M, O, I, table, mask, flags,
            workspace.data_ptr(), nbytes, sm, current_raw_stream(dev))
    if rc:
        native.gemm_check(rc, f"moonep grouped GEMM ({_KINDS[kid]})")
    return workspace


def _launch(kind: str, config: int, a, b, b_slot, d, d_slot, cu, epn, M, O, I,
            raster: int = 0, workspace: Optional[torch.Tensor] = None,
            flags: int = 0) -> torch.Tensor:
    """``launch`` of tensors (contiguous): the plan of the call's shape, then the launch."""
    dev = a.device
    G = 2 * epn
    return launch(launch_plan(kind, dev, M, G, O, I, flags), dev, config, a.data_ptr(),
                  b.data_ptr(), 0 if b_slot is None else b_slot.data_ptr(), d.data_ptr(),
                  0 if d_slot is None else d_slot.data_ptr(), cu.data_ptr(), G, epn, M, O, I,
                  raster, workspace)


def _cutlass_mm(kind, a, w_local, w_slot, cu, config, zero_tail=True, shape=None):
    """kind "fwd": y [M, O] = x [M, I] @ W_g^T; "dgrad": dx [M, I] = dy [M, O] @ W_g.
    ``shape``: w_local's, when the caller has read it."""
    M = a.shape[0]
    epn, O, I = w_local.shape if shape is None else shape
    out = torch.empty(M, O if kind == "fwd" else I, dtype=a.dtype, device=a.device)
    if M:
        _launch(kind, config, a.contiguous(), w_local.contiguous(), w_slot.contiguous(),
                out, None, cu.contiguous(), epn, M, O, I, flags=tail_flags(zero_tail))
    return out


def _cutlass_wgrad_acc(dy, x, cu, grad_local, grad_slot, config):
    M, O = dy.shape
    I = x.shape[1]
    epn = grad_local.shape[0]
    if M:
        _launch("wgrad", config, dy.contiguous(), x.contiguous(), None, grad_local, grad_slot,
                cu.contiguous(), epn, M, O, I)


def _cutlass_wgrad_into(dy, x, cu, grad_local, grad_slot, config):
    M, O = dy.shape
    I = x.shape[1]
    if M == 0:
        grad_local.zero_()             # every group is empty; slots stay untouched
        return
    _launch("wgrad_lp", config, dy.contiguous(), x.contiguous(), None, grad_local, grad_slot,
            cu.contiguous(), grad_local.shape[0], M, O, I, flags=_KEEP_EMPTY_SLOTS)


def _cutlass_wgrad_lp(dy, x, cu, epn, config):
    M, O = dy.shape
    I = x.shape[1]
    if M == 0:
        z = torch.zeros(epn, O, I, dtype=dy.dtype, device=dy.device)
        return z, torch.zeros_like(z)
    gl = torch.empty(epn, O, I, dtype=dy.dtype, device=dy.device)
    gs = torch.empty_like(gl)
    _launch("wgrad_lp", config, dy.contiguous(), x.contiguous(), None, gl, gs, cu.contiguous(),
            epn, M, O, I)
    return gl, gs


# --------------------------------------------------------------------------------------------
# The ops' bodies after their checks: the custom ops below call them, and so does
# moonep::moe_experts, itself one custom op that checks every argument once (the nested
# dispatcher calls and repeated checks cost ~20-30 us each on the host).
# --------------------------------------------------------------------------------------------

def run_mm(kind: str, a, w_local, w_slot, cu, config: int = -1, zero_tail: bool = True):
    """moonep::grouped_mm (``kind`` "fwd", a = x) or grouped_mm_dgrad ("dgrad", a = dy) without
    its checks (the caller made them)."""
    shape = w_local.shape
    backend = backend_for(a, shape[1], shape[2])
    if backend == "cutlass":
        return _cutlass_mm(kind, a, w_local, w_slot, cu, config, zero_tail, shape)
    fwd = kind == "fwd"
    if backend == "torch":
        return (_torch_fwd if fwd else _torch_dgrad)(a, w_local, w_slot, cu, zero_tail)
    return (_ref_fwd if fwd else _ref_dgrad)(a, w_local, w_slot, cu)


def _wgrad_into_impl(dy, x, cu, grad_local, grad_slot, config: int = -1) -> None:
    """moonep::grouped_mm_wgrad_into without its checks (the caller made them, memory overlap
    of the written grads with the inputs included), on any backend."""
    backend = backend_for(dy, dy.shape[1], x.shape[1])
    if backend == "cutlass":
        _cutlass_wgrad_into(dy, x, cu, grad_local, grad_slot, config)
    elif backend == "torch":
        epn = grad_local.shape[0]
        dw = torch._grouped_mm(dy.t(), x, offs=cu)                       # [G, O, I]
        full = _nonempty_G11(cu)
        grad_local.copy_(dw[:epn].masked_fill_(~full[:epn], 0))
        grad_slot.copy_(torch.where(full[epn:], dw[epn:], grad_slot))
    else:
        _ref_wgrad_into(dy, x, cu, grad_local, grad_slot)


def _wgrad_acc_impl(dy, x, cu, grad_local, grad_slot, config):
    O, I = dy.shape[1], x.shape[1]
    backend = backend_for(dy, O, I)
    if backend == "cutlass":
        _cutlass_wgrad_acc(dy, x, cu, grad_local, grad_slot, config)
    elif backend == "torch":
        _torch_wgrad_acc(dy, x, cu, grad_local, grad_slot)
    else:
        _ref_wgrad_acc(dy, x, cu, grad_local, grad_slot)


# --------------------------------------------------------------------------------------------
# A checked call's work, made once per call shape: what the ops' entries (grouped_mm.py) hold,
# and what run_fwd / run_dgrad / run_wgrad_into keep per the properties it reads (WORK).
# --------------------------------------------------------------------------------------------

WORK: dict[tuple, tuple] = {}


def rows_work(kind: str, a, w_local, zero_tail) -> tuple:
    """What a checked grouped_mm ("fwd") / _dgrad call runs: (the CUTLASS launch plan or None
    where run_mm runs (another backend, no rows), M, output columns, dtype, device, G, epn, O,
    I)."""
    (epn, O, I), dev, M = w_local.shape, a.device, a.shape[0]
    plan = None
    if M and backend_for(a, O, I) == "cutlass":
        plan = launch_plan(kind, dev, M, 2 * epn, O, I, tail_flags(zero_tail))
    return plan, M, O if kind == "fwd" else I, a.dtype, dev, 2 * epn, epn, O, I


def run_rows(work: tuple, kind: str, a, w_local, w_slot, cu, config: int, zero_tail):
    """A checked grouped_mm / _dgrad call's work (``rows_work``)."""
    plan, M, cols, dtype, dev, G, epn, O, I = work
    if plan is None:
        return run_mm(kind, a, w_local, w_slot, cu, config, zero_tail)
    out = torch.empty(M, cols, dtype=dtype, device=dev)
    a, w_local, w_slot, cu = a.contiguous(), w_local.contiguous(), w_slot.contiguous(), \
        cu.contiguous()
    launch(plan, dev, config, a.data_ptr(), w_local.data_ptr(), w_slot.data_ptr(),
           out.data_ptr(), 0, cu.data_ptr(), G, epn, M, O, I)
    return out


def grads_work(kind: str, flags: int, dy, x, grad_local) -> tuple:
    """What a checked wgrad_into / _accumulate call (CUTLASS ``kind``, ``flags``) runs: (the
    launch plan or None where the op's run function runs, M, O, I, epn, device)."""
    (M, O), I, epn, dev = dy.shape, x.shape[1], grad_local.shape[0], dy.device
    plan = None
    if M and backend_for(dy, O, I) == "cutlass":
        plan = launch_plan(kind, dev, M, 2 * epn, O, I, flags)
    return plan, M, O, I, epn, dev


def run_grads(work: tuple, run, dy, x, cu, grad_local, grad_slot, config: int) -> None:
    """A checked wgrad_into / _accumulate call's work (``grads_work``; ``run``: the op's
    function for every backend, where no launch plan applies)."""
    plan, M, O, I, epn, dev = work
    if plan is None:
        run(dy, x, cu, grad_local, grad_slot, config)
        return
    dy, x, cu = dy.contiguous(), x.contiguous(), cu.contiguous()
    launch(plan, dev, config, dy.data_ptr(), x.data_ptr(), 0, grad_local.data_ptr(),
           grad_slot.data_ptr(), cu.data_ptr(), 2 * epn, epn, M, O, I)


def _run_rows_of(kind: str, op: str):
    """run_fwd / run_dgrad: the op ``op`` (``kind``) without its checks (the caller made them),
    its work kept per the properties rows_work reads (WORK)."""
    def run(a, w_local, w_slot, cu, config: int = -1, zero_tail: bool = True):
        key = (kind, zero_tail, switches(), type(a), a.shape, a.dtype, a.device, w_local.shape)
        work = WORK.get(key) or remember(key, rows_work(kind, a, w_local, zero_tail), WORK)
        return run_rows(work, kind, a, w_local, w_slot, cu, config, zero_tail)

    run.__name__ = run.__qualname__ = f"run_{kind}"
    run.__doc__ = f"moonep::{op} without its checks (the caller made them)."
    return run


run_fwd = _run_rows_of("fwd", "grouped_mm")
run_dgrad = _run_rows_of("dgrad", "grouped_mm_dgrad")


def run_wgrad_into(dy, x, cu, grad_local, grad_slot, config: int = -1) -> None:
    """moonep::grouped_mm_wgrad_into without its checks (the caller made them, memory overlap
    of the written grads with the inputs included)."""
    key = (switches(), type(dy), dy.shape, dy.dtype, dy.device, x.shape, grad_local.shape)
    work = WORK.get(key) or remember(key, grads_work("wgrad_lp", _KEEP_EMPTY_SLOTS, dy, x,
                                                      grad_local), WORK)
    run_grads(work, _wgrad_into_impl, dy, x, cu, grad_local, grad_slot, config)
