"""Host cost of the MoE training path: microseconds of host time per call of every op, beside
the torch ops a torchtitan-style layer runs instead, and a profile of one eager layer step.

    python benchmarks/bench_host_cost.py [--calls 200] [--rounds 5] [--layer qwen3-30b-a3b]
                                         [--profile-steps 20] [--out DIR] [--tiny]
    python benchmarks/bench_host_cost.py --standin [--calls 2000] [--rounds 7] [--baseline DIR]

Host time per call: the wall time of one call issued on an idle GPU (a sync before it, median
over calls): what the call costs the Python thread that issues it, never held back by a full
launch queue.  The GEMM table also gives n calls issued back to back with no synchronisation,
the loop's time divided by n (how the targets were first measured; a full launch queue can
block the host there, and the figure then tends to the GPU time).  Where the host time of the
calls exceeds their GPU time, the host is the bottleneck of an eager step.  Every row is
measured in alternating rounds with its torch counterpart (median over --rounds).

1. GEMMs (eight expert shapes: D 2048-7168, G 16-128, 4k-32k rows): per direction
     torch   torch._grouped_mm, the weights as one [G, ...] tensor (what the titan-style layer
             calls; torch's own CUTLASS kernels and its C++ dispatch);
     op      torch.ops.moonep.grouped_mm / _dgrad / _wgrad_into (what moonep::moe_experts calls);
     api     the public Python functions of moonep_ops.ops.grouped_mm;
     body    the op's body without the custom-op dispatch and the checks (run_fwd, ...: what
             moonep::moe_experts calls; packages that have it);
     native  the library's launch alone: libmoonep_gemm.so's moonep_grouped_gemm through ctypes
             with every argument prepared (prep kernel + fused GEMM launch, the C++ host
             work; CUDA with the library only), beside the cost of a ctypes call of a trivial
             export of the same library (the floor: native - floor is the launcher's own work);
   target: op <= 1.5 x torch.
2. The layer's ops at one layer shape (R = 1, the CUDA symmetric-memory backend): router,
   dispatch, moe_experts forward and backward, combine, swiglu, prefetch / reduce, beside the
   titan-style pieces (route, argsort permutation, experts, weighted index_add_ un-permute).
3. One eager training step of each layer: host time, and a cProfile of ours: where every
   microsecond of the step's host time goes (by function, and grouped by package).

On CPU (--tiny: the CI smoke run) every op runs its CPU reference: the numbers measure the
Python around the kernels, which the CUDA path shares only in part.

--standin (CPU, any machine): the Python of the CUDA GEMM path alone.  The public grouped GEMM
functions run on CPU bf16 tensors with the CUTLASS backend taken for them, libmoonep_gemm.so
replaced by a Python object whose grouped_gemm returns 0 and whose gemm_workspace_bytes returns
a size, the SM count and the raw stream stubbed and MOONEP_VALIDATE off (as on CUDA), so every
host step of a CUDA call runs but the CUDA calls (the launch, the current-device read).  The
stubs live only inside the section and are restored after it.  Per direction: api (the public
function), body (run_fwd / run_dgrad / run_wgrad_into, after the checks) and the stub's launch
alone (the Python call of the stub with every argument prepared), beside a torch.empty of the
output; us per call, best of --reps x --calls calls, median over --rounds alternating rounds.
With --baseline DIR (a directory holding an older moonep_ops package): one stand-in process per
package and round, the two packages alternating, --rounds each, api and body side by side.
"""
from __future__ import annotations

import argparse
import cProfile
import ctypes
import inspect
import json
import os
import pstats
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_layer_r1 import SHAPES, LR, build  # noqa: E402

from moonep_ops import native, registry  # noqa: E402
from moonep_ops.gemm import cost_model  # noqa: E402
try:
    from moonep_ops.testing.train_step import sgd_step
except ImportError:      # a package from before moonep_ops/testing/: the host stage's baseline
    from moonep_ops.nn.train_step import sgd_step
from moonep_ops.ops import grouped_mm as gm  # noqa: E402
from moonep_ops.ops import moe_experts as me  # noqa: E402
from moonep_ops.ops.moe_experts import ExpertPool  # noqa: E402

# (D, F, G = 2 * epn, M rows): D 2048-7168, G 16-128, 4k-32k rows
GEMM_SHAPES = [
    (2048, 768, 128, 32768),      # Qwen3-30B-A3B experts, EP 2 (epn 64)
    (2048, 768, 16, 4096),
    (2048, 1024, 32, 8192),
    (4096, 1536, 32, 16384),      # Qwen3-235B-A22B-like
    (4096, 3584, 16, 8192),       # Mixtral-like
    (5120, 1536, 64, 16384),
    (7168, 2048, 64, 32768),      # DeepSeek-V3, EP 8 (epn 32)
    (7168, 2048, 16, 4096),
]
TINY_GEMM = [(32, 24, 4, 64)]
TINY_LAYER = (64, 32, 24, 8, 2)
GEMM_TARGET = 1.5


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def host_us(fn, n: int, dev) -> float:
    """us of host time per call over n unsynchronised calls, back to back (the GPU idle at the
    start; how the host-cost targets were first measured).  Once the GPU falls behind, a full
    launch queue can block the host, and the figure then tends to the GPU time: see
    ``isolated_us``."""
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t0
    _sync(dev)
    return t * 1e6 / n


