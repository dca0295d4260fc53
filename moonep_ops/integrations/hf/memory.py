"""The per-rank memory plan of a transformers MoE model converted to MoonEP, at full size, on a CPU.

    python -m moonep_ops.integrations.hf.memory --model deepseek-v3 --ep 64 --dense-fsdp
    python -m moonep_ops.integrations.hf.memory --model kimi-k2 --ep 64 --rank 63 --fsdp 64 --json
    python -m moonep_ops.integrations.hf.memory --table        # the table of docs/integrations.md
    python -m moonep_ops.integrations.hf.memory --list         # the embedded configs

How.  The family's real config (``CONFIGS``, model_configs.py: the published config.json's
fields) is built on the meta device, so a 1T-parameter model costs no memory and a fraction of a
second.  A process group of torch's ``fake`` backend (every collective a no-op) makes this one
process rank r of an R-rank job, and ``convert_model(..., device="meta")`` converts the model as
rank r would (with the plan's expert precision and FP8 weight cache): its E/R home experts per
sparse block, the Buffer and its ExpertPool, all on the meta device.  What rank r holds is then
read off the converted model: the parameters' and module buffers' shapes and dtypes, the
ExpertPool's tensors (``ExpertPool.nbytes``), the Buffer's backend tensors.

What is counted, per rank (``plan``), in ``hf.fully_shard_dense``'s layout (``--fsdp N``: the
dense part sharded over N data-parallel ranks that contain the EP group, N a multiple of R; N = 1:
replicated):

  experts     the routed experts (w1, w3, w2; biases) of every sparse block: E/R each (with
              ``--shard-experts``: FSDP-sharded over the N / R ranks that hold the same ones)
  dense       every other parameter (attention, embeddings, norms, dense MLPs, routers, shared
              experts), each as FSDP2 shards dim 0 over the N ranks: ceil(dim0 / N) rows stored
              on every rank (FSDP2 pads the shards to that size); and the module buffers (not
              sharded; the FP8 weight caches apart)
  fp8 weight cache
              precision "fp8" with ``fp8_weight_cache``: each sparse block's FP8WeightCache (its
              home experts' e4m3 weights in both layouts and their block scales),
              ``cache_nbytes(E/R, F, D)``, about 6 (E/R) D F bytes: the bf16 experts' size again
              (measured: the cache's buffers, which the meta conversion builds)
  grads       one per trainable parameter, as large as its (sharded) storage, in ``grad_dtype``
              (default: the parameter's own dtype, which is what autograd, FSDP2 without a
              mixed-precision policy and MoonEP's expert backward write)
  optimizer   AdamW's exp_avg and exp_avg_sq (SGD's momentum: one state) in ``state_dtype``
              (default fp32) of the rank's unpadded shard; ``master``: an fp32 copy of the
              parameters besides (mixed-precision training keeps one)
  in flight   with FSDP, an estimate of what FSDP2 holds unsharded during a step: the root unit
              (embeddings, lm_head, final norm) from the forward to the end of the backward, with
              its grads; two decoder layers' parameters (the one computing, the one prefetched)
              and one layer's grads
  Buffer      the data plane's state.  On GPUs the CUDA symmetric-memory backend runs, which
              cannot be built without a GPU: its bytes are ``symm_buffer_bytes`` (the regions of
              ``SymmBackend._allocate``).  The torch.distributed backend that the conversion here
              builds is measured from its tensors and reported beside it.
  pool        the ExpertPool: E/R slot weights and E/R slot grads of one expert shape, once per
              process whatever the number of layers (measured: ``ExpertPool.nbytes``; precision
              "fp8": e4m3 slot weights with their scales, bf16 slot grads).  The Buffer's staging
              is the same in both precisions (sized for the model's dtype, docs/fp8.md "Bytes")

Not counted: activations (everything whose size depends on the batch beyond the Buffer's
capacity S: the routed rows, the expert GEMMs' intermediates, attention, the loss's logits),
NCCL's and the CUDA context's own memory, and the caching allocator's fragmentation.  "Fits"
compares the counted total with the memory torch can allocate on the card (``CARDS``): what is
left is what activations can use.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ...geometry import GroupSpec
from ...ops.moe_experts import ExpertPool
from ... import registry
from .convert import converted_blocks, convert_model, expert_parameter_names
from .fsdp import _decoder_layers     # the FSDP units below the root that fully_shard_dense makes
from .model_configs import CONFIGS, build_meta, experts_of

GiB = 1 << 30

# Usable memory of the cards the plan is checked against: what torch can allocate on the card
# once the CUDA context exists (about 78 GiB of an 80 GB H100, about 139 GiB of a 141 GB H200).
CARDS = {"80GB": 78 * GiB, "141GB": 139 * GiB}

TABLE_MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2")
TABLE_EPS = (8, 16, 64)


# ---------------------------------------------------------------------------------------------
# A rank of an R-rank job in this process
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int):
    """torch.distributed initialised with the ``fake`` backend as rank ``rank`` of
    ``world_size`` (collectives are no-ops; ``all_gather_object`` returns this rank's object R
    times), destroyed on exit.  torch registers the backend in its testing package."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; the memory plan makes its "
                           "own (fake) process group")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Precision:
    """The training state's dtypes.  ``grad_dtype`` / ``state_dtype`` None: the parameter's.
    ``experts``, ``fp8_weight_cache``: convert_model's ``precision`` and ``fp8_weight_cache``."""
    grad_dtype: Optional[torch.dtype] = None
    optimizer: str = "adamw"                 # "adamw" (2 states), "sgd" (momentum: 1), "none"
    state_dtype: Optional[torch.dtype] = torch.float32
    master: bool = False                     # an fp32 copy of every parameter
    experts: str = "bf16"                    # the routed experts' precision, "bf16" or "fp8"
    fp8_weight_cache: bool = False

    @property
    def n_states(self) -> int:
        return {"adamw": 2, "sgd": 1, "none": 0}[self.optimizer]

    def describe(self) -> str:
        name = lambda d: "the param dtype" if d is None else str(d).replace("torch.", "")  # noqa: E731
        s = f"grads in {name(self.grad_dtype)}"
        if self.n_states:
            s += f", {self.optimizer} {self.n_states} state(s) in {name(self.state_dtype)}"
        if self.master:
            s += ", fp32 master copy"
        return s


