#!/usr/bin/env bash
# The FP8 training step in one GPU call: weight cache + FP8 wgrad built, tested and measured,
# ending with a summary table.  ~6-7 minutes on one H200 with the libraries built (carry
# moonep_ops/lib); add ~4 minutes when the libs stage has to build them (16 cores).
#
#   bash scripts/gpu_fp8_step.sh                       # every stage
#   STAGES=tests,wgrad bash scripts/gpu_fp8_step.sh    # some stages
#   device tool: run(command="bash scripts/gpu_fp8_step.sh", carry=["moonep_ops/lib", ".whl"])
#
# Stages (each with a time limit; logs in $OUT/<stage>.log):
#   libs   the libraries must load with GEMM ABI >= 12 (the FP8 wgrad exports); else build them
#          (python -m moonep_ops.build -j 16; .whl/ must hold the nvidia-cutlass wheel) and
#          check the exports against the headers (scripts/check_abi.py)
#   tests  tests/test_fp8_wgrad_cuda.py (quantisers bitwise, the wgrad kernel against the
#          reference on random / skewed / adversarial / empty groups, device pick, graphs, the
#          layer), then the FP8 suites it touches (test_fp8_quant_cuda, test_grouped_mm_fp8_cuda)
#   wgrad  benchmarks/bench_fp8_wgrad.py: FP8 wgrad vs our bf16 wgrad on the model-zoo cases
#          (interleaved; every config forced; error vs bf16 per shape); JSON in $OUT
#   step   benchmarks/bench_fp8_step.py: the layer step bf16 / fp8 / fp8_base at DeepSeek-V3
#          expert shapes, 32 and 8 experts a rank, 1 and 4 micro-batches, CUDA graphs
#   train  benchmarks/fp8_training.py --steps 200: FP8 (cache + FP8 wgrad) vs bf16 final loss
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
STAGES=${STAGES:-libs,tests,wgrad,step,train}
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
rows=()
T0=$SECONDS

stage() {   # stage NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  [[ ",$STAGES," == *",$name,"* ]] || return 0
  echo "==== $name"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n ${TAIL:-25} "$OUT/$name.log"
  rows+=("| $name | $([ $rc = 0 ] && echo ok || echo "rc $rc") | $((SECONDS - t0)) s |")
}

libs() {
  local ok='import sys; from moonep_ops import native as n; sys.exit(n.gemm_fp8_wgrad() is None or n.ep() is None)'
  if ! $PY -c "$ok"; then
    $PY -c 'from moonep_ops import native as n; print("libs:", n.gemm_load_error(), n.gemm_fp8_wgrad_unavailable(), n.ep_load_error())'
    $PY -m moonep_ops.build -j 16 || return 1
    $PY -c "$ok" || { echo "libs: still no FP8 wgrad after the build"; return 1; }
  fi
  $PY scripts/check_abi.py
}
export -f libs
export PY

stage libs 420 bash -c libs
stage tests 210 $PY -m pytest -q -rs -p no:cacheprovider tests/test_fp8_wgrad_cuda.py \
  tests/test_fp8_quant_cuda.py tests/test_grouped_mm_fp8_cuda.py
stage wgrad 200 $PY benchmarks/bench_fp8_wgrad.py --out "$OUT" --rounds 3 --time-limit-s 130
stage step 200 $PY benchmarks/bench_fp8_step.py --experts 32,8 --micro 1,4 --iters 10
stage train 170 $PY benchmarks/fp8_training.py --steps 200

echo
echo "==== summary ($((SECONDS - T0)) s)"
echo "| stage | result | time |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
echo
[ -f "$OUT/tests.log" ] && { echo "tests: $(grep -E '[0-9]+ (passed|failed)' "$OUT/tests.log" | tail -1)"; \
  grep -E "^FAILED" "$OUT/tests.log" | head -20; }
if [ -f "$OUT/wgrad.log" ]; then
  echo; echo "wgrad (FP8 vs our bf16, model zoo):"
  sed -n '/^| cases/,/^$/p' "$OUT/wgrad.log"
  grep -E "^(device pick|goal|spot check .*FAILED|time limit)" "$OUT/wgrad.log"
  sed -n '/^| family/,$p' "$OUT/wgrad.log"
fi
if [ -f "$OUT/step.log" ]; then
  echo; echo "layer step (ms, CUDA graphs):"
  sed -n '/^| experts a rank/,$p' "$OUT/step.log"
  grep -E "capture of .* failed" "$OUT/step.log"
fi
[ -f "$OUT/train.log" ] && { echo; echo "training: $(grep -E '^mean loss' "$OUT/train.log")"; }
