#!/usr/bin/env python
"""Train a tiny torchtitan 0.3.0 MoE model (Qwen3-MoE or DeepSeek-V3) with MoonEP expert
parallelism, driven by torchtitan's own Trainer.

MoonEP is switched on by one line of the Trainer config, torchtitan's override mechanism::

    config.override.imports.append(moonep_override(capacity=local_batch_size * seq_len))

(on torchtitan's CLI: ``--override.imports 'moonep_ops.integrations.torchtitan.moonep={"capacity": N}'``).
Everything else is torchtitan's: router, load-balancing bias and its optimizer hook, shared
experts, FSDP2, parameter names and checkpoint layout.  ``--baseline`` runs torchtitan's own
all-to-all EP instead, on the same data from the same weights, to compare the losses.

    # CPU, gloo (EP divides the number of ranks)
    torchrun --nproc-per-node 2 examples/torchtitan_moonep.py --model qwen3 --ep 2
    torchrun --nproc-per-node 2 examples/torchtitan_moonep.py --model qwen3 --ep 2 --baseline
    # GPUs, NCCL: the same command
    torchrun --nproc-per-node 4 examples/torchtitan_moonep.py --model dsv3 --ep 4

Needs torchtitan 0.3.0 without its dependencies (so that pip never replaces your torch) plus its
pure-Python needs (docs/integrations.md, "torchtitan")::

    pip install torchtitan==0.3.0 --no-deps
    pip install spmd_types==0.2.3 einops tyro safetensors
    pip install torchdata==0.11.0 --no-deps
    pip install tokenizers tensorboard "datasets>=3.6.0,<4.8.0"

and examples/torchtitan_tiny.py beside this file: the tiny models (SDPA
attention: FlexAttention needs compiled flex kernels), a synthetic token stream (no tokenizer or
dataset download: every run sees the same global batch at every step, split over the
data-parallel ranks) and the shared initial weights.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

# the tiny models (and, on a CPU-only torch, torchtitan's CPU shims: imported first)
from torchtitan_tiny import (GLOBAL_BATCH, MODELS, SEQ_LEN, VOCAB, expert_layout, global_batch,
                             reference_state_dict)

from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import (LRSchedulersContainer, default_adamw,
                                             register_moe_load_balancing_hook)
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import OverrideConfig
from torchtitan.config.configs import (CompileConfig, DebugConfig, ParallelismConfig,
                                       TrainingConfig)
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from moonep_ops.integrations.torchtitan import moonep_layers, moonep_override

if torch.cuda.is_available():
    def gloo_parallelize(fn):
        return fn
else:
    from moonep_ops.testing.torchtitan_cpu import gloo_parallelize  # FSDP over gloo


# -- synthetic tokens (what the Trainer builds from config; no downloads) --------------------------
class TinyTokenizer(BaseTokenizer):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = VOCAB

    def __init__(self, config: Config, *, tokenizer_path: str | None = None):
        super().__init__()
        self.vocab_size, self.eos_id = config.vocab_size, 0

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SyntheticLoader(BaseDataLoader):
    """This data-parallel rank's rows of the same global batch, every run."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        num_batches: int = 1000

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer=None,
                 seq_len: int, local_batch_size: int, snapshot_every_n_steps=None):
        assert seq_len == SEQ_LEN and local_batch_size * dp_world_size == GLOBAL_BATCH
        self.n, self.lo, self.hi = config.num_batches, dp_rank * local_batch_size, \
            (dp_rank + 1) * local_batch_size

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for step in range(self.n):
            rows = global_batch(step)[self.lo:self.hi]
            yield {"input": rows[:, :-1].contiguous()}, rows[:, 1:].contiguous()

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass


