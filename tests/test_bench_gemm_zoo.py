"""The model-zoo GEMM benchmark and the cost-model fit, on CPU (CI has no GPU).

* the benchmark's --dry-run (reference backend, tiny shapes, the real planner) runs end to end and
  writes a JSON of the documented schema and the markdown report;
* the fit runs on that JSON (fits, held-out report, never-lose rules, writes a constants file
  that reads back exactly what was fitted and keeps the kinds it did not fit);
* the fit's vectorised model equals the library's cost_model.predict;
* the committed case file covers the zoo, is consistent, and a few cases regenerate exactly.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gemm_zoo as bench  # noqa: E402
import fit_gemm_cost_model as fit  # noqa: E402
import gemm_bench_common as common  # noqa: E402
import gemm_zoo_cases as zoo  # noqa: E402


@pytest.fixture(scope="module")
def dry_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo")
    assert bench.main(["--dry-run", "--out", str(out)]) == 0
    return out / "gemm_zoo.json"


def test_dry_run_writes_schema(dry_json):
    doc = json.loads(dry_json.read_text())
    assert doc["schema"] == bench.SCHEMA and doc["complete"]
    assert (dry_json.parent / "gemm_zoo.md").exists()
    mods = common.gemm_modules()
    hists = {h["id"]: h for h in doc["hists"]}
    assert any(h["held_out"] for h in hists.values()) and not all(h["held_out"] for h in hists.values())
    kinds = {c["kind"] for c in doc["cases"]}
    assert kinds == set(bench.KINDS)
    assert any(hists[c["hist"]]["family"] == "calib" for c in doc["cases"])
    for c in doc["cases"]:
        h = hists[c["hist"]]
        assert len(h["counts"]) == h["G"] and sum(h["counts"]) <= h["M"] == c["M"]
        if h["family"] != "calib":
            assert all(x % zoo.TOKEN_PADDING == 0 for x in h["counts"])
        names = [x.name for x in mods.cost_model.CONFIGS[c["kind"]]]
        for n in names + ["ours", "torch"]:
            assert c["us"][n] > 0, (c["hist"], c["kind"], n)
        assert c["pick"] in names
        if c["rows"]:
            assert c["us"]["dense"] > 0
    assert doc["probes"]["fixed_cost"]
    md, summary = bench.report(doc)
    assert "| fwd |" in summary and "## Targets" in summary


def test_fit_on_dry_run(dry_json, tmp_path):
    mods = common.gemm_modules()
    out = tmp_path / "tuning_fitted.json"
    out.write_text(mods.tuning.path("tuning.json").read_text())
    rep = tmp_path / "fit.json"
    assert fit.main([str(dry_json), "--write", str(out), "--report-out", str(rep)]) == 0
    r = json.loads(rep.read_text())
    for kind in bench.KINDS:
        ev = r["kinds"][kind]
        assert ev["train"]["n"] > 0 and ev["held_out"]["n"] > 0
        assert 0 < ev["held_out"]["pick_vs_oracle_gm"] <= 1.0
        assert set(ev["constants"]) == {c.name for c in mods.cost_model.CONFIGS[kind]}
    t = mods.tuning.read(out)
    assert set(t["EFFICIENCY"]) == set(mods.cost_model.KINDS)
    assert t["EFFICIENCY"]["wgrad"] == mods.tuning.EFFICIENCY["wgrad"]      # not fitted: kept
    assert t["PEAK_TFLOPS"] == pytest.approx(mods.tuning.PEAK_TFLOPS, abs=0.05)  # partial fit
    assert "fit_gemm_cost_model" in t["CALIBRATION_SOURCES"]["fwd"]
    assert dry_json.name in t["CALIBRATION_SOURCES"]["fwd"]
    for kind in bench.KINDS:
        for n, v in r["kinds"][kind]["constants"].items():
            assert t["EFFICIENCY"][kind][n] == tuple(v)          # exactly the fitted floats
        assert not t["SEEDED"].get(kind)                  # the dry run measures every config
        nl = r["kinds"][kind]["never_lose"]
        assert nl["held_out"]["n"] > 0 and len(nl["curve"]) == len(fit.MARGIN_GRID)
        assert (kind in t["NEVER_LOSE_MARGIN"]) == (nl["margin"] is not None)


def test_keep_margins_writes_the_rule_in_force(dry_json, tmp_path, monkeypatch):
    # --keep-margins: the margins the fit finds are reported, those in force are written back
    mods = common.gemm_modules()
    out = tmp_path / "tuning_kept.json"
    out.write_text(mods.tuning.path("tuning.json").read_text())
    monkeypatch.setattr(mods.tuning, "NEVER_LOSE_MARGIN", {"wgrad_lp": 0.25})
    rep = tmp_path / "fit.json"
    assert fit.main([str(dry_json), "--write", str(out), "--report-out", str(rep),
                     "--kinds", "fwd", "--keep-margins"]) == 0
    assert "never_lose" in json.loads(rep.read_text())["kinds"]["fwd"]
    assert mods.tuning.read(out)["NEVER_LOSE_MARGIN"] == {"wgrad_lp": 0.25}


@pytest.mark.parametrize("file", ["tuning.json", "tuning_h100.json"])
def test_tuning_file_is_what_the_fit_writes_for_its_values(file):
    # each device's constants file is exactly what the fit writes for its values (the file
    # round-trips: read, then written, byte for byte)
    t = common.gemm_modules().tuning
    d = t.read(file)
    text = fit.render_tuning(d["EFFICIENCY"], d["CALIBRATION_SOURCES"], d["PEAK_TFLOPS"],
                             d["HBM_TBPS"], d["SEEDED"], d["NEVER_LOSE_MARGIN"],
                             num_sms=d["NUM_SMS"], tie_tol=d["SELECT_TIE_TOL"],
                             tie_tol_small=d["SELECT_TIE_TOL_SMALL"],
                             probe_tp=d["NEVER_LOSE_PROBE_TP"], calibrated=d["CALIBRATED"])
    assert text == t.path(file).read_text()


@pytest.mark.parametrize("kind", ["fwd", "dgrad", "wgrad", "wgrad_lp"])
def test_fast_model_equals_library(kind):
    mods = common.gemm_modules()
    cm, tuning = mods.cost_model, mods.tuning
    rng = random.Random(5)
    cases = []
    for i in range(12):
        G = rng.choice([2, 8, 16, 64])
        counts = [rng.choice([0, 0, 128, 256, 384, 1024, 4096]) for _ in range(G)]
        if i == 0:
            counts = [0] * G                                    # all empty
        N, K = rng.choice([(768, 2048), (2048, 768), (2880, 2880), (7168, 2048)])
        cases.append(dict(counts=counts, N=N, K=K, rows=sum(counts) + 127 * G))
    P, peak, hbm = int(tuning.NUM_SMS), float(tuning.PEAK_TFLOPS), float(tuning.HBM_TBPS)
    for cfg in cm.CONFIGS[kind]:
        fm = fit.FastModel(kind, cfg, cases, P, peak, hbm)
        consts = (rng.uniform(0.4, 1.1), rng.uniform(0.3, 1.0), rng.uniform(0, 3),
                  rng.uniform(0, 40), rng.uniform(0, 8))
        fast = fm.predict(consts)
        saved = dict(tuning.EFFICIENCY[kind])
        try:
            tuning.EFFICIENCY[kind][cfg.name] = consts
            ref = [cm.predict(c["counts"], c["N"], c["K"], kind, configs=(cfg.name,))[cfg.name]
                   for c in cases]
        finally:
            tuning.EFFICIENCY[kind] = saved
        np.testing.assert_allclose(fast, ref, rtol=1e-9, atol=1e-9)


def test_torch_tiles_round_m_to_the_cluster():
    mods = common.gemm_modules()
    cm = mods.cost_model
    g = cm.CONFIGS["fwd"][cm.config_index("fwd", "t128x256")]
    # 3 M tiles of 128 rows become 4 under the 2x1 cluster; N tiles are not rounded (CN = 1)
    assert cm.rows_tiles(np.array([384, 0, 256]), 768, g).tolist() == [4 * 3, 0, 2 * 3]
    assert cm.wgrad_tiles(768, 2048, g) == 6 * 8
    assert cm.wgrad_tiles(640, 2048, g) == 6 * 8                   # 5 O tiles -> 6
    lib = fit.Library(mods, 796.0, 4.2, 132)
    small = dict(counts=[128] * 64, rows=8192, N=4096, K=7168)      # 128 rows per group
    big = dict(counts=[512] * 16, rows=8192, N=4096, K=1536)
    assert lib.torch_config("fwd", small) == "t64x128"
    assert lib.torch_config("fwd", big) == "t128x256"
    # the stand-in of a torch config is torch's time + the overhead, only where torch runs it
    c = dict(big, us={}, torch_us=100.0)
    assert fit.target_us(lib, "fwd", c, "t128x256", 2.0) == (102.0, "stand-in")
    assert fit.target_us(lib, "fwd", c, "t64x128", 2.0) == (None, None)
    assert fit.target_us(lib, "fwd", dict(c, us={"t64x128": 90.0}), "t64x128", 2.0) == \
        (90.0, "measured")


def test_margin_objective():
    # rows: (rule ratio, ours us, torch-family us, torch us, best us, id)
    rows = [(0.9, 120.0, 101.0, 100.0, 100.0, "a"),    # torch's kernel clearly faster
            (1.2, 80.0, 101.0, 100.0, 80.0, "b")]      # ours clearly faster
    m, curve = fit.fit_margin(rows)
    assert m is not None and 0.9 <= 1 + m < 1.2
    q = fit.rule_quality(rows, m)
    assert q["sent_to_torch"] == 1 and q["below_098"] == 0 and q["vs_torch_min"] > 0.98
    off = fit.rule_quality(rows, None)
    assert off["sent_to_torch"] == 0 and off["below_098"] == 1 and off["objective"] < q["objective"]
    # never better to send: no margin
    assert fit.fit_margin([(0.9, 80.0, 101.0, 100.0, 80.0, "c")])[0] is None


def test_case_file_covers_the_zoo():
    hists = {h["id"]: h for h in zoo.load()}
    specs = list(zoo.zoo_specs())
    assert {zoo.hist_id(f, e, s, n) for f, e, s, n, _, _ in specs} == set(hists)
    pairs = {(h["family"], h["ep"]) for h in hists.values()}
    assert len(pairs) == 16 and sum(zoo.is_held_out(*p) for p in pairs) == 4
    for h in hists.values():
        D, F, E, K = zoo.FAMILIES[h["family"]]
        assert h["G"] == 2 * E // h["ep"] == len(h["counts"])
        assert sum(h["counts"]) <= h["M"] and all(c % zoo.TOKEN_PADDING == 0 for c in h["counts"])
        assert h["held_out"] == zoo.is_held_out(h["family"], h["ep"])
    assert all(max(h["counts"]) == h["s"] * h["K"] for h in hists.values()
               if h["hist"] == "adversarial")
    calib = zoo.load(calib=True)
    assert len(calib) == 32 and 0 < sum(h["held_out"] for h in calib) < 32
    assert all(sum(h["counts"]) == h["M"] and len(h["counts"]) == h["G"] for h in calib)


@pytest.mark.parametrize("hist", ["balanced", "zipf_mv1", "adversarial"])
def test_case_file_regenerates(hist):
    committed = {h["id"]: h for h in zoo.load()}
    for fam, ep, s, name, kind, target in zoo.zoo_specs(families={"mixtral-8x22b"}, tokens={2048},
                                                        hists={hist}):
        h = zoo.build_hist(fam, ep, s, name, kind, target)
        c = committed[h["id"]]
        assert (h["counts"], h["M"], h["rank"]) == (c["counts"], c["M"], c["rank"])
