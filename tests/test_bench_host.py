"""The host-cost benchmarks on CPU (CI has no GPU): they run end to end at tiny
sizes and write what the GPU stage (scripts/gpu_check.sh, stage ``host``) reads; the
torchtitan-style reference layer computes what MoonEPMoE computes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_host_cost  # noqa: E402
import bench_layer_r1  # noqa: E402
from titan_style_layer import TitanStyleMoE  # noqa: E402


def test_host_cost_tiny_runs(tmp_path):
    assert bench_host_cost.main(["--tiny", "--rounds", "1", "--calls", "4", "--layer-calls", "2",
                                 "--steps", "1", "--profile-steps", "1",
                                 "--out", str(tmp_path)]) == 0
    md = (tmp_path / "host_cost.md").read_text()
    for section in ("### 1. Grouped GEMMs", "### 1b. Where the host time of one grouped_mm",
                    "### 2. The layer's ops", "### 3a. One eager", "### 3b. Where the host time",
                    "top 30 functions by self time"):
        assert section in md, section
    doc = json.loads((tmp_path / "host_cost.json").read_text())
    assert {r["kind"] for r in doc["gemm"]} == {"fwd", "dgrad", "wgrad"}
    assert all(r["torch"] > 0 and r["op"] > 0 and r["api"] > 0 and r["body"] > 0
               for r in doc["gemm"])
    assert all(r["native"] is None for r in doc["gemm"])      # no library on CPU
    ops = {row[0]: row for row in doc["layer"]["rows"]}
    assert not [r for r in ops.values() if "FAILED" in r[3]]
    assert ops["router"][1] > 0 and ops["router"][2] > 0
    assert doc["step_host_ms"]["ours"] > 0 and doc["step_host_ms"]["titan"] > 0


def test_host_cost_refuses_cpu_without_tiny():
    assert bench_host_cost.main([]) == 1


def test_layer_r1_tiny_runs(tmp_path):
    assert bench_layer_r1.main(["--tiny", "--rounds", "1", "--steps", "1",
                                "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "layer_r1.json").read_text())
    (r,) = doc["results"]
    assert r["eager"]["ours"] > 0 and r["eager"]["titan"] > 0
    assert r["eager_host"]["ours"] > 0 and "compiled" not in r and "captured" not in r
    if doc["hf"] is not None:                  # transformers installed: the converted model ran
        assert doc["hf"]["moe_layers"] == 1 and doc["hf"]["block_fwd_bwd_ms"] > 0
    assert "### eager" in (tmp_path / "layer_r1.md").read_text()


def test_layer_r1_refuses_cpu_without_tiny():
    assert bench_layer_r1.main(["--no-hf"]) == 1


def test_titan_style_layer_is_the_same_layer():
    """Same weights -> same routing and outputs; the grads of both exist for every parameter;
    the benchmark's agreement check fails for a layer that computes something else."""
    ours, titan = bench_layer_r1.build(48, 32, 24, 8, 2, torch.device("cpu"), 8)
    x = torch.randn(48, 32).bfloat16()
    assert bench_layer_r1.check_same(ours, titan, x) <= 2 ** -6
    ids, w, _ = ours.router(x)
    tw, tids = titan.route(x)
    assert torch.equal(ids.long(), tids) and torch.equal(w, tw)
    gy = torch.randn(48, 32)
    (titan(x).float() * gy).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in titan.parameters())
    for p in titan.parameters():
        p.grad = None
    gy = torch.randn(48, 32)
    bench_layer_r1.check_same(ours, titan, x, gy)          # forward and backward agree
    assert all(p.grad is None for m in (ours, titan) for p in m.parameters())
    h = titan.w2.register_hook(lambda g: 2 * g)             # a wrong grad of one weight
    with pytest.raises(AssertionError, match="grad of w2"):
        bench_layer_r1.check_same(ours, titan, x, gy)
    h.remove()
    with torch.no_grad():
        titan.w2.mul_(2)
    with pytest.raises(AssertionError, match="disagree"):
        bench_layer_r1.check_same(ours, titan, x)
    ours.buffer.destroy()


def test_titan_style_copy_needs_all_experts():
    ours, _ = bench_layer_r1.build(16, 16, 8, 4, 2, torch.device("cpu"), 1)
    with pytest.raises(ValueError, match="shared"):
        TitanStyleMoE(16, 8, 4, 2, shared_hidden_dim=0).copy_from(ours)
    with pytest.raises(ValueError, match="holds 4 experts"):
        TitanStyleMoE(16, 8, 8, 2, shared_hidden_dim=8).copy_from(ours)
    ours.buffer.destroy()


def test_layer_r1_a_failing_mode_keeps_the_others(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no compiler here")
    monkeypatch.setattr(torch, "compile", broken)
    assert bench_layer_r1.main(["--tiny", "--rounds", "1", "--steps", "1", "--no-hf",
                                "--modes", "eager,compiled", "--out", str(tmp_path)]) == 1
    (r,) = json.loads((tmp_path / "layer_r1.json").read_text())["results"]
    assert r["eager"]["ours"] > 0 and "compiled" not in r
    assert "no compiler here" in r["mode_errors"]["compiled"]
