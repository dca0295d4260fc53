"""Fine-tune a Hugging Face transformers MoE model with MoonEP expert parallelism the way it is
done at full size -- no rank ever holds the whole model -- save it, and reload it in plain
transformers.

    python examples/hf_finetune.py                      # 4 gloo ranks spawned on this CPU machine
    torchrun --nproc-per-node 8 examples/hf_finetune.py --model path/to/checkpoint   # GPUs, NCCL

Every rank builds the model on the meta device (no memory), ``hf.convert_model`` allocates its
E/R home experts, ``hf.fully_shard_dense`` shards everything else with FSDP2 over all ranks,
``hf.load_pretrained`` reads only this rank's experts and shard rows from the checkpoint, and each
rank trains on its own batch (``hf.reduce_expert_grads`` gives the expert grads FSDP's scaling).
At the end ``hf.save_pretrained`` writes each rank's share in the hub layout, and a plain
``from_pretrained`` of it reproduces the fine-tuned model's logits.  Without ``--model`` a tiny
random Qwen3-MoE (8 experts, top-2, 2 layers) is written as the starting checkpoint, so the
example runs anywhere in about a minute.
"""
from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128,
                         moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True, max_position_embeddings=128,
                         tie_word_embeddings=False)
    torch.manual_seed(0)                              # the same weights on every rank
    return Qwen3MoeForCausalLM(cfg)


def train(args) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM
    from moonep_ops.integrations import hf
    rank, R = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.cuda else torch.device("cpu")
    dtype = torch.bfloat16 if args.cuda else torch.float32
    path = args.model
    if path is None:                                   # the starting checkpoint, written once
        path = os.path.join(args.out, "start")
        if rank == 0:
            tiny_qwen3_moe().to(dtype).save_pretrained(path)
        dist.barrier()
    with torch.device("meta"):                         # no memory on any rank
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    hf.convert_model(model, capacity=args.batch * args.seq, device=device,
                     token_padding=128 if args.cuda else 8)
    hf.fully_shard_dense(model, init_device_mesh(device.type, (R,)))    # EP over all R ranks
    report = hf.load_pretrained(model, path)           # this rank's experts and shard rows only
    model.train()
    print(f"rank {rank}: read {report.bytes_read} B in {report.files} file(s)", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = model.config.vocab_size
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)          # each rank its own batch
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        hf.reduce_expert_grads(model)                  # FSDP averaged the rest over the ranks
        opt.step()
        losses = [torch.zeros(()) for _ in range(R)]
        dist.all_gather_object(losses, float(loss.detach()))
        if rank == 0:
            print(f"step {step}: loss per rank " + " ".join(f"{v:.4f}" for v in losses), flush=True)
    probe = torch.arange(args.seq, device=device).view(1, -1) % vocab
    model.eval()
    with torch.no_grad():                              # every rank: FSDP gathers collectively
        want = model(input_ids=probe).logits.float().cpu()
    out = os.path.join(args.out, "finetuned")
    hf.save_pretrained(model, out)                     # each rank writes its share
    if rank == 0:
        fresh = AutoModelForCausalLM.from_pretrained(out).to(device=device, dtype=dtype)
        with torch.no_grad():
            got = fresh.eval()(input_ids=probe).logits.float().cpu()
        diff = float((got - want).abs().max())
        print(f"saved to {out}; plain transformers reloads it: max |logits diff| = {diff:.2e}",
              flush=True)
        if diff > (1e-4 if dtype == torch.float32 else 0.1):
            raise SystemExit("the reloaded checkpoint does not reproduce the fine-tuned model")
    dist.barrier()


def _spawned(rank, R, init_file, args):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=R,
                            timeout=datetime.timedelta(seconds=300))
    try:
        torch.set_num_threads(1)
        train(args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="a transformers MoE checkpoint directory (default: a tiny one, written)")
    ap.add_argument("--ranks", type=int, default=4, help="gloo ranks to spawn (not under torchrun)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "moonep_hf_finetune"))
    args = ap.parse_args(argv)
    if "RANK" in os.environ:                           # torchrun: NCCL on GPUs, gloo on CPUs
        args.cuda = torch.cuda.is_available()
        if args.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if args.cuda else "gloo")
        try:
            train(args)
        finally:
            dist.destroy_process_group()
        return
    args.cuda = False
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.ranks, os.path.join(tmp, "store"), args), nprocs=args.ranks)


if __name__ == "__main__":
    main()
