"""The main job's ranks: spawn R gloo ranks on this machine, or join a torchrun group.

Every rank builds both models (MoonEP and the plain all-to-all baseline) from the same weights,
compiles their forward (+ the AOT-compiled backward) with torch.compile, warms up, then for
every maxvio of the sweep trains each model for ``steps`` SGD steps from the same initial
weights, on the same data and the same routing.  Rank 0 collects the per-step numbers
(``all_gather_object``) and hands them to ``report``.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Optional

import torch
import torch.distributed as dist

MODELS = ("baseline", "moonep")


# Two functions with the same body on purpose: torch 2.13's dynamo keys its cache by code
# object, and once a compile of one code object graph-breaks (the baseline does, at its
# host-sized all-to-all), a second torch.compile of the *same* code object (with another model)
# silently runs eagerly.  Separate code objects keep the MoonEP build really compiled.
def _loss_baseline(model, x, y, scale):
    return (model(x).float() - y).pow(2).sum() * scale


def _loss_moonep(model, x, y, scale):
    return (model(x).float() - y).pow(2).sum() * scale


LOSS = {"baseline": _loss_baseline, "moonep": _loss_moonep}


@dataclasses.dataclass
class JobConfig:
    R: int = 4
    E: int = 64
    K: int = 8
    D: int = 128              # model dim
    F: int = 64               # expert FFN dim
    layers: int = 2
    tokens: int = 256         # tokens per rank per step
    steps: int = 5
    maxvio: tuple = (0.0, 1.0, 10.0, 20.0)
    lr: float = 0.5
    seed: int = 0
    token_padding: int = 8
    policy: str = "moonep"
    slack: float = 0.0        # policy "cost": the cap slack eps
    backend: str = "auto"     # process group: auto | gloo | nccl
    ep_backend: str = "auto"  # MoonEP data plane: Buffer(backend=...) auto | symm | torch
    compile: bool = True
    out: str = "moonep_out"
    progress: bool = True
    timeout_s: float = 900.0
    profile: bool = False     # profile one step per model after the sweep (profile_<model>.txt)


# --------------------------------------------------------------------------------------------
# Wire-byte counter: every all_to_all_single / all_gather of the models, off-rank bytes only.
# --------------------------------------------------------------------------------------------

class WireCounter:
    def __init__(self):
        self.bytes = 0
        self.on = False
        self._a2a, self._ag = dist.all_to_all_single, dist.all_gather

    def install(self):
        me = self

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                              group=None, async_op=False):
            if me.on:
                R = dist.get_world_size(group)
                rank = dist.get_rank(group)
                row = input[0].numel() * input.element_size() if input.dim() and input.shape[0] else 0
                if input_split_sizes:
                    me.bytes += (sum(input_split_sizes) - input_split_sizes[rank]) * row
                else:
                    me.bytes += input.numel() * input.element_size() * (R - 1) // R
            return me._a2a(output, input, output_split_sizes, input_split_sizes, group, async_op)

        def all_gather(tensor_list, tensor, group=None, async_op=False):
            if me.on:
                me.bytes += tensor.numel() * tensor.element_size() * (dist.get_world_size(group) - 1)
            return me._ag(tensor_list, tensor, group, async_op)

        dist.all_to_all_single = all_to_all_single
        dist.all_gather = all_gather


# --------------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------------

def _setup_torch(device_type: str) -> None:
    if device_type == "cpu":
        torch.set_num_threads(1)              # R ranks share the machine's cores
        torch._inductor.config.compile_threads = 1
    # The job compiles forward + loss; AOTAutograd compiles the matching backward graphs and
    # loss.backward() runs outside dynamo, so trace_autograd_ops is not needed.  The SGD update
    # and the replicated-grad all-reduce stay eager (torch.optim's step graph-breaks anyway).
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)


def rank_main(cfg: JobConfig, rank: int, R: int, device: torch.device) -> Optional[dict]:
    """Runs on every rank inside an initialised process group; returns the results on rank 0."""
    from torch._dynamo.utils import counters

    from moonep_ops.buffer import Buffer
    from .model import batch, build_model, full_weights, load_weights, step_routing
    from .stats import routing_stats

    _setup_torch(device.type)
    group = dist.group.WORLD
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    elem = torch.finfo(dtype).bits // 8
    L, E, K, D, F, s = cfg.layers, cfg.E, cfg.K, cfg.D, cfg.F, cfg.tokens
    cost = dict(slack=cfg.slack, expert_dim=F) if cfg.policy == "cost" else {}
    buf = Buffer(s, D, K, E, group=group, token_padding=cfg.token_padding, dtype=dtype,
                 device=device, policy=cfg.policy, backend=cfg.ep_backend, **cost)
    # the wire counter sees torch.distributed collectives only; a device backend (symmetric
    # memory) moves MoonEP's rows without them, so its wire bytes are not measured
    from moonep_ops.backends import CollectiveBackend
    wire_measured = {"moonep": isinstance(buf.backend, CollectiveBackend), "baseline": True}
    weights = full_weights(L, E, D, F, cfg.seed)
    models, compiled = {}, {}
    T = R * s
    for kind in MODELS:
        m = build_model(kind, L=L, E=E, K=K, D=D, F=F, s=s, dtype=dtype, device=device,
                        group=group, buffer=buf)
        load_weights(m, weights, rank)
        models[kind] = m

        fn = functools.partial(LOSS[kind], m, scale=1.0 / (T * D))
        # The baseline's segment sizes follow the routing, so its graphs (split at the host-sized
        # all-to-alls) would be compiled static, then recompiled dynamic at the first new size:
        # compile them dynamic at once (9 layers on CPU ranks: warm-up 49 -> 33 s, 7 -> 5 graphs).
        dyn = True if kind == "baseline" else None
        compiled[kind] = torch.compile(fn, fullgraph=(kind == "moonep"), dynamic=dyn) \
            if cfg.compile else fn
    init_state = {k: {n: t.detach().clone() for n, t in m.state_dict().items()}
                  for k, m in models.items()}

    wire = WireCounter()
    wire.install()

    def routing(v, step):
        return [step_routing(v, step, l, R, E, s, K, cfg.seed) for l in range(L)]

    def train_step(kind, x, y):
        m = models[kind]
        wire.on = True
        loss = compiled[kind](x, y)
        loss.backward()
        wire.on = False
        rep = [p for p in m.replicated_parameters() if p.grad is not None]
        if R > 1 and rep:
            flat = torch.cat([p.grad.reshape(-1).float() for p in rep])
            dist.all_reduce(flat, group=group)
            off = 0
            for p in rep:
                n = p.numel()
                p.grad.copy_(flat[off:off + n].view_as(p.grad))
                off += n
        with torch.no_grad():
            for p in m.parameters():
                if p.grad is not None:
                    p.sub_(p.grad * cfg.lr)      # not add_(grad, alpha=-lr): docs/moe.md
                    p.grad = None
        glob = loss.detach().float().clone()
        if R > 1:
            dist.all_reduce(glob, group=group)
        return float(glob)

    bar = None
    n_work = len(MODELS) * (2 + len(cfg.maxvio) * cfg.steps)
    if rank == 0 and cfg.progress:
        bar = _progress(n_work)

    # ---- warm-up: compile (the baseline dynamic from the start) ------------------------------
    warm = {}
    hot = max(cfg.maxvio)
    for kind in MODELS:
        counters.clear()
        dist.barrier()
        t0 = time.perf_counter()
        for i, v in enumerate((0.0, hot)):
            models[kind].set_routing([t[rank].to(device) for t in routing(v, 10_000 + i)])
            x, y = batch(10_000 + i, rank, s, D, cfg.seed, dtype, device)
            train_step(kind, x, y)
            if bar:
                bar.update(1, f"compile {kind}")
        dist.barrier()
        warm[kind] = dict(seconds=time.perf_counter() - t0,
                          graph_breaks=sum(counters["graph_break"].values()),
                          graphs=counters["stats"].get("unique_graphs", 0))

    # ---- the sweep ------------------------------------------------------------------------
    rows = []
    for v in cfg.maxvio:
        per_step_routing = [routing(v, st) for st in range(cfg.steps)]
        stats = None
        if rank == 0:
            stats = [[routing_stats(per_step_routing[st][l], E, D, F, elem, cfg.token_padding,
                                    cfg.policy, buf.slack_ppm, buf.replica_cost)
                      for l in range(L)] for st in range(cfg.steps)]
        for kind in MODELS:
            m = models[kind]
            m.load_state_dict(init_state[kind])
            counters.clear()
            times, losses, wires, recv_meas = [], [], [], []
            if device.type == "cuda":   # peak memory of this model's steps (the baseline's
                torch.cuda.reset_peak_memory_stats(device)   # buffers grow with the imbalance)
            for st in range(cfg.steps):
                m.set_routing([t[rank].to(device) for t in per_step_routing[st]])
                x, y = batch(st, rank, s, D, cfg.seed, dtype, device)
                wire.bytes = 0
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dist.barrier()
                t0 = time.perf_counter()
                losses.append(train_step(kind, x, y))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
                wires.append(wire.bytes)
                if kind == "baseline":
                    recv_meas.append([layer.last_recv_rows for layer in m.layers])
                if bar:
                    bar.update(1, f"maxvio {v:g} {kind}")
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            got = [None] * R
            dist.all_gather_object(got, dict(times=times, wires=wires, recv=recv_meas, peak=peak))
            if rank == 0:
                rows.append(_summarise(v, kind, stats, got, losses, counters, cfg))
                if not wire_measured[kind]:
                    rows[-1]["wire_bytes"] = None
    if bar:
        bar.close()
    profiles = _profile_steps(models, routing, train_step, cfg, rank, s, D, dtype, device) \
        if cfg.profile else {}
    if rank != 0:
        return None
    out = dict(config=dataclasses.asdict(cfg), R=R, device=str(device), dtype=str(dtype),
               ep_backend=type(buf.backend).__name__,
               torch=torch.__version__, warmup=warm, rows=rows)
    if profiles:
        out["profile"] = profiles
    return out


def _profile_steps(models, routing, train_step, cfg, rank, s, D, dtype, device) -> dict:
    """One warm step, then one profiled step of each model at the hottest maxvio: the ops with
    the largest self time (device time on CUDA, CPU time otherwise) as a text table per model
    (rank 0's view; every rank runs the same steps, the collectives need them all)."""
    from torch.profiler import ProfilerActivity, profile

    from .model import batch

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    v = max(cfg.maxvio)
    tables = {}
    for kind in MODELS:
        models[kind].set_routing([t[rank].to(device) for t in routing(v, 30_000)])
        x, y = batch(30_000, rank, s, D, cfg.seed, dtype, device)
        train_step(kind, x, y)
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        with profile(activities=acts) as prof:
            train_step(kind, x, y)
            if cuda:
                torch.cuda.synchronize(device)
        avg = prof.key_averages()
        sort = "self_cpu_time_total"
        if cuda:   # the name changed across torch versions
            sort = "self_device_time_total" if hasattr(avg[0], "self_device_time_total") \
                else "self_cuda_time_total"
        tables[kind] = (f"{kind}: one training step at maxvio {v:g}, rank {rank}, sorted by "
                        f"{sort}\n" + avg.table(sort_by=sort, row_limit=30) + "\n")
    return tables


def _summarise(v, kind, stats, got, losses, counters, cfg) -> dict:
    R = len(got)
    steps = len(losses)
    step_ms = [1e3 * max(g["times"][i] for g in got) for i in range(steps)]
    key = "moonep_recv" if kind == "moonep" else "base_recv"
    # ranks sorted by load in every (step, layer), heaviest first, then averaged: the hot
    # expert's home rank changes from step to step, a plain per-rank mean would hide it
    per_rank = [statistics.fmean(sorted(st[l][key], reverse=True)[r]
                                 for st in stats for l in range(len(st))) for r in range(R)]
    recv_max = statistics.fmean(max(st[l][key]) for st in stats for l in range(len(st)))
    recv_mean = statistics.fmean(per_rank)
    flat = [x for st in stats for x in st]
    row = dict(
        maxvio_target=v, maxvio=statistics.fmean(x["maxvio"] for x in flat), model=kind,
        recv_per_rank=per_rank, recv_max=recv_max, recv_mean=recv_mean,
        redundant=(statistics.fmean(x["redundant"] for x in flat) if kind == "moonep" else 0.0),
        token_bytes=sum(x["moonep_token_bytes" if kind == "moonep" else "base_token_bytes"]
                        for x in flat) / steps,
        weight_bytes=(sum(x["moonep_weight_bytes"] for x in flat) / steps
                      if kind == "moonep" else 0.0),
        wire_bytes=statistics.fmean(sum(g["wires"][i] for g in got) for i in range(steps)),
        step_ms=step_ms, step_ms_median=statistics.median(step_ms),
        peak_mem_mib=(max(g["peak"] for g in got) / 2**20
                      if all(g.get("peak") is not None for g in got) else None),
        loss=losses, graph_breaks=sum(counters["graph_break"].values()),
        recompiles=counters["stats"].get("unique_graphs", 0),
    )
    if kind == "baseline":
        # what the baseline's layers really received, per step and layer: max over ranks
        row["recv_max_measured"] = statistics.fmean(
            max(g["recv"][i][l] for g in got) for i in range(steps) for l in range(len(stats[0])))
    return row


class _progress:
    """tqdm when it is installed, else a one-line text bar on stderr."""

    def __init__(self, total: int):
        self.total, self.n = total, 0
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
        except ImportError:
            self.bar = None

    def update(self, k: int, desc: str = ""):
        self.n += k
        if self.bar is not None:
            self.bar.set_description(desc, refresh=False)
            self.bar.update(k)
        else:
            w = 30
            f = int(w * self.n / self.total)
            print(f"\r[{'#' * f}{'.' * (w - f)}] {self.n}/{self.total} {desc:<28}", end="",
                  file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        else:
            print(file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------

def _spawned(rank: int, cfg: JobConfig, R: int, init_file: str, out_file: str) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=R, timeout=datetime.timedelta(seconds=cfg.timeout_s))
        res = rank_main(cfg, rank, R, torch.device("cpu"))
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(res, f)
        dist.barrier()
    except BaseException:
        sys.stderr.write(f"[rank {rank}] " + traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)                # never leave the parent waiting on a wedged group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_spawn(cfg: JobConfig) -> dict:
    """R gloo ranks on this machine (spawned processes, a FileStore in a temporary folder)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="moonep_job_") as tmp:
        init_file, out_file = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        procs = [ctx.Process(target=_spawned, args=(r, cfg, cfg.R, init_file, out_file),
                             daemon=False) for r in range(cfg.R)]
        for p in procs:
            p.start()
        deadline = time.time() + cfg.timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.time()))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join()
        codes = [p.exitcode for p in procs]
        if alive or any(codes) or not os.path.exists(out_file):
            why = "timed out" if alive else "a rank failed"
            raise RuntimeError(f"main job {why} (exit codes {codes})")
        with open(out_file) as f:
            return json.load(f)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_torchrun(cfg: JobConfig) -> Optional[dict]:
    """Join the torchrun group: NCCL on CUDA (one GPU per rank), gloo on CPU."""
    use_cuda = torch.cuda.is_available() and cfg.backend != "gloo"
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kw = dict(device_id=device) if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout_s), **kw)
    try:
        res = rank_main(cfg, dist.get_rank(), dist.get_world_size(), device)
        dist.barrier()                 # no rank tears the group down while a peer still uses it
        return res
    finally:
        dist.destroy_process_group()
