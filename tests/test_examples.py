"""The user-facing examples run as written (CPU, spawned gloo ranks)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_hf_finetune_saves_a_checkpoint_plain_transformers_reloads(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (the test extra)")
    r = _run("hf_finetune.py", "--ranks", "4", "--steps", "2", "--out", str(tmp_path / "ckpt"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert len(re.findall(r"^step \d+: loss per rank( \d+\.\d+){4}$", r.stdout, re.M)) == 2
    m = re.search(r"max \|logits diff\| = ([0-9.e+-]+)", r.stdout)
    assert m and float(m.group(1)) <= 1e-4, r.stdout[-2000:]
    assert (tmp_path / "ckpt" / "finetuned" / "model.safetensors.index.json").exists()
    assert len(re.findall(r"rank \d: read \d+ B", r.stdout)) == 4       # ranks interleave