# -- the Trainer config: torchtitan's own, plus one override line for MoonEP ------------------------
def trainer_config(model: str, ep: int, *, moonep: bool = True, steps: int = 3, lr: float = 3e-3,
                   param_dtype: str = "float32", token_padding: int | None = None,
                   spmd_backend: str = "partial_dtensor", compile_backend: str | None = None,
                   ac: str = "none", capacity: int | None | str = "job",
                   dump_folder: str | None = None) -> Trainer.Config:
    """torchtitan's Trainer.Config for the tiny ``model`` on all ranks with EP degree ``ep``.
    ``moonep``: add MoonEP's override (capacity "job": local_batch_size * seq_len, what the job
    gives each rank; None: taken from the first forward).  ``ac``: "none", "full", "selective"."""
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if world % ep or GLOBAL_BATCH % world:
        raise ValueError(f"EP={ep} must divide the {world} ranks, which must divide {GLOBAL_BATCH}")
    factory, parallelize = MODELS[model]
    local_batch = GLOBAL_BATCH // world
    config = Trainer.Config(
        model_spec=ModelSpec(name=model, flavor="tiny", model=factory(),
                             parallelize_fn=gloo_parallelize(parallelize), pipelining_fn=None,
                             post_optimizer_build_fn=register_moe_load_balancing_hook,
                             state_dict_adapter=None),
        hf_assets_path="unused",
        dump_folder=dump_folder or os.path.join(tempfile.gettempdir(), "torchtitan_moonep"),
        tokenizer=TinyTokenizer.Config(), dataloader=SyntheticLoader.Config(),
        optimizer=default_adamw(lr=lr), lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0),
        training=TrainingConfig(local_batch_size=local_batch, seq_len=SEQ_LEN, steps=steps,
                                max_norm=1.0, mixed_precision_param=param_dtype,
                                disable_cuda_graphs=True),
        # partial_dtensor: torchtitan's own all-to-all under the default spmd_types backend uses
        # gloo's list all_to_all, which refuses uneven splits (the baseline needs this on CPU).
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1, expert_parallel_degree=ep,
                                      spmd_backend=spmd_backend),
        activation_checkpoint={"none": None, "full": FullAC.Config(),
                               "selective": SelectiveAC.Config()}[ac],
        compile=CompileConfig(enable=compile_backend is not None, components=["model"],
                              backend=compile_backend or "inductor"),
        metrics=MetricsProcessor.Config(log_freq=1), checkpoint=CheckpointManager.Config(enable=False),
        debug=DebugConfig(seed=0), loss=CrossEntropyLoss.Config(), override=OverrideConfig())
    if moonep:
        # token_padding None: MoonEP's default, 128 on NCCL (the grouped GEMM's tiles), else 1
        # S = tokens per rank per MoE forward = local_batch_size * seq_len / (cp * tp)
        if capacity == "job":
            capacity = local_batch * SEQ_LEN
        config.override.imports.append(
            moonep_override(capacity=capacity, token_padding=token_padding))
    return config


def train(model: str, ep: int, *, moonep: bool = True, steps: int = 3, **kw) -> dict:
    """Build torchtitan's Trainer, load the reference weights, train ``steps`` steps.  Returns
    {"steps": [{step, loss, grad_norm}], "layout": expert_layout(model), "expert_bias": [...]}.
    Needs torch.distributed initialised (torchrun, or the caller)."""
    trainer = Trainer(trainer_config(model, ep, moonep=moonep, steps=steps, **kw))
    net = trainer.model_parts[0]
    assert bool(moonep_layers(net)) == moonep      # the override replaced every RoutedExperts
    set_model_state_dict(net, reference_state_dict(model),
                         options=StateDictOptions(full_state_dict=True, strict=True))
    layout = expert_layout(net)
    records = []
    log = trainer.metrics_processor.log

    def record(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        # logged after the optimizer step, so expert_bias_E holds this step's balancing update
        bias = [(b.full_tensor() if isinstance(b, DTensor) else b).tolist()
                for n, b in net.named_buffers() if n.endswith("expert_bias_E")]
        records.append({"step": step, "loss": float(global_avg_loss),
                        "grad_norm": float(grad_norm), "expert_bias": bias})
        return log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    trainer.metrics_processor.log = record
    trainer.train()
    trainer.close()
    return {"steps": records, "layout": layout}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    p.add_argument("--ep", type=int, default=int(os.environ.get("WORLD_SIZE", 1)))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="FSDP2 param dtype (torchtitan's default is bfloat16)")
    p.add_argument("--baseline", action="store_true",
                   help="torchtitan's own all-to-all EP instead of MoonEP")
    p.add_argument("--spmd-backend", choices=["partial_dtensor", "spmd_types", "full_dtensor"],
                   default="partial_dtensor", help="torchtitan's parallelism.spmd_backend")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="torch.compile every block (fullgraph), backend inductor by default "
                        "(aot_eager on machines without a C++ toolchain)")
    p.add_argument("--ac", choices=["none", "full", "selective"], default="none",
                   help="activation checkpointing of every block")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:          # plain `python`: one process (EP = 1, torchtitan's path)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    # the Trainer initialises torch.distributed itself (NCCL on GPUs, gloo on CPU)
    what = "torchtitan a2a EP" if args.baseline else "MoonEP"
    if args.ep == 1:
        what += " (EP = 1: torchtitan's local experts)"
    out = train(args.model, args.ep, moonep=not args.baseline, steps=args.steps, lr=args.lr,
                param_dtype=args.param_dtype, spmd_backend=args.spmd_backend,
                compile_backend=args.compile, ac=args.ac)
    if dist.get_rank() == 0:
        for r in out["steps"]:
            print(f"[{what} {args.model} R={dist.get_world_size()} EP={args.ep}] step {r['step']} "
                  f"loss {r['loss']:.8f} grad_norm {r['grad_norm']:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
