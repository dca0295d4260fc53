"""The FP8 GEMM benchmark's case set and report, and the FP8 cost-model fit, on CPU (CI has no
GPU): the small-batch cases are what they say, the report's ratios point the documented way,
the fit recovers known constants from synthetic measurements and writes a constants file that
reads back exactly, and the committed calibration file refits to the committed constants."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_fp8_gemm as bench  # noqa: E402
import fit_fp8_cost_model as fit  # noqa: E402
import gemm_zoo_cases as zoo  # noqa: E402

from moonep_ops.gemm import fp8_cost, tuning, tuning_fp8  # noqa: E402

CALIB = ROOT / "benchmarks" / "calibration" / "fp8_zoo_2026-12-03.json"


def test_small_batches():
    hs = bench.small_hists()
    assert {h["s"] for h in hs} == set(bench.SMALL_TOKENS)
    for h in hs:
        D, F, E, K = zoo.FAMILIES[h["family"]]
        epn = E // h["ep"]
        assert len(h["counts"]) == 2 * epn == h["G"]
        assert sum(h["counts"]) == h["s"] * K and h["M"] == h["s"] * K + 64
        assert all(c == 0 for c in h["counts"][epn:])                  # slots empty
        if h["hist"] == "small_hot":
            assert max(h["counts"]) >= h["s"] * K // 2
        assert h["held_out"] == zoo.is_held_out(h["family"], h["ep"])


def test_cases_filter_and_projections():
    ns = argparse.Namespace(families="deepseek-v3", tokens="128", limit=0, small=True)
    cs = bench.cases(ns)
    assert cs and all(c["family"] == "deepseek-v3" and c["s"] == 128 for c in cs)
    assert {(c["proj"], c["O"], c["I"]) for c in cs} == set(zoo.projections("deepseek-v3"))
    none = bench.cases(argparse.Namespace(families="", tokens="128", limit=0, small=False))
    assert none == []


def _row(us, hist="zipf_mv1", s=2048, held_out=False, chosen="c128x128"):
    return dict(id="x", family="f", ep=8, s=s, hist=hist, held_out=held_out, proj="down",
                us=us, chosen=chosen, host_pick=chosen, scaled_err=None)


def test_summary_ratios_are_other_over_fp8():
    us = {"fp8": 50.0, "fp8_nopdl": 55.0, "fp8_c128x128": 50.0, "fp8_p64x128": 100.0,
          "bf16": 75.0, "torch": 80.0, "scaled": 60.0}
    text = bench.summary([_row(us)], dict(configs=list(fp8_cost.NAMES), device="d", torch="t",
                                          date="x", commit="c"))
    line = next(ln for ln in text.splitlines() if ln.startswith("| all |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2:5] == ["1.500", "1.200", "1.600"]          # bf16, scaled, torch over fp8
    assert cells[5:7] == ["1.500", "0.750"]                   # each config forced, over bf16
    assert cells[7] == "1.000 (1.000)" and cells[8] == "1.100"    # oracle / pick, PDL on/off


def _synthetic(constants, sms=132):
    rows = []
    for i, h in enumerate(zoo.load()[:60] + bench.small_hists()[:30]):
        for proj, O, I in zoo.projections(h["family"]):
            pred = fp8_cost.predict(h["counts"], O, I, sms, constants, fit.MEM)
            rows.append(dict(id=h["id"], held_out=(i % 4 == 0), O=O, I=I, counts=h["counts"],
                             us={f"fp8_{n}": pred[n] for n in fp8_cost.AUTO_NAMES}))
    return rows


def test_fit_recovers_known_constants(tmp_path):
    truth = {"c128x128": (9.0, 0.8, 0.47), "p64x128": (8.0, 0.1, 0.67)}
    path = tmp_path / "fp8_zoo.json"
    path.write_text(json.dumps(dict(meta=dict(sm_count=132), cases=_synthetic(truth))))
    rows, sms = fit.load([path])
    got = fit.fit([r for r in rows if not r["held_out"]], sms)
    for n, v in truth.items():
        assert got[n] == pytest.approx(v, rel=0.05, abs=0.05), n
    rep = fit.report([r for r in rows if r["held_out"]], sms, got)
    assert rep["pick_oracle_gm"] > 0.999
    out = tmp_path / "tuning_fp8.json"
    assert fit.main([str(path), "--write", str(out)]) == 0
    calibrated, source, consts, mem, tie_tol = tuning_fp8.read(out)
    assert calibrated and "fp8_zoo.json" in source
    assert consts == got and mem == fit.MEM and tie_tol == tuning_fp8.TIE_TOL   # exactly


def test_committed_constants_are_the_fit_of_the_committed_measurements(tmp_path):
    rows, sms = fit.load([CALIB])
    got = fit.fit([r for r in rows if not r["held_out"]], sms)
    for n in fp8_cost.AUTO_NAMES:
        assert got[n] == pytest.approx(tuning_fp8.CONSTANTS[n], abs=1e-4), n
    assert tuning_fp8.MEM_BYTES_PER_US == fit.MEM
    # the committed constants, written again, are the committed file byte for byte
    out = tmp_path / "tuning_fp8.json"
    fit.write(out, tuning_fp8.CONSTANTS, tuning_fp8.CALIBRATION_SOURCE)
    assert out.read_text() == tuning.path("tuning_fp8.json").read_text()
    assert math.isfinite(fit.report(rows, sms, got)["pick_oracle_gm"])
