"""Fitted constants of the GEMM cost models: the one reader (and format) of the files that hold
them, and the grouped bf16 GEMM's constants (moonep_ops.gemm.cost_model).

The constants are data: JSON files next to this module (package data, setup.py), each WRITTEN
BY a fit from the committed measurements in benchmarks/calibration/ (rerun the fit instead of
editing), each key the name of the attribute its module loads it into:

  tuning.json            this module's (the H200's, and the default), by
                         benchmarks/fit_gemm_cost_model.py
  tuning_h100.json       the same constants fitted on the H100 (DEVICE_FILES), by the same fit
  tuning_fp8.json        tuning_fp8.py's (the FP8 GEMM), by benchmarks/fit_fp8_cost_model.py
  tuning_fp8_wgrad.json  tuning_fp8_wgrad.py's (the FP8 wgrad GEMM), seeded by hand

docs/grouped_gemm.md, "Cost model" and "Calibration", explains the bf16 model and its fit.

PEAK_TFLOPS / HBM_TBPS: the measured dense bf16 ceiling and device-copy bandwidth of the H200;
NUM_SMS: its SM count (the persistent grid's CTAs P when the device is not asked).
EFFICIENCY[kind][config] = (eta, bw_frac, tau_sw_us, tau0_us, tau_epi_us):
  eta        fraction of PEAK_TFLOPS one tile's MMA mainloop reaches with this config;
  bw_frac    fraction of HBM_TBPS reached by rounds bound by first-touch HBM bytes;
  tau_sw_us  extra time of a round in which some CTA starts a new group (descriptor update);
  tau0_us    launch + prologue + tail of one GEMM;
  tau_epi_us epilogue time one tile adds to its mainloop (not overlapped: cooperative kernels).
SEEDED[kind][config]: configs whose constants are seeds, not fitted on measurements of the config
  itself (why, and from what); the fit drops a config from it once the config is measured.
SELECT_TIE_TOL, SELECT_TIE_TOL_SMALL: the selection rule's tie window (cost_model.pick,
  tie_tolerance; not fitted): predictions within it of the fastest tie and go to the least MMA
  work; the wider window applies to small groups (a config with max_mean_rows is a candidate),
  where every round streams weights and the predictions differ only by per-call constants.
NEVER_LOSE_PROBE_TP, NEVER_LOSE_MARGIN[kind]: the never-lose rule (cost_model.family_for): a call
  runs torch._grouped_mm's kernel family when the model, on the shape's balanced probe
  histogram (token padding NEVER_LOSE_PROBE_TP), predicts it at most (1 + margin) times our best
  candidate; a kind without a margin never uses the torch family.
CALIBRATED; CALIBRATION_SOURCES[kind]: where each kind's constants come from (a partial refit,
  --kinds, keeps the others'); CALIBRATION_SOURCE: the same on one line.

Per device: the attributes above hold one file's constants, ACTIVE_FILE's (tuning.json at import:
the model as an API on any machine).  The GEMM launcher calls ``select(file_for(device name))``
before it plans a call on a CUDA device (ops/grouped_mm_kernels.py), so the device's selector
gets the constants fitted on that device's kind when a file exists for it (DEVICE_FILES).  Why:
the H200's constants on an H100 picked configs 7.6 % slower than the best one (held-out gm,
docs/grouped_gemm.md "Calibration").
"""
from __future__ import annotations

import json
from pathlib import Path


def path(name: str) -> Path:
    """The constants file ``name`` of this package."""
    return Path(__file__).with_name(name)


def _tuples(value):
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return tuple(value) if isinstance(value, list) else value


def read(file: Path | str) -> dict:
    """A constants file (a name: this package's) as {attribute: value}, its lists as tuples.
    A fit writes ``dumps`` of the same dict, so a value read back is the value written."""
    return _tuples(json.loads((path(file) if isinstance(file, str) else file).read_text()))


def dumps(data, indent: str = "") -> str:
    """The text of a constants file: JSON, one key a line, a tuple of numbers on its key's line
    (floats as Python's repr writes them: ``read`` gives back the same doubles)."""
    if not isinstance(data, dict) or not data:
        return json.dumps(data)
    inner = indent + " "
    items = ",\n".join(f"{inner}{json.dumps(k)}: {dumps(v, inner)}" for k, v in data.items())
    return "{\n" + items + "\n" + indent + "}" + ("" if indent else "\n")


# (a substring of torch.cuda.get_device_name, the constants file of that device kind); any other
# device: DEFAULT_FILE.
DEVICE_FILES = (("H100", "tuning_h100.json"),)
DEFAULT_FILE = "tuning.json"


def file_for(device_name: str) -> str:
    """The constants file for a device of this name."""
    return next((f for key, f in DEVICE_FILES if key in device_name), DEFAULT_FILE)


def select(file: str) -> None:
    """Make ``file``'s constants this module's (a no-op when they already are).  One dict update
    of the module's namespace: under the GIL no other thread reads a mix of two files."""
    if file == ACTIVE_FILE:
        return
    d = read(file)
    keys = ("CALIBRATED", "CALIBRATION_SOURCES", "PEAK_TFLOPS", "HBM_TBPS", "NUM_SMS",
            "SELECT_TIE_TOL", "SELECT_TIE_TOL_SMALL", "NEVER_LOSE_PROBE_TP", "NEVER_LOSE_MARGIN",
            "SEEDED", "EFFICIENCY")
    new = {k: d[k] for k in keys}
    new["CALIBRATION_SOURCE"] = "; ".join(f"{k}: {v}" for k, v in d["CALIBRATION_SOURCES"].items())
    new["ACTIVE_FILE"] = file
    globals().update(new)


ACTIVE_FILE = ""
CALIBRATED: bool
CALIBRATION_SOURCES: dict[str, str]
CALIBRATION_SOURCE: str
PEAK_TFLOPS: float
HBM_TBPS: float
NUM_SMS: int
SELECT_TIE_TOL: float
SELECT_TIE_TOL_SMALL: float
NEVER_LOSE_PROBE_TP: int
NEVER_LOSE_MARGIN: dict[str, float]
SEEDED: dict[str, dict[str, str]]
EFFICIENCY: dict[str, dict[str, tuple[float, ...]]]
select(DEFAULT_FILE)
