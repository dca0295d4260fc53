#!/usr/bin/env bash
# All grouped-GEMM work for one GPU call (the `run` tool of the device machine, or any H200):
#   1. load the carried moonep_ops/lib/libmoonep_gemm.so, else build it there from CUTLASS headers
#      carried in .gpu_carry/cutlass (include/ and tools/util/include/);
#   2. CUDA tests (tests/test_grouped_gemm_cuda.py) and the CPU suite;
#   3. with CALIB=1: calibration -> moonep_ops/gemm/tuning.py (copied to $OUT); by default the
#      committed constants are used (a refit from committed measurements needs no GPU:
#      benchmarks/fit_gemm_cost_model.py moonep_ops/gemm/calibration/*.json);
#   4. the benchmark sweep with those constants.
# Results land in $OUT (default /tmp/gemm_out); the last lines printed are the targets table.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gemm_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
STAGE=${STAGE:-all}   # all | test | bench

$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv
if ! $PY -c "import sys; from moonep_ops import native as n; sys.exit(n.gemm() is None)"; then
  $PY -c "from moonep_ops import native as n; print('carried library not usable:', n.gemm_load_error())"
  if [ -d .gpu_carry/cutlass/include ]; then
    CUTLASS_INCLUDE=$PWD/.gpu_carry/cutlass/include $PY -m moonep_ops.build -j 12 || exit 1
  else
    echo "no CUTLASS headers carried; CUTLASS tests will skip"
  fi
fi

if [ "$STAGE" != bench ]; then
  timeout ${T_TEST:-150} $PY -m pytest -q -rs tests/test_grouped_gemm_cuda.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -30
  $PY -m pytest -q tests/test_grouped_gemm.py 2>&1 | tail -2
fi
if [ "$STAGE" != test ]; then
  if [ "${CALIB:-0}" = 1 ]; then
    timeout ${T_CALIB:-300} $PY benchmarks/calibrate_grouped_gemm.py --out "$OUT" 2>&1 | tee "$OUT/calibrate.log" | tail -14
    cp moonep_ops/gemm/tuning.py "$OUT/gemm_tuning.py"
  fi
  timeout ${T_BENCH:-250} $PY benchmarks/bench_grouped_gemm.py --out "$OUT" > "$OUT/bench.log" 2>&1
  nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv
  tail -5 "$OUT/bench.log"
  [ -f "$OUT/bench_grouped_gemm.md" ] && sed -n '/^## Weight streaming/,$p' "$OUT/bench_grouped_gemm.md"
fi
