"""Hugging Face models converted to MoonEP on the GPU (one rank, the CUDA symmetric-memory
backend): bf16 logits within bf16 tolerance of the unconverted model, and a CUDA-graph captured
training step (forward + backward of the whole model) that replays under new routing with the
results of an eager step."""
from __future__ import annotations

import copy

import pytest
import torch

from moonep_ops import native

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or native.ep() is None
                                or native.gemm() is None,
                                reason="needs a CUDA device and both moonep libraries")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from moonep_ops.backends import SymmBackend  # noqa: E402
from moonep_ops.integrations import hf  # noqa: E402

from test_integrations_hf import BATCH, SEQ, batch, tiny  # noqa: E402

FAMS = ["qwen3_moe", "deepseek_v3", "qwen2_moe", "mixtral", "olmoe"]


def _converted(name, dtype):
    ref = tiny(name).to(device="cuda", dtype=dtype)
    model = copy.deepcopy(ref)
    hf.convert_model(model, capacity=BATCH * SEQ, token_padding=128)
    bufs = {id(b.moe.buffer): b.moe.buffer for b in hf.converted_blocks(model).values()}
    assert all(isinstance(b.backend, SymmBackend) for b in bufs.values())
    return ref, model


@pytest.mark.parametrize("name", FAMS)
def test_bf16_logits_close_to_hf(name):
    ref, model = _converted(name, torch.bfloat16)
    ids = batch(0).cuda()
    with torch.no_grad():
        want = ref(ids).logits.float()
        got = model(ids).logits.float()
    # a few bf16 ulps of the logits' scale: the experts' GEMMs differ from HF's in summation order
    tol = 4 * 2 ** -8 * float(want.abs().max())
    assert float((got - want).abs().max()) <= tol, (float((got - want).abs().max()), tol)
    for b in {id(b.moe.buffer): b.moe.buffer for b in hf.converted_blocks(model).values()}.values():
        b.check_errors()


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_captured_training_step_replays_under_new_routing(name):
    torch.manual_seed(0)
    _, model = _converted(name, torch.bfloat16)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    static_ids = batch(0).cuda()

    def step():
        out = model(static_ids, labels=static_ids)
        out.loss.backward()
        return out.loss.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                     # warm-up outside the capture
        for _ in range(2):
            for p in params:
                p.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    static_grads = [p.grad for p in params]            # written by every replay
    for i in range(1, 4):                              # new batches: new routing, same shapes
        ids = batch(0, step=i).cuda()
        static_ids.copy_(ids)
        graph.replay()
        torch.cuda.synchronize()
        replay_loss = static_loss.clone()
        replay_grads = [g.clone() for g in static_grads]
        for p in params:
            p.grad = None
        eager_loss = step()
        torch.cuda.synchronize()
        assert torch.equal(replay_loss, eager_loss), (i, float(replay_loss), float(eager_loss))
        for p, g in zip(params, replay_grads):
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
        for p in params:
            p.grad = None
    for b in {id(b.moe.buffer): b.moe.buffer for b in hf.converted_blocks(model).values()}.values():
        b.check_errors()