def fsdp_rows(dim0: int, n: int, rank: int) -> tuple[int, int]:
    """(padded, unpadded) dim-0 rows of ``rank``'s FSDP2 shard of a parameter with ``dim0`` rows
    over ``n`` ranks: FSDP2 splits dim 0 as ``torch.chunk`` (chunks of ceil(dim0/n) rows, the
    last ones shorter or empty) and pads every rank's storage to ceil(dim0/n) rows."""
    per = -(-dim0 // n)
    return per, max(0, min(per, dim0 - rank * per))


def _shard(p: torch.Tensor, n: int, rank: int) -> tuple[int, int]:
    """(stored, unpadded) elements of ``rank``'s FSDP2 shard of ``p`` over ``n`` ranks (n = 1:
    the whole tensor)."""
    if n == 1 or p.dim() == 0:
        return p.numel(), p.numel()
    rest = p.numel() // p.shape[0]
    padded, rows = fsdp_rows(p.shape[0], n, rank)
    return padded * rest, rows * rest


@dataclasses.dataclass
class Part:
    """Per-rank elements and bytes of one group of tensors."""
    numel: int = 0
    bytes: int = 0

    def add(self, numel: int, itemsize: int) -> None:
        self.numel += numel
        self.bytes += numel * itemsize


@dataclasses.dataclass
class Plan:
    """What one rank holds (bytes), and where it came from."""
    model: str
    R: int
    rank: int                      # place among the fsdp ranks (EP rank: rank % R)
    fsdp: int                      # N, the dense part's FSDP ranks (1: replicated)
    shard_experts: bool            # experts FSDP-sharded over the N / R ranks holding them
    capacity: int
    token_padding: int
    dtype: str
    precision: str
    experts: str                   # their precision, "bf16", "fp8" or "fp8 + weight cache"
    total_params: int              # the unconverted model's parameter count
    expert_params_total: int       # all experts of all blocks (elements)
    parts: dict                    # name -> {"numel", "bytes"}
    buffer_symm: int               # CUDA symmetric-memory backend (formula), all Buffers
    buffer_torch: int              # torch.distributed backend here (measured), all Buffers
    pool: int                      # ExpertPools (measured)
    n_buffers: int
    seconds: dict

    @property
    def model_states(self) -> int:
        return sum(p["bytes"] for p in self.parts.values())

    @property
    def total(self) -> int:
        return self.model_states + self.buffer_symm + self.pool

    def fits(self) -> dict:
        return {card: cap - self.total for card, cap in CARDS.items()}

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(model_states=self.model_states, total=self.total, left=self.fits())
        return d


def symm_buffer_bytes(spec: GroupSpec, direct: bool = False) -> int:
    """Bytes of one Buffer's CUDA symmetric-memory backend state on one rank: the regions of
    ``SymmBackend._allocate`` (moonep_ops/backends/symm.py; the formula of
    docs/architecture.md, "Memory"): sig 8R, hist 4R(E+3), x_stage S*D*itemsize, desc 8*NvS,
    wland 4*NvS, and staged combine's y_stage NvS*D*itemsize + w_stage 4*NvS (a one-rank group's
    direct combine: ptab 24R instead), each at least 16 bytes (TorchSymmetricHeap), each with an
    int64 peer table [R]; plus the local epoch (8) and error word (16)."""
    R, E, S, NvS = spec.R, spec.E, spec.S, spec.NvS
    rb = spec.D * spec.dtype.itemsize
    regions = [8 * R, 4 * R * (E + 3), S * rb, 8 * NvS, 4 * NvS]
    regions += [24 * R] if direct else [NvS * rb, 4 * NvS]
    return sum(max(n, 16) + 8 * R for n in regions) + 8 + 16


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors that are attributes of ``obj`` (meta tensors included)."""
    seen, n = set(), 0
    for v in vars(obj).values():
        if isinstance(v, torch.Tensor) and id(v) not in seen:
            seen.add(id(v))
            n += v.numel() * v.element_size()
    return n


def account(model: nn.Module, *, fsdp: int = 1, rank: int = 0, shard_experts: bool = False,
            precision: Precision = Precision()) -> dict:
    """Per-rank bytes of a converted model (any device, meta included): ``{"parts": {name:
    Part}, "buffer_symm", "buffer_torch", "pool", "n_buffers"}``.

    The layout is ``hf.fully_shard_dense``'s: ``fsdp`` N > 1 shards the dense part (every
    parameter but the routed experts) over N data-parallel ranks that contain the model's EP
    group of R ranks (N a multiple of R; ``rank`` is this rank's place among them, its EP rank
    ``rank % R``); ``shard_experts`` also shards the experts over the N / R ranks holding the
    same ones (place ``rank // R``).  N = 1: nothing sharded (``rank`` is the EP rank)."""
    blocks = converted_blocks(model)
    R = next(iter(blocks.values())).moe.buffer.R if blocks else 1
    N = fsdp
    if N < 1 or (N > 1 and N % R):
        raise ValueError(f"fsdp must be 1 or a multiple of the EP size R={R} (the dense mesh "
                         f"contains the EP group), got {N}")
    if shard_experts and N <= R:
        raise ValueError(f"shard_experts shards the experts over the fsdp / R = {N // R} ranks "
                         "that hold the same ones: needs fsdp > R")
    if not 0 <= rank < max(N, R):
        raise ValueError(f"rank {rank} is outside [0, {max(N, R)})")
    replicas = N // R if shard_experts else 1
    experts = set(expert_parameter_names(model))
    parts = {k: Part() for k in ("experts", "dense", "module buffers", "fp8 weight cache",
                                 "grads", "optimizer", "master", "fsdp in flight")}
    for name, p in model.named_parameters():
        if name in experts:
            stored, unpadded = _shard(p, replicas, rank // R)
            parts["experts"].add(stored, p.element_size())
        else:
            stored, unpadded = _shard(p, N, rank % N)
            parts["dense"].add(stored, p.element_size())
        if p.requires_grad:
            parts["grads"].add(stored, (precision.grad_dtype or p.dtype).itemsize)
            parts["optimizer"].add(precision.n_states * unpadded,
                                   (precision.state_dtype or p.dtype).itemsize)
            if precision.master:
                parts["master"].add(unpadded, 4)
    caches = {id(t) for b in blocks.values() if b.moe.fp8_cache is not None
              for t in b.moe.fp8_cache.buffers()}
    for _, b in model.named_buffers():
        parts["fp8 weight cache" if id(b) in caches else "module buffers"].add(b.numel(),
                                                                               b.element_size())
    if N > 1:
        # FSDP2 all-gathers a unit's parameters for its forward and backward and reduce-
        # scatters its unsharded grads: the root unit (embeddings, lm_head, final norm) stays
        # unsharded from the forward to the end of the backward, with its grads; of the decoder
        # layers, the one computing and the one prefetched, and one layer's grads.
        expert_ids = {id(model.get_parameter(n)) for n in experts}

        def unsharded(ps):              # (param bytes, grad bytes, elements) of a unit
            ps = [p for p in ps if shard_experts or id(p) not in expert_ids]
            return (sum(p.numel() * p.element_size() for p in ps),
                    sum(p.numel() * (precision.grad_dtype or p.dtype).itemsize
                        for p in ps if p.requires_grad), sum(p.numel() for p in ps))
        in_layers, layers = set(), []
        for u in _decoder_layers(model):
            ps = list(u.parameters())
            in_layers |= {id(p) for p in ps}
            layers.append(unsharded(ps))
        root = unsharded([p for p in model.parameters() if id(p) not in in_layers])
        big = max(layers, default=(0, 0, 0))
        parts["fsdp in flight"] = Part(numel=root[2] + 2 * big[2],
                                       bytes=root[0] + root[1] + 2 * big[0] + big[1])
    buffers, pools = {}, {}
    for blk in blocks.values():
        moe = blk.moe
        buffers[id(moe.buffer)] = moe.buffer
        pool = registry.lookup(moe.pool_name, ExpertPool)
        pools[id(pool)] = pool
    return dict(parts=parts,
                buffer_symm=sum(symm_buffer_bytes(b.spec) for b in buffers.values()),
                buffer_torch=sum(_tensor_bytes(b.backend) for b in buffers.values()),
                pool=sum(p.nbytes() for p in pools.values()),
                n_buffers=len(buffers))


@contextlib.contextmanager
def converted(config, *, ep: int, rank: int = 0, capacity: int = 8192, token_padding: int = 128,
              dtype: torch.dtype = torch.bfloat16, precision: str = "bf16",
              fp8_weight_cache: bool = False):
    """The model of ``config`` (a transformers config, a ``CONFIGS`` name, or a model already
    built on the meta device) converted as rank ``rank`` of ``ep`` would convert it (a fake
    process group unless ep is 1; ``convert_model(device="meta")`` with these arguments); its
    Buffers are destroyed on exit.  Allocates nothing."""
    model = config if isinstance(config, nn.Module) else build_meta(config, dtype)
    with (fake_rank(rank, ep) if ep > 1 else contextlib.nullcontext()):
        convert_model(model, capacity=capacity, token_padding=token_padding, device="meta",
                      precision=precision, fp8_weight_cache=fp8_weight_cache)
        try:
            yield model
        finally:
            for blk in converted_blocks(model).values():
                if blk.moe.buffer is not None:
                    blk.moe.buffer.destroy()


def plan(name: str, *, ep: int, rank: int = 0, fsdp: int = 1, shard_experts: bool = False,
         capacity: int = 8192, token_padding: int = 128, dtype: torch.dtype = torch.bfloat16,
         precision: Precision = Precision()) -> Plan:
    """What rank ``rank`` holds once ``CONFIGS[name]`` is converted over an EP group of ``ep``
    ranks (as EP rank ``rank % ep``), in ``account``'s layout (``fsdp``, ``shard_experts``).
    Allocates nothing."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(CONFIGS)}")
    if ep < 1 or experts_of(name) % ep:
        raise ValueError(f"ep must divide {name}'s {experts_of(name)} experts, got {ep}")
    if fsdp < 1 or (fsdp > 1 and fsdp % ep):
        raise ValueError(f"fsdp must be 1 or a multiple of the EP size R={ep} (the dense mesh "
                         f"contains the EP group), got {fsdp}")
    t0 = time.perf_counter()
    model = build_meta(name, dtype)
    total = sum(p.numel() for p in model.parameters())
    with converted(model, ep=ep, rank=rank % ep, capacity=capacity, token_padding=token_padding,
                   precision=precision.experts, fp8_weight_cache=precision.fp8_weight_cache) as m:
        t1 = time.perf_counter()
        acc = account(m, fsdp=fsdp, rank=rank, shard_experts=shard_experts, precision=precision)
        e_total = ep * sum(m.get_parameter(n).numel() for n in expert_parameter_names(m))
    return Plan(model=name, R=ep, rank=rank, fsdp=fsdp, shard_experts=shard_experts,
                capacity=capacity, token_padding=token_padding,
                dtype=str(dtype).replace("torch.", ""), precision=precision.describe(),
                experts=precision.experts + " + weight cache" * precision.fp8_weight_cache,
                total_params=total, expert_params_total=e_total,
                parts={k: dataclasses.asdict(v) for k, v in acc["parts"].items()},
                buffer_symm=acc["buffer_symm"], buffer_torch=acc["buffer_torch"],
                pool=acc["pool"], n_buffers=acc["n_buffers"],
                seconds={"build and convert": round(t1 - t0, 3),
                         "account": round(time.perf_counter() - t1, 3)})


# ---------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


_LABELS = {"experts": "params: routed experts", "dense": "params: dense part",
           "module buffers": "module buffers", "fp8 weight cache": "FP8 weight cache",
           "grads": "grads", "optimizer": "optimizer states",
           "master": "fp32 master copy", "fsdp in flight": "FSDP2 units in flight"}


def report(p: Plan) -> str:
    c = CONFIGS[p.model]
    if p.fsdp == 1:
        dense = "replicated"
    else:
        dense = f"FSDP over {p.fsdp} ranks (FSDP2 dim-0 shards; this rank is {p.rank} of them)"
    ex = "E/R per block" + (f", FSDP over the {p.fsdp // p.R} ranks holding them"
                            if p.shard_experts else "")
    lines = [
        f"{p.model} ({c.hf_id}): {p.total_params / 1e9:.3f} B parameters built "
        f"({c.published_note}: {100 * (p.total_params / c.published - 1):+.2f} %)",
        f"EP rank {p.rank % p.R} of {p.R}: routed experts {p.expert_params_total / 1e9:.3f} B in "
        f"all, {ex}; dense part {dense}",
        f"{p.dtype} parameters, expert precision {p.experts}, {p.precision}; capacity S = "
        f"{p.capacity} tokens per rank, token_padding {p.token_padding}; {p.n_buffers} Buffer(s)",
        "",
        f"{'per rank':38}{'elements':>16}{'GiB':>10}",
    ]
    for k, v in p.parts.items():
        if v["bytes"] or k in ("experts", "dense", "grads"):
            lines.append(f"{_LABELS[k]:38}{v['numel']:>16,}{_gib(v['bytes']):>10}")
    lines += [
        f"{'Buffer (CUDA symmetric-memory backend)':38}{'':>16}{_gib(p.buffer_symm):>10}",
        f"{'ExpertPool (slot weights + slot grads)':38}{'':>16}{_gib(p.pool):>10}",
        f"{'total':38}{'':>16}{_gib(p.total):>10}",
        f"(the torch.distributed backend's Buffer would be {_gib(p.buffer_torch)} GiB)",
        "",
        "left for activations (not counted): " + ", ".join(
            f"{card} card ({CARDS[card] / GiB:.0f} GiB usable): {_gib(left)} GiB"
            + ("" if left >= 0 else " -- does not fit") for card, left in p.fits().items()),
        f"built and converted in {p.seconds['build and convert']} s (meta device"
        + (", fake process group)" if p.R > 1 else ")"),
    ]
    return "\n".join(lines)


TABLE_HEAD = ("| model | EP | dense part | params | grads | AdamW | FSDP in flight | Buffer + pool "
              "| total | 80 GB | 141 GB |\n|---|---|---|---|---|---|---|---|---|---|---|")


def table_row(p: Plan) -> str:
    """One row of the docs table: GiB per rank, and whether (and with how many GiB left for
    activations) the total fits each card."""
    b = {k: v["bytes"] for k, v in p.parts.items()}
    params = b["experts"] + b["dense"] + b["module buffers"] + b["fp8 weight cache"]
    left = p.fits()

    def fit(card):
        return f"yes ({_gib(left[card])})" if left[card] >= 0 else "no"

    dense = "replicated" if p.fsdp == 1 else f"FSDP {p.fsdp}"
    model = p.model if p.experts == "bf16" else f"{p.model} ({p.experts})"
    return (f"| {model} | {p.R} | {dense} | {_gib(params)} | {_gib(b['grads'])} | "
            f"{_gib(b['optimizer'] + b['master'])} | {_gib(b['fsdp in flight'])} | "
            f"{_gib(p.buffer_symm + p.pool)} | {_gib(p.total)} | {fit('80GB')} | "
            f"{fit('141GB')} |")


def table(models=TABLE_MODELS, eps=TABLE_EPS, **kw) -> list[Plan]:
    """Every model x EP, with the dense part replicated and FSDP-sharded over the EP ranks."""
    return [plan(m, ep=r, fsdp=n, **kw) for m in models for r in eps for n in (1, r)]


def smallest_ep(name: str, **kw) -> dict:
    """{card: the plan of the smallest EP size R (a multiple of 8 dividing E) whose per-rank
    total fits the card with the dense part sharded over the R ranks, or None}."""
    E = experts_of(name)
    out = {card: None for card in CARDS}
    for r in (r for r in range(8, E + 1, 8) if E % r == 0):
        p = plan(name, ep=r, fsdp=r, **kw)
        for card, left in p.fits().items():
            if out[card] is None and left >= 0:
                out[card] = p
        if all(v is not None for v in out.values()):
            break
    return out


_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _dtype_arg(s: str) -> Optional[torch.dtype]:
    if s == "param":
        return None
    try:
        return _DTYPE_NAMES[s]
    except KeyError:
        raise argparse.ArgumentTypeError(f"one of {sorted(_DTYPE_NAMES)} or 'param'") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m moonep_ops.integrations.hf.memory",
        description="Per-rank memory of a transformers MoE model converted to MoonEP, at its "
                    "real size: built on the meta device, converted as one rank of a fake "
                    "process group (no GPU, no weights, seconds).  Activations are not counted.")
    ap.add_argument("--model", choices=sorted(CONFIGS), help="an embedded real config")
    ap.add_argument("--ep", type=int, default=8, help="R, the EP group size (default 8)")
    ap.add_argument("--rank", type=int, default=0,
                    help="the rank to plan: its place among the --fsdp ranks (EP rank: rank %% R)"
                         " (default 0)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--fsdp", type=int, default=1, metavar="N",
                   help="shard the dense part over N data-parallel ranks as hf.fully_shard_dense "
                        "does, N a multiple of R (default 1: replicated)")
    g.add_argument("--dense-fsdp", action="store_true",
                   help="shard the dense part over the EP ranks (--fsdp R)")
    ap.add_argument("--shard-experts", action="store_true",
                    help="also shard the experts over the N / R ranks holding them")
    ap.add_argument("--capacity", type=int, default=8192,
                    help="S, the most tokens a rank passes to one forward (default 8192)")
    ap.add_argument("--token-padding", type=int, default=128)
    ap.add_argument("--dtype", type=_dtype_arg, default=torch.bfloat16,
                    help="the model's dtype (default bfloat16)")
    ap.add_argument("--grad-dtype", type=_dtype_arg, default=None,
                    help="grads' dtype (default 'param': the parameter's)")
    ap.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw")
    ap.add_argument("--state-dtype", type=_dtype_arg, default=torch.float32,
                    help="optimizer states' dtype (default float32; 'param': the parameter's)")
    ap.add_argument("--master", action="store_true", help="count an fp32 master copy")
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                    help="the routed experts' precision (convert_model's; default bf16)")
    ap.add_argument("--fp8-weight-cache", action="store_true",
                    help="with --precision fp8: each layer's FP8 weight cache (convert_model's)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    ap.add_argument("--table", action="store_true",
                    help=f"the docs table: {', '.join(TABLE_MODELS)} at EP "
                         f"{', '.join(map(str, TABLE_EPS))}, dense part replicated and FSDP over "
                         "the EP ranks, and the smallest EP that fits each card")
    ap.add_argument("--list", action="store_true", help="print the embedded configs")
    a = ap.parse_args(argv)
    prec = Precision(grad_dtype=a.grad_dtype, optimizer=a.optimizer, state_dtype=a.state_dtype,
                     master=a.master, experts=a.precision, fp8_weight_cache=a.fp8_weight_cache)
    kw = dict(capacity=a.capacity, token_padding=a.token_padding, dtype=a.dtype, precision=prec)
    if a.list:
        for c in CONFIGS.values():
            print(f"{c.name} ({c.hf_id}; {c.published_note})\n  {json.dumps(c.fields)}")
        return 0
    if a.table:
        plans = table(**kw)
        smallest = {m: smallest_ep(m, **kw) for m in TABLE_MODELS}
        if a.json:
            print(json.dumps({"plans": [p.to_json() for p in plans], "smallest_ep": {
                m: {card: p and p.to_json() for card, p in d.items()}
                for m, d in smallest.items()}}, indent=1))
            return 0
        print(TABLE_HEAD)
        for p in plans:
            print(table_row(p))
        print("\n| model | E | smallest EP that fits an 80 GB card | a 141 GB card |\n"
              "|---|---|---|---|")
        for m, d in smallest.items():
            cells = [f"{p.R} ({_gib(p.total)} GiB)" if p else "none" for p in d.values()]
            print(f"| {m} | {experts_of(m)} | " + " | ".join(cells) + " |")
        return 0
    if a.model is None:
        ap.error("--model is required (or --table, --list)")
    fsdp = a.ep if a.dense_fsdp else a.fsdp
    try:
        p = plan(a.model, ep=a.ep, rank=a.rank, fsdp=fsdp, shard_experts=a.shard_experts, **kw)
    except ValueError as e:
        ap.error(str(e))
    print(json.dumps(p.to_json(), indent=1) if a.json else report(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