def isolated_us(fn, n: int, dev) -> float:
    """Median us of host time of one call issued on an idle GPU (a sync before each): the host
    cost of the call itself, never held back by a full launch queue."""
    ts = []
    for _ in range(n):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    _sync(dev)
    return statistics.median(ts) * 1e6


def compare(fns: dict, n: int, rounds: int, dev, measure=isolated_us) -> dict:
    """{name: median us} over ``rounds`` alternating rounds (warmed up first); None entries of
    ``fns`` are skipped."""
    for f in fns.values():
        if f is not None:
            f()
            f()
    _sync(dev)
    names = [k for k, f in fns.items() if f is not None]
    vals = {k: [] for k in names}
    for r in range(rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            vals[k].append(measure(fns[k], n, dev))
    return {k: statistics.median(v) for k, v in vals.items()}


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.1f}"


# ---------------------------------------------------------------------------------------------
# 1. GEMMs
# ---------------------------------------------------------------------------------------------

def _counts(M: int, G: int, gen) -> list[int]:
    """Rows per group summing to M, skewed (Dirichlet-like), padded to 128 where M allows."""
    w = torch.rand(G, generator=gen) + 0.2
    tp = 128 if M >= 128 * G else 1
    c = (w / w.sum() * (M // tp)).floor().long() * tp
    c[0] += M - int(c.sum())
    return c.tolist()


def native_launcher(kind, a, b, b_slot, d, d_slot, cu, epn, M, O, I, flags):
    """A zero-argument call of moonep_grouped_gemm with every argument prepared (the C++ host
    work and ctypes alone), or None without the library or on another device."""
    lib = native.gemm()
    if lib is None or a.device.type != "cuda":
        return None
    kid = {"fwd": 0, "dgrad": 1, "wgrad": 2, "wgrad_lp": 3}[kind]
    G = 2 * epn
    sm = torch.cuda.get_device_properties(a.device).multi_processor_count
    nbytes = lib.gemm_workspace_bytes(kid, G, sm)
    ws = torch.empty(nbytes, dtype=torch.uint8, device=a.device)
    vals = cost_model.tuning_table(kind, cost_model.tie_tolerance(kind, M, G))
    table = (ctypes.c_float * len(vals))(*vals)
    mask = gm.candidate_mask(kind, M, G, O, I, sm)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    args = (kid, -1, 0, a.data_ptr(), b.data_ptr(), 0 if b_slot is None else b_slot.data_ptr(),
            d.data_ptr(), 0 if d_slot is None else d_slot.data_ptr(), cu.data_ptr(), G, epn, M,
            O, I, table, mask, flags | 2, ws.data_ptr(), nbytes, sm, stream)   # 2: PDL (default)
    fn = lib.grouped_gemm

    def call():
        fn(*args)

    call.keep = (ws, table)
    return call


def gemm_rows(shapes, dev, calls, rounds) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    rows = []
    for D, F, G, M in shapes:
        epn = G // 2
        cu = torch.tensor(_counts(M, G, gen), dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
        x = torch.randn(M, D, device=dev, dtype=bf)
        dy = torch.randn(M, F, device=dev, dtype=bf)
        wl = torch.randn(epn, F, D, device=dev, dtype=bf) * 0.02     # [B, O = F, I = D]
        ws = torch.randn(epn, F, D, device=dev, dtype=bf) * 0.02
        w_all = torch.cat([wl, ws])                                   # titan: one tensor
        gl, gs = torch.empty_like(wl), torch.empty_like(ws)
        out_f = torch.empty(M, F, device=dev, dtype=bf)
        out_d = torch.empty(M, D, device=dev, dtype=bf)
        tail = gm.tail_flags(False)
        body = {k: getattr(gm, f"run_{k}", None) for k in ("fwd", "dgrad", "wgrad_into")}
        cases = {
            "fwd": dict(
                torch=lambda: torch._grouped_mm(x, w_all.transpose(-2, -1), offs=cu),
                op=lambda: torch.ops.moonep.grouped_mm(x, wl, ws, cu, -1, False),
                api=lambda: gm.grouped_mm(x, wl, ws, cu, zero_tail=False),
                body=body["fwd"] and (lambda: body["fwd"](x, wl, ws, cu, -1, False)),
                native=native_launcher("fwd", x, wl, ws, out_f, None, cu, epn, M, F, D, tail)),
            "dgrad": dict(
                torch=lambda: torch._grouped_mm(dy, w_all, offs=cu),
                op=lambda: torch.ops.moonep.grouped_mm_dgrad(dy, wl, ws, cu, -1, False),
                api=lambda: gm.grouped_mm_dgrad(dy, wl, ws, cu, zero_tail=False),
                body=body["dgrad"] and (lambda: body["dgrad"](dy, wl, ws, cu, -1, False)),
                native=native_launcher("dgrad", dy, wl, ws, out_d, None, cu, epn, M, F, D, tail)),
            "wgrad": dict(
                torch=lambda: torch._grouped_mm(dy.t(), x, offs=cu),
                op=lambda: torch.ops.moonep.grouped_mm_wgrad_into(dy, x, cu, gl, gs, -1),
                api=lambda: gm.grouped_mm_wgrad_into(dy, x, cu, gl, gs),
                body=body["wgrad_into"] and (lambda: body["wgrad_into"](dy, x, cu, gl, gs)),
                native=native_launcher("wgrad_lp", dy, x, None, gl, gs, cu, epn, M, F, D, 1)),
        }
        for kind, fns in cases.items():
            r = compare(fns, max(calls // 4, 10), rounds, dev)
            st = compare({k: fns[k] for k in ("torch", "op")}, calls, rounds, dev, host_us)
            rows.append(dict(D=D, F=F, G=G, M=M, kind=kind, **{k: r.get(k) for k in fns},
                             torch_stream=st["torch"], op_stream=st["op"]))
            print(f"  gemm D={D} F={F} G={G} M={M} {kind}: "
                  + ", ".join(f"{k} {_fmt(r.get(k))}" for k in fns)
                  + f"; {calls} unsynchronised calls: torch {st['torch']:.1f}, op {st['op']:.1f}",
                  flush=True)
    return rows


def ctypes_floor(dev, rounds) -> float | None:
    """us of host time of a ctypes call of a trivial export of the GEMM library (None without
    it): the cost of crossing into the library at all."""
    lib = native.gemm()
    if lib is None or dev.type != "cuda":
        return None
    sm = torch.cuda.get_device_properties(dev).multi_processor_count
    fn = lib.gemm_workspace_bytes
    return compare({"floor": lambda: fn(0, 16, sm)}, 200, rounds, dev)["floor"]


def gemm_call(shape, dev):
    """A zero-argument forward op call at ``shape`` (the section's first), for the profile."""
    D, F, G, M = shape
    epn = G // 2
    bf = torch.bfloat16
    cu = torch.tensor(_counts(M, G, torch.Generator().manual_seed(0)),
                      dtype=torch.int64).cumsum(0).to(torch.int32).to(dev)
    x = torch.randn(M, D, device=dev, dtype=bf)
    wl = torch.randn(epn, F, D, device=dev, dtype=bf)
    ws = torch.randn(epn, F, D, device=dev, dtype=bf)

    def call():
        torch.ops.moonep.grouped_mm(x, wl, ws, cu, -1, False)
    return call


def gemm_table(rows) -> list[str]:
    out = ["", "### 1. Grouped GEMMs: host us per call", "",
           "One call on an idle GPU (median); the last two columns: n calls back to back, "
           "unsynchronised (a full launch queue can block the host there).",
           "", "| D | F | G | M | dir | torch | op | api | body | native | op / torch | "
           "api / torch | target (api) | torch, stream | op, stream |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    missed = []
    for r in rows:
        ratio, api = r["op"] / r["torch"], r["api"] / r["torch"]
        ok = api <= GEMM_TARGET
        if not ok:
            missed.append(f"D={r['D']} G={r['G']} M={r['M']} {r['kind']} {api:.2f}")
        out.append(f"| {r['D']} | {r['F']} | {r['G']} | {r['M']} | {r['kind']} | "
                   f"{_fmt(r['torch'])} | {_fmt(r['op'])} | {_fmt(r['api'])} | "
                   f"{_fmt(r.get('body'))} | {_fmt(r['native'])} | {ratio:.2f} | {api:.2f} | "
                   f"<= {GEMM_TARGET} "
                   f"{'met' if ok else 'MISSED'} | {_fmt(r['torch_stream'])} | "
                   f"{_fmt(r['op_stream'])} |")
    out += ["", "GEMM host-cost target (api <= 1.5 x torch): "
            + ("met on every row" if not missed else "MISSED: " + "; ".join(missed))]
    return out



# ---------------------------------------------------------------------------------------------
# --standin: the CUDA GEMM path's Python on CPU tensors
# ---------------------------------------------------------------------------------------------

# (D, F, G = 2 * epn, M): the shape of the host-cost table, a tiny one and a wide one
STANDIN_SHAPES = [(2048, 768, 16, 4096), (32, 24, 4, 64), (7168, 2048, 64, 2048)]
STANDIN_WORKSPACE = 4096


class _StubGemmLibrary:
    """libmoonep_gemm.so's place in the stand-in: every launch returns 0 (and is counted, its
    arguments kept), every workspace query one size."""

    def __init__(self):
        self.calls = 0
        self.last = None

    def grouped_gemm(self, *args):
        self.calls += 1
        self.last = args
        return 0

    def gemm_workspace_bytes(self, kind_id, G, sm):
        return STANDIN_WORKSPACE

    def gemm_last_error(self):
        return b""


class standin_patches:
    """``with standin_patches() as lib:`` the CUDA GEMM path for CPU bf16 tensors (the module
    docstring, --standin); everything it replaces is put back on exit, and the GEMM's per-shape
    caches are cleared on entry and exit (they would hold the stub's values)."""

    def __init__(self):
        self.lib = _StubGemmLibrary()
        self.saved = []

    def _set(self, obj, name, value):
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __enter__(self):
        from moonep_ops import runtime
        from moonep_ops.ops import grouped_mm_kernels as gk
        lib = self.lib
        try:
            self._set(native, "gemm", lambda: lib)
            self._set(native, "require_gemm", lambda: lib)
            self._set(native, "gemm_keep_tail", lambda: True)
            self._set(gk, "_on_cuda", lambda t: True)
            stubs = {runtime.sm_count: lambda dev: 132, runtime.current_raw_stream: lambda dev: 0}
            for mod in [m for n, m in sys.modules.items() if n.startswith("moonep_ops")]:
                for name, val in list(vars(mod).items()):
                    if callable(val) and val in stubs:
                        self._set(mod, name, stubs[val])
            self.env = os.environ.get("MOONEP_VALIDATE")
            os.environ["MOONEP_VALIDATE"] = "0"
        except BaseException:
            self._restore()
            raise
        self._clear()
        return lib

    def _clear(self):
        from moonep_ops.ops import grouped_mm_kernels as gk
        gk.clear_plan_cache()
        getattr(gk._workspace_bytes, "cache_clear", lambda: None)()

    def _restore(self):
        for obj, name, val in reversed(self.saved):
            setattr(obj, name, val)
        self.saved.clear()

    def __exit__(self, *exc):
        if self.env is None:
            os.environ.pop("MOONEP_VALIDATE", None)
        else:
            os.environ["MOONEP_VALIDATE"] = self.env
        self._restore()
        self._clear()
        return False


def best_us(fn, calls: int, reps: int) -> float:
    """us per call: the best of ``reps`` loops of ``calls`` back-to-back calls."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6 / calls


def standin_cases(D, F, G, M, lib) -> dict:
    """{direction: {column: zero-argument call}} of one shape (tensors allocated, not filled: no
    call reads them)."""
    epn = G // 2
    bf = torch.bfloat16
    x, dy = torch.empty(M, D, dtype=bf), torch.empty(M, F, dtype=bf)
    wl, ws = torch.empty(epn, F, D, dtype=bf), torch.empty(epn, F, D, dtype=bf)
    gl, gs = torch.empty_like(wl), torch.empty_like(ws)
    cu = (torch.arange(1, G + 1, dtype=torch.int32) * (M // G)).clamp(max=M)
    y, dx = torch.empty(M, F, dtype=bf), torch.empty(M, D, dtype=bf)
    ws_buf = torch.empty(STANDIN_WORKSPACE, dtype=torch.uint8)
    table = (ctypes.c_float * 4)()
    fn = lib.grouped_gemm

    def stub(kid, a, b, b_slot, d, d_slot, flags):
        args = (kid, -1, 0, a.data_ptr(), b.data_ptr(), 0 if b_slot is None else b_slot.data_ptr(),
                d.data_ptr(), 0 if d_slot is None else d_slot.data_ptr(), cu.data_ptr(), G, epn,
                M, F, D,
                table, 1, flags, ws_buf.data_ptr(), STANDIN_WORKSPACE, 132, 0)
        return lambda: fn(*args)

    return {
        "fwd": dict(api=lambda: gm.grouped_mm(x, wl, ws, cu, zero_tail=False),
                    body=lambda: gm.run_fwd(x, wl, ws, cu, -1, False),
                    native=stub(0, x, wl, ws, y, None, 6),
                    empty=lambda: torch.empty(M, F, dtype=bf)),
        "dgrad": dict(api=lambda: gm.grouped_mm_dgrad(dy, wl, ws, cu, zero_tail=False),
                      body=lambda: gm.run_dgrad(dy, wl, ws, cu, -1, False),
                      native=stub(1, dy, wl, ws, dx, None, 6),
                      empty=lambda: torch.empty(M, D, dtype=bf)),
        "wgrad_into": dict(api=lambda: gm.grouped_mm_wgrad_into(dy, x, cu, gl, gs),
                           body=lambda: gm.run_wgrad_into(dy, x, cu, gl, gs),
                           native=stub(3, dy, x, None, gl, gs, 3),
                           empty=lambda: torch.empty(epn, F, D, dtype=bf)),
    }


def standin_rows(shapes, calls: int, reps: int, rounds: int) -> tuple[list[dict], list[str]]:
    """The stand-in's rows (us per call) and a cProfile of the first shape's api calls."""
    rows, prof = [], []
    with standin_patches() as lib:
        for D, F, G, M in shapes:
            for kind, fns in standin_cases(D, F, G, M, lib).items():
                for col in ("api", "body"):                 # warm up; the stub is reached
                    n = lib.calls
                    fns[col]()
                    fns[col]()
                    if lib.calls != n + 2:
                        raise RuntimeError(f"stand-in: {kind} {col} did not take the CUTLASS "
                                           "branch (no launch reached the stub)")
                names = list(fns)
                vals = {k: [] for k in names}
                for r in range(rounds):
                    for k in (names if r % 2 == 0 else names[::-1]):
                        vals[k].append(best_us(fns[k], calls, reps))
                row = dict(D=D, F=F, G=G, M=M, kind=kind,
                           **{k: statistics.median(v) for k, v in vals.items()})
                rows.append(row)
                print(f"  stand-in D={D} F={F} G={G} M={M} {kind}: "
                      + ", ".join(f"{k} {row[k]:.2f}" for k in names), flush=True)
        D, F, G, M = shapes[0]
        cases = standin_cases(D, F, G, M, lib)

        def api_calls():
            for fns in cases.values():
                fns["api"]()
        summary, prof = profile(api_calls, max(calls, 1),
                                "### S2. Where the stand-in's api calls go (cProfile, fwd + "
                                f"dgrad + wgrad_into, D, F, G, M = {shapes[0]})",
                                per="3 calls", top_n=20)
    return rows, summary + prof


def standin_table(rows, calls: int, reps: int, rounds: int) -> list[str]:
    out = ["", "### S1. CPU stand-in of the CUDA GEMM path: host us per call", "",
           f"Best of {reps} x {calls} calls, median over {rounds} alternating rounds; "
           "MOONEP_VALIDATE off; native: the stub library's launch alone, every argument "
           "prepared; empty: torch.empty of the output.", "",
           "| D | F | G | M | dir | api | body | native (stub) | empty | api - native |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['D']} | {r['F']} | {r['G']} | {r['M']} | {r['kind']} | "
                   f"{r['api']:.2f} | {r['body']:.2f} | {r['native']:.2f} | {r['empty']:.2f} | "
                   f"{r['api'] - r['native']:.2f} |")
    return out

# ---------------------------------------------------------------------------------------------
# 2. the layer's ops
# ---------------------------------------------------------------------------------------------

def layer_rows(shape, dev, calls, rounds, tp) -> tuple[list[tuple], dict]:
    """[(what, ours us, torch us, note)], and the objects section 3 profiles."""
    T, D, F, E, K = shape
    ours, titan = build(T, D, F, E, K, dev, tp)
    buf = ours.buffer
    pool = ours.pool_name
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    ops = torch.ops.moonep
    with torch.no_grad():
        ids, w, _ = ours.router(x)
        h, w_M, cu, plan = buf.dispatch(x, ids, w)
        etc = plan.experts_to_copy
        y, g, u = ops.moe_experts(h, cu, etc, ours.w1, ours.w3, ours.w2, pool)
        z = (y.float() * w_M[:, None]).to(x.dtype)
        tw, tids = titan.route(x)
        th, tw_N, ttok, toffs = titan.permute(x, tw, tids)
        ty = titan.experts(th, toffs)
    dy = torch.randn_like(y)
    a = torch.randn_like(g)
    pw = [ours.w1.detach(), ours.w3.detach(), ours.w2.detach()]
    pp = registry.lookup(pool, ExpertPool)
    slots = [pp.w1, pp.w3, pp.w2]
    grads = [torch.zeros_like(t) for t in pw]
    sgrads = [pp.g1, pp.g3, pp.g2]
    out_t = torch.zeros_like(x)
    # the experts' backward through torch autograd (titan): one graph, replayed
    th_g = th.detach().requires_grad_()
    ty_g = titan.experts(th_g, toffs)
    t_inputs = [th_g, titan.w1, titan.w3, titan.w2]
    dty = torch.randn_like(ty_g)
    xg = x.detach().requires_grad_()
    # the layer's entry points where the package has them (fastpath), else the ops
    experts = getattr(me, "moe_experts", ops.moe_experts)
    experts_bwd = getattr(me, "moe_experts_backward", ops.moe_experts_backward)
    cases = [
        ("router", lambda: ours.router(x), lambda: titan.route(x), ""),
        ("dispatch (histograms, plan, scatter)", lambda: buf.dispatch(x, ids, w),
         lambda: titan.permute(x, tw, tids), "titan: scatter_add counts, cumsum, argsort, gather"),
        ("dispatch, x requiring grad", lambda: buf.dispatch(xg, ids, w),
         lambda: titan.permute(xg, tw, tids), "the autograd nodes included"),
        ("moe_experts forward (as the layer calls it)",
         lambda: experts(h, cu, etc, ours.w1, ours.w3, ours.w2, pool),
         lambda: titan.experts(th, toffs), "ours: prefetch + 3 GEMMs + swiglu"),
        ("moe_experts backward (as the layer calls it)",
         lambda: experts_bwd(dy, h, g, u, cu, etc, ours.w1, ours.w3, ours.w2, pool),
         lambda: torch.autograd.grad(ty_g, t_inputs, dty, retain_graph=True),
         "titan: autograd of its experts"),
        ("weights + combine", lambda: _weighted_combine(buf, plan, y, w_M, x.dtype),
         lambda: titan.unpermute(ty, tw_N, ttok, out_t), "titan: weighted index_add_"),
        ("combine alone", lambda: buf.combine(plan, z), None, ""),
        ("dispatch with plan (combine backward)",
         lambda: buf.dispatch(x, route_weights_sK=w, plan=plan), None, ""),
        ("swiglu (op)", lambda: ops.swiglu(g, u), lambda: torch.nn.functional.silu(g) * u, ""),
        ("swiglu_backward (op)", lambda: ops.swiglu_backward(g, u, a), None, ""),
        ("prefetch_weight (op)", lambda: ops.prefetch_weight(etc, pw, slots, buf.name), None,
         "R = 1: barriers only"),
        ("reduce_grad (op)", lambda: ops.reduce_grad(etc, grads, sgrads, buf.name), None, ""),
        ("moe_experts forward, through the dispatcher",
         lambda: ops.moe_experts(h, cu, etc, ours.w1, ours.w3, ours.w2, pool), None,
         "torch.ops.moonep.moe_experts"),
        ("layer forward, no grad", lambda: _nograd(ours, x), lambda: _nograd(titan, x), ""),
    ]
    rows = []
    for what, f_ours, f_torch, note in cases:
        try:
            r = compare({"ours": f_ours, "torch": f_torch}, calls, rounds, dev)
        except Exception as e:                           # noqa: BLE001  (report, go on)
            traceback.print_exc()
            r = {"ours": None, "torch": None}
            note = f"FAILED: {type(e).__name__}: {e}"
        rows.append((what, r.get("ours"), r.get("torch"), note))
        print(f"  {what}: ours {_fmt(r.get('ours'))}, torch {_fmt(r.get('torch'))}", flush=True)
    return rows, dict(ours=ours, titan=titan)


def _weighted_combine(buf, plan, y, w_M, dtype):
    """The layer's route weights and combine: inside combine where the package has weighted=
    (a baseline package from before it: weights applied first, then combine)."""
    if "weighted" in inspect.signature(buf.combine).parameters:
        return buf.combine(plan, y, w_M, weighted=True)
    return buf.combine(plan, (y.float() * w_M[:, None]).to(dtype))


def _nograd(layer, x):
    with torch.no_grad():
        return layer(x)


def layer_table(rows, shape) -> list[str]:
    T, D, F, E, K = shape
    out = ["", f"### 2. The layer's ops, host us per call (T {T}, D {D}, F {F}, E {E}, K {K}, "
           "R = 1)", "", "| op | ours | titan-style torch ops | ours / torch | note |",
           "|---|---|---|---|---|"]
    for what, o, t, note in rows:
        ratio = f"{o / t:.2f}" if o is not None and t else ""
        out.append(f"| {what} | {_fmt(o)} | {_fmt(t)} | {ratio} | {note} |")
    return out


# ---------------------------------------------------------------------------------------------
# 3. the eager step and its profile
# ---------------------------------------------------------------------------------------------

def step_host(objs, shape, dev, rounds, steps) -> dict:
    T, D = shape[0], shape[1]
    g = torch.Generator(device=dev).manual_seed(1)
    batches = [(torch.randn(T, D, device=dev, generator=g).bfloat16(),
                torch.randn(T, D, device=dev, generator=g)) for _ in range(4)]
    steps_of = {n: sgd_step(m, list(m.parameters()), LR) for n, m in objs.items()}

    def one(step):
        it = iter(range(1 << 30))

        def f():
            i = next(it)
            step(*batches[i % 4])
        return f

    def per_step_ms(f):
        ts = []
        for _ in range(steps):
            _sync(dev)
            t0 = time.perf_counter()
            f()
            ts.append((time.perf_counter() - t0) * 1e3)
        _sync(dev)
        return statistics.median(ts)

    fns = {n: one(s) for n, s in steps_of.items()}
    for f in fns.values():
        for _ in range(3):
            f()
    vals = {n: [] for n in fns}
    for r in range(rounds):
        for n in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            vals[n].append(per_step_ms(fns[n]))
    return dict(host_ms={n: statistics.median(v) for n, v in vals.items()},
                step=fns["ours"])


_GROUPS = [("moonep_ops/ops/", "moonep_ops.ops (op bodies, checks, launches)"),
           ("moonep_ops/backends/", "moonep_ops.backends (data plane calls)"),
           ("moonep_ops/nn/", "moonep_ops.nn (layer, router, step)"),
           ("moonep_ops/", "moonep_ops (other: buffer, planner, native, registry)"),
           ("torch/_library/", "torch._library (custom-op wrappers)"),
           ("torch/autograd/", "torch.autograd (Python side)"),
           ("torch/_ops.py", "torch._ops (op dispatch, Python side)"),
           ("benchmarks/", "benchmark code"),
           ("torch/", "torch (other Python)")]


def profile(step, n: int, title: str, per: str = "step", top_n: int = 30
            ) -> tuple[list[str], list[str]]:
    """cProfile of n calls of ``step``: self time per package (the summary) and the top
    functions by self and by cumulative time (the detail), in us per call (cProfile roughly
    doubles Python's own cost, so read the shares).  A C function called from Python (a torch
    op's C++ dispatch and kernel launch) appears as a built-in; a ctypes call's C++ host time
    counts in its caller's self time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())          # self time of every function
    groups: dict[str, float] = {}
    for (fname, _line, func), (cc, nc, tt, ct, callers) in st.stats.items():
        f = fname.replace(os.sep, "/")
        label = "C / built-in calls (torch kernels' C++ host, ctypes, ...)" if fname == "~" \
            else next((lab for key, lab in _GROUPS if key in f), "other Python")
        groups[label] = groups.get(label, 0.0) + tt
    out = ["", title, "", f"| group | us / {per} | share |", "|---|---|---|"]
    for lab, tt in sorted(groups.items(), key=lambda kv: -kv[1]):
        out.append(f"| {lab} | {tt * 1e6 / n:.0f} | {tt / total:.0%} |")
    def short(key):
        fname, line, func = key
        f = fname.replace(os.sep, "/")
        for root in ("site-packages/", "/main/", "/work/"):
            if root in f:
                f = f.split(root, 1)[1]
                break
        return func if fname == "~" else f"{f}:{line}({func})"

    def top(sort_key, keep, head):
        items = [(k, v) for k, v in st.stats.items() if keep(k)]
        items.sort(key=lambda kv: -kv[1][sort_key])
        rows = ["", head, "",
                f"| function | calls / {per} | self us / {per} | cumulative us / {per} |",
                "|---|---|---|---|"]
        for k, (cc, nc, tt, ct, _) in items[:top_n]:
            rows.append(f"| {short(k)} | {nc / n:g} | {tt * 1e6 / n:.1f} | {ct * 1e6 / n:.1f} |")
        return rows

    detail = top(2, lambda k: True, f"{title}: top {top_n} functions by self time")
    detail += top(3, lambda k: "moonep_ops" in k[0],
                  f"{title}: moonep_ops functions by cumulative time")
    return out, detail


# ---------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200,
                    help="unsynchronised calls per GEMM sample (a quarter of it: isolated calls)")
    ap.add_argument("--layer-calls", type=int, default=30, help="isolated calls per layer-op "
                    "sample")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layer", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=10, help="eager steps per round (section 3)")
    ap.add_argument("--profile-steps", type=int, default=20)
    ap.add_argument("--sections", default="gemm,layer,step")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU smoke run)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="write host_cost.json and host_cost.md there")
    ap.add_argument("--standin", action="store_true", help="only the CPU stand-in of the CUDA "
                    "GEMM path (any machine; --calls per loop, default 2000, --reps loops)")
    ap.add_argument("--reps", type=int, default=3, help="--standin: loops per sample (best of)")
    ap.add_argument("--baseline", default=None, help="--standin: a directory holding an older "
                    "moonep_ops package, timed against this tree in alternating processes")
    a = ap.parse_args(argv)
    if a.standin:
        return standin_main(a, argv)
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda" and not a.tiny:
        print("bench_host_cost: no CUDA device (use --tiny for the CPU smoke run)")
        return 1
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    sections = a.sections.split(",")
    pkg = os.path.dirname(sys.modules["moonep_ops"].__file__)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"bench_host_cost: torch {torch.__version__}, {name}, package {pkg}, gemm library "
          f"{'loaded' if native.gemm() is not None else 'absent'}, ep library "
          f"{'loaded' if native.ep() is not None else 'absent'}", flush=True)
    shape = TINY_LAYER if a.tiny else SHAPES[a.layer]
    tp = 128 if dev.type == "cuda" else 8
    lines, details, errors = [], [], []
    doc = dict(device=name, torch=torch.__version__, package=pkg)
    if "gemm" in sections:
        try:
            shapes = TINY_GEMM if a.tiny else GEMM_SHAPES
            rows = gemm_rows(shapes, dev, a.calls, a.rounds)
            doc["gemm"] = rows
            lines += gemm_table(rows)
            floor = ctypes_floor(dev, a.rounds)
            if floor is not None:
                doc["ctypes_floor_us"] = floor
                lines += ["", f"A ctypes call of a trivial export of libmoonep_gemm.so "
                          f"(moonep_gemm_workspace_bytes, 3 ints): {floor:.1f} us; native minus "
                          "that is the launcher's own C++ host work (prep kernel, CUTLASS "
                          "arguments of the family's configs, two launches)."]
            summary, detail = profile(gemm_call(shapes[0], dev), 200,
                                      "### 1b. Where the host time of one grouped_mm op call "
                                      f"goes (cProfile, 200 calls, D, F, G, M = {shapes[0]})",
                                      per="call", top_n=15)
            lines += summary
            details += detail
        except Exception as e:                             # noqa: BLE001
            traceback.print_exc()
            errors.append(f"gemm: {type(e).__name__}: {e}")
    objs = None
    if "layer" in sections or "step" in sections:
        try:
            rows, objs = layer_rows(shape, dev, a.layer_calls, a.rounds, tp)
            if "layer" in sections:
                doc["layer"] = dict(shape=shape, rows=rows)
                lines += layer_table(rows, shape)
        except Exception as e:                             # noqa: BLE001
            traceback.print_exc()
            errors.append(f"layer: {type(e).__name__}: {e}")
    if "step" in sections and objs is not None:
        try:
            st = step_host(objs, shape, dev, a.rounds, a.steps)
            doc["step_host_ms"] = st["host_ms"]
            h = st["host_ms"]
            lines += ["", "### 3a. One eager training step (forward, backward, SGD), host ms", "",
                      "| layer | host ms / step |", "|---|---|",
                      f"| titan-style | {h['titan']:.3f} |", f"| ours | {h['ours']:.3f} |",
                      f"| ours / titan | {h['ours'] / h['titan']:.2f} |"]
            summary, detail = profile(
                st["step"], a.profile_steps, "### 3b. Where the host time of our eager step goes "
                f"(cProfile, {a.profile_steps} steps)")
            lines += summary
            details += detail
        except Exception as e:                             # noqa: BLE001
            traceback.print_exc()
            errors.append(f"step: {type(e).__name__}: {e}")
        finally:
            objs["ours"].buffer.check_errors()
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        head = (f"bench_host_cost: torch {torch.__version__}, {name}, package {pkg}\n")
        (Path(a.out) / "host_cost.json").write_text(json.dumps(doc, indent=1, default=str))
        (Path(a.out) / "host_cost.md").write_text(
            head + text + "\n\n## Details: the profiles by function\n" + "\n".join(details)
            + "\n")
    else:
        print("\n".join(details))
    if errors:
        print("ERRORS: " + "; ".join(errors))
        return 1
    return 0


def standin_baseline(a, calls: int) -> int:
    """--standin --baseline DIR: the stand-in in one process per round and package, the package
    of DIR (an older moonep_ops) and this tree's alternating, --rounds each; medians per cell."""
    import subprocess
    import tempfile
    sides = {"baseline": str(Path(a.baseline).resolve()), "this": str(HERE.parent)}
    runs = {k: [] for k in sides}
    for r in range(a.rounds):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            with tempfile.TemporaryDirectory() as out:
                subprocess.run([sys.executable, str(Path(__file__).resolve()), "--standin",
                                "--rounds", "1", "--calls", str(calls), "--reps", str(a.reps),
                                "--out", out], check=True, capture_output=True,
                               env=dict(os.environ, PYTHONPATH=sides[side]))
                doc = json.loads((Path(out) / "host_cost_standin.json").read_text())
            if not doc["package"].startswith(sides[side]):
                raise RuntimeError(f"{side}: imported {doc['package']}, not {sides[side]}")
            runs[side].append(doc["standin"])
    lines = ["", f"### S1. CPU stand-in: {sides['baseline']} against this tree, host us per call",
             "", f"One process per package and round, {a.rounds} alternating rounds (medians); "
             f"each: best of {a.reps} x {calls} calls.", "",
             "| D | F | G | M | dir | api before | api after | ratio | body before | "
             "body after | ratio |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for i, row in enumerate(runs["this"][0]):
        med = {(k, c): statistics.median(run[i][c] for run in runs[k])
               for k in sides for c in ("api", "body")}
        rows.append(dict(row, **{f"{c}_{k}": v for (k, c), v in med.items()}))
        lines.append(f"| {row['D']} | {row['F']} | {row['G']} | {row['M']} | {row['kind']} | "
                     + " | ".join(f"{med['baseline', c]:.2f} | {med['this', c]:.2f} | "
                                  f"{med['this', c] / med['baseline', c]:.2f}"
                                  for c in ("api", "body")) + " |")
    print("\n".join(lines))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "host_cost_standin_baseline.json").write_text(json.dumps(
            dict(baseline=sides["baseline"], rows=rows, rounds=a.rounds), indent=1))
        (Path(a.out) / "host_cost_standin_baseline.md").write_text("\n".join(lines) + "\n")
    return 0


def standin_main(a, argv) -> int:
    calls = a.calls if "--calls" in (argv if argv is not None else sys.argv) else 2000
    if a.baseline:
        return standin_baseline(a, calls)
    pkg = os.path.dirname(sys.modules["moonep_ops"].__file__)
    print(f"bench_host_cost --standin: torch {torch.__version__}, package {pkg}", flush=True)
    rows, prof = standin_rows(STANDIN_SHAPES, calls, a.reps, a.rounds)
    text = "\n".join(standin_table(rows, calls, a.reps, a.rounds) + prof)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        doc = dict(device="cpu (stand-in)", torch=torch.__version__, package=pkg, standin=rows,
                   calls=calls, reps=a.reps, rounds=a.rounds)
        (Path(a.out) / "host_cost_standin.json").write_text(json.dumps(doc, indent=1))
        (Path(a.out) / "host_cost_standin.md").write_text(
            f"bench_host_cost --standin: torch {torch.__version__}, package {pkg}\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
