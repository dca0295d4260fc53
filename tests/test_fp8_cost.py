"""The FP8 GEMM's config table and cost model (CPU): moonep_ops/gemm/fp8_cost.py against the
library's sources (cutlass_kernels/kernel_fp8_fwd.cu, moonep_gemm.h), and the model's rule.
The device side (the prep kernel's choice equals fp8_cost.select) is
tests/test_grouped_mm_fp8_cuda.py::test_device_pick_is_the_host_models."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from moonep_ops.gemm import fp8_cost, tuning_fp8

ROOT = Path(__file__).resolve().parent.parent
SRC = (ROOT / "cutlass_kernels" / "kernel_fp8_fwd.cu").read_text()
HDR = (ROOT / "cutlass_kernels" / "moonep_gemm.h").read_text()


def _cxx_configs():
    """(BM, BN, pingpong, CM, CN, EN, raster_n) of every Fp8Config<...> of the Configs
    tuple, in order, with the name in the trailing comment."""
    block = SRC[SRC.index("using Configs = std::tuple<"):]
    block = block[:block.index("constexpr int kNumConfigs")]
    out = []
    for m in re.finditer(r"Fp8Config<([^>]*)>[,>;]*\s*//\s*(\S+)", block):
        vals = [v.strip() for v in m.group(1).split(",")]
        nums = [int(v) if v not in ("true", "false") else int(v == "true") for v in vals]
        nums += [0, 0][len(nums) - 5:] if len(nums) < 7 else []
        out.append((m.group(2), tuple(nums)))
    return out


def test_python_table_mirrors_the_kernel_source():
    cxx = _cxx_configs()
    assert [n for n, _ in cxx] == list(fp8_cost.NAMES)
    for (name, v), cfg in zip(cxx, fp8_cost.FP8_CONFIGS):
        assert v == (cfg.BM, cfg.BN, int(cfg.pingpong), cfg.CM, cfg.CN, cfg.EN,
                     int(cfg.raster_n)), name
    m = re.search(r"constexpr int kAutoConfigs = (\w+);", SRC).group(1)
    auto = len(cxx) if m == "kNumConfigs" else int(m)
    assert auto == fp8_cost.AUTO_CONFIGS
    first = fp8_cost.FP8_CONFIGS[0]
    assert all((c.CM, c.CN) == (first.CM, first.CN) for c in fp8_cost.FP8_CONFIGS[:auto]), \
        "the device chooses within one fused kernel: one cluster shape"


def test_tuning_table_layout_is_the_headers():
    mx = int(re.search(r"#define MOONEP_GEMM_FP8_MAX_CONFIGS (\d+)", HDR).group(1))
    assert mx == fp8_cost.MAX_CONFIGS >= len(fp8_cost.FP8_CONFIGS)
    assert "#define MOONEP_GEMM_FP8_TUNING_LEN (3 * MOONEP_GEMM_FP8_MAX_CONFIGS + 2)" in HDR
    t = fp8_cost.tuning_table()
    assert len(t) == 3 * mx + 2
    for i, name in enumerate(fp8_cost.AUTO_NAMES):
        assert (t[i], t[mx + i], t[2 * mx + i]) == pytest.approx(tuning_fp8.CONSTANTS[name])
    assert t[3 * mx:] == pytest.approx([tuning_fp8.MEM_BYTES_PER_US, tuning_fp8.TIE_TOL])
    assert set(tuning_fp8.CONSTANTS) == set(fp8_cost.AUTO_NAMES)


def test_config_index():
    assert fp8_cost.config_index(None) == fp8_cost.config_index("auto") == -1
    assert fp8_cost.config_index(-1) == -1
    for i, n in enumerate(fp8_cost.NAMES):
        assert fp8_cost.config_index(n) == fp8_cost.config_index(i) == i
    for bad in ("nope", len(fp8_cost.NAMES), -2, True, 1.0):
        with pytest.raises(ValueError):
            fp8_cost.config_index(bad)


def test_tiles_round_up_to_the_cluster():
    C = fp8_cost.Fp8Config
    # one group of 129 rows, n = 384: 2 M tiles x 3 N tiles, N rounded up to 4 by a 1 x 2 cluster
    assert fp8_cost.tiles([129, 0], 384, C("a", 128, 128, False)) == 2 * 4
    assert fp8_cost.tiles([129, 0], 384, C("b", 64, 128, True)) == 3 * 4
    assert fp8_cost.tiles([129, 0], 384, C("c", 128, 128, False, CM=2, CN=1)) == 2 * 3
    assert fp8_cost.tiles([1, 0], 384, C("d", 128, 128, False, CM=2, CN=2)) == 2 * 4
    assert fp8_cost.tiles([0, 0], 384, C("a", 128, 128, False)) == 0


def test_model_properties():
    sms = 132
    base = fp8_cost.predict([1024] * 8 + [0] * 8, 2048, 7168, sms)
    more = fp8_cost.predict([2048] * 8 + [0] * 8, 2048, 7168, sms)
    deeper = fp8_cost.predict([1024] * 8 + [0] * 8, 2048, 14336, sms)
    for n in fp8_cost.AUTO_NAMES:
        assert more[n] > base[n] and deeper[n] > base[n]
    empty = fp8_cost.predict([0] * 16, 2048, 7168, sms)
    for n in fp8_cost.AUTO_NAMES:
        assert empty[n] == pytest.approx(tuning_fp8.CONSTANTS[n][0])


def test_pick_rule():
    names = fp8_cost.AUTO_NAMES
    pred = {n: 100.0 + i for i, n in enumerate(names)}
    assert fp8_cost.pick(pred, tie_tol=0.0) == names[0]
    pred = {n: 100.0 for n in names}
    pred[names[0]] = 100.4
    assert fp8_cost.pick(pred, tie_tol=0.0) == names[1]
    assert fp8_cost.pick(pred, tie_tol=0.005) == names[0]      # within the window: lowest index
