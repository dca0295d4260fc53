"""The main job ``python -m apps.job``: CLI errors, and a short real run end to end (spawned
gloo ranks, torch.compile, sweep table, results.json, PNG plots)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, timeout=600, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "apps.job", *args], cwd=kw.get("cwd", ROOT),
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,msg", [
    (["-R", "3"], "E=64 is not divisible by R=3"),
    (["-E", "16", "-K", "17", "-R", "4"], "K=17 > E=16"),
    (["--dim", "-4"], "D must be >= 1"),
    (["--tokens", "0"], "tokens must be >= 1"),
    (["--maxvio", "0", "-2"], "maxvio must be a finite number >= 0"),
    (["-E", "8", "-R", "2", "--maxvio", "9"], "maxvio values must be <= E-1 = 7"),
    (["--steps", "x"], "steps must be an integer"),
    (["--ep-backend", "symm"], "needs GPUs under torchrun"),
    (["--out", "/proc/moonep_out"], "cannot create the output folder"),
])
def test_cli_errors_are_one_line(args, msg):
    r = _run(args, timeout=120)
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert msg in lines[0] and "error" in lines[0]
    assert "Traceback" not in r.stderr


def test_planner_only(capsys):
    from apps.job.cli import main
    assert main(["--planner-only", "-R", "4", "-E", "16", "-K", "2", "-s", "64",
                 "--maxvio", "0", "5"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.strip().startswith(("plain EP", "moonep", "lean"))
            or "plain EP" in ln]
    assert len(rows) == 6, out
    # MoonEP and lean: every rank at exactly s*K = 128 copies
    for ln in out.splitlines():
        if ln.split()[:1] in (["moonep"], ["lean"]):
            assert ln.split()[1:3] == ["128", "128"], ln


def test_end_to_end(tmp_path):
    """A tiny but real run: 2 gloo ranks, compiled, two imbalances."""
    out = tmp_path / "out"
    s, K = 32, 2
    r = _run(["-R", "2", "-E", "8", "-K", str(K), "-D", "16", "-F", "8", "-L", "2", "-s", str(s),
              "--steps", "3", "--maxvio", "0", "4", "--lr", "2", "--out", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    table = [ln for ln in r.stdout.splitlines() if ln.startswith("| ")]
    assert table[0].startswith("| maxvio | model | recv max")
    body = table[1:]
    assert [("plain EP" in ln, "MoonEP" in ln) for ln in body] == [(True, False), (False, True)] * 2
    names = {p.name for p in out.iterdir()}
    assert {"results.json", "sweep.md", "load_per_rank.png", "step_time.png", "loss.png"} <= names
    for png in ("load_per_rank.png", "step_time.png", "loss.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
    assert "| maxvio | model |" in (out / "sweep.md").read_text()

    # the results re-render on their own (python -m apps.job.report)
    again = subprocess.run([sys.executable, "-m", "apps.job.report",
                            str(out / "results.json"), "--out", str(tmp_path / "again")],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert [ln for ln in again.stdout.splitlines() if ln.startswith("| ")] == table
    assert (tmp_path / "again" / "load_per_rank.png").stat().st_size > 5000

    res = json.loads((out / "results.json").read_text())
    rows = {(row["maxvio_target"], row["model"]): row for row in res["rows"]}
    assert set(rows) == {(0.0, "baseline"), (0.0, "moonep"), (4.0, "baseline"), (4.0, "moonep")}
    for v in (0.0, 4.0):
        b, m = rows[(v, "baseline")], rows[(v, "moonep")]
        # MoonEP: every rank computes exactly s*K copies per layer, whatever the skew
        assert m["recv_per_rank"] == [s * K] * 2
        # the baseline's layers received what the routing says (measured in the layers)
        assert b["recv_max_measured"] == pytest.approx(b["recv_max"])
        assert b["recv_mean"] == s * K
        # same weights, data and routing: the same loss at step 0, and the same training
        assert all(math.isfinite(x) for x in b["loss"] + m["loss"])
        assert m["loss"][0] == pytest.approx(b["loss"][0], rel=1e-5)
        assert m["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert m["loss"][-1] < m["loss"][0]
        assert len(m["step_ms"]) == 3 and min(m["step_ms"]) > 0
        # the measured wire bytes contain the modelled token and weight bytes (plus metadata)
        assert b["token_bytes"] <= b["wire_bytes"] <= 1.1 * b["token_bytes"]
        assert m["token_bytes"] + m["weight_bytes"] <= m["wire_bytes"]
    assert rows[(0.0, "moonep")]["redundant"] == 0
    assert rows[(0.0, "baseline")]["recv_max"] == s * K
    assert rows[(4.0, "moonep")]["redundant"] > 0 and rows[(4.0, "moonep")]["weight_bytes"] > 0
    assert rows[(4.0, "baseline")]["recv_max"] > s * K
    assert rows[(4.0, "baseline")]["maxvio"] == pytest.approx(4.0, abs=0.5)
    # compiled: MoonEP is one graph without breaks and never recompiles when the routing changes
    assert res["warmup"]["moonep"]["graph_breaks"] == 0
    assert res["warmup"]["moonep"]["graphs"] == 1
    assert rows[(0.0, "moonep")]["recompiles"] == rows[(4.0, "moonep")]["recompiles"] == 0
    assert res["warmup"]["baseline"]["graph_breaks"] > 0      # the host-sized all-to-all


def test_profile_writes_top_ops(tmp_path):
    """--profile: one profiled step per model after the sweep, its top ops by self time in
    profile_<model>.txt (the moonep one shows the data-plane ops)."""
    out = tmp_path / "out"
    r = _run(["-R", "2", "-E", "8", "-K", "2", "-D", "16", "-F", "8", "-L", "1", "-s", "16",
              "--steps", "1", "--maxvio", "2", "--no-compile", "--no-progress", "--profile",
              "--out", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    moonep = (out / "profile_moonep.txt").read_text()
    base = (out / "profile_baseline.txt").read_text()
    assert "self_cpu_time_total" in moonep.splitlines()[0]
    assert "moonep::combine" in moonep and "moonep::reduce_grad" in moonep
    assert "moonep::combine" not in base and "moonep::reduce_grad" not in base
    assert "alltoall" in base   # the baseline moves tokens with all_to_all_single


def test_git_commit_marks_a_dirty_tree(tmp_path, monkeypatch):
    import re
    import subprocess
    from apps.job import report
    got = report.git_commit()
    assert got is None or re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", got), got
    calls = []

    def fake_run(args, **kw):
        calls.append(args)
        out = "abc1234" if "rev-parse" in args else " M moonep_ops/nn/moe.py"
        return subprocess.CompletedProcess(args, 0, stdout=out + "\n", stderr="")
    monkeypatch.setattr(report.subprocess, "run", fake_run)
    assert report.git_commit() == "abc1234+dirty"
