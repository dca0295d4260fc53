#!/usr/bin/env bash
# Everything that needs the GPU, in one script, ending with a short table (stage, result, time).
#
#   bash scripts/gpu_check.sh                     # every stage of the default list
#   STAGES=tests,gemm bash scripts/gpu_check.sh   # some stages
#
# On the H200 of the device tool, with the libraries built on the CPU machine and carried (the
# device's 16 cores build them in ~3.5 min instead, when nvidia-cutlass is carried in .whl/;
# scripts/gpu_wheels.sh fills .whl/ with every wheel this script installs there):
#   run(command="bash scripts/gpu_check.sh", carry=["moonep_ops/lib", ".whl"])
# Stages:
#   build      build moonep_ops/lib (production) and moonep_ops/lib/diagnostics if they are
#              missing or do not load (python -m moonep_ops.build -j 16 [--diagnostics])
#   tests      every CUDA test: tests/*_cuda.py
#   diag       the planner tests that need the diagnostics build (its debug knobs)
#   vranks     diagnostics/stream_queues.py (do streams of one process wait behind each other) and
#              diagnostics/virtual_rank_timeouts.py (virtual ranks at R = 8, fresh processes)
#   dataplane  device planner latency, dispatch/combine bandwidth, eager vs CUDA-graph steps
#   moe        the MoE layer step (eager, compiled, CUDA graphs)
#   costterms  policy "cost"'s GEMM and replica-bytes terms against measured times
#   fp8        the FP8 GEMM's GPU test and benchmark, a 200-step FP8 vs bf16 training run, the
#              FP8 and bf16 MoE layer steps at DeepSeek-V3 expert shapes (CUDA graphs)
#   soak       2,000 compiled steps, new routing every step, NaN batches every 100 steps
#   gemm       the grouped-GEMM model zoo (ours vs torch._grouped_mm vs dense; the calibration
#              data the cost model is fitted on)
#   host       host cost: us per call of every op of the training path beside the torch ops a
#              torchtitan-style layer runs, a profile of the eager layer step, and the layer step
#              at R = 1 against that layer (eager, compiled, CUDA graphs; four shapes) and the
#              converted tiny Qwen3-MoE's host time per layer; tables in $OUT/host_cost.md and
#              $OUT/layer_r1.md.  With a package copy in .gpu_carry/baseline/moonep_ops (carried),
#              the host-cost benchmark and the eager layer step run on it too, on the same GPU
#              ($OUT/baseline_host.md): the "before" of a change.  Not in the default list.
#   nccl, job  several GPUs only: the multi-rank tests over NCCL; the main job under torchrun
# Logs and results land in $OUT (default /tmp/gpu_out).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
STAGES=${STAGES:-build,tests,diag,vranks,dataplane,moe,costterms,fp8,soak,gemm}   # host: on request
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name(), torch.cuda.device_count(), 'GPU(s)')"
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
NG=$($PY -c "import torch; print(torch.cuda.device_count())")
rows=()

# stage NAME TIMEOUT_S COMMAND...: run it, log to $OUT/NAME.log, keep a summary row
stage() {
  local name=$1 limit=$2; shift 2
  [[ ",$STAGES," == *",$name,"* ]] || return 0
  echo "==== $name"
  local t0=$SECONDS
  if declare -F "$1" > /dev/null; then     # a shell function: timeout(1) cannot exec it
    export -f "$1" libs_ok; export PY
    timeout "$limit" bash -c "$*" > "$OUT/$name.log" 2>&1
  else
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  fi
  local rc=$?
  tail -n ${TAIL:-15} "$OUT/$name.log"
  local last
  last=$(grep -E "passed|failed|PASS|FAIL|error|Error" "$OUT/$name.log" | tail -1 | cut -c1-110)
  rows+=("| $name | $([ $rc = 0 ] && echo ok || echo "rc $rc") | $((SECONDS - t0)) s | ${last:-} |")
}

libs_ok() {   # $1: library folder
  MOONEP_LIB_DIR=$1 $PY -c "import sys; from moonep_ops import native as n; sys.exit(n.gemm() is None or n.ep() is None)"
}
build() {
  libs_ok moonep_ops/lib || $PY -m moonep_ops.build -j 16 || return 1
  libs_ok moonep_ops/lib/diagnostics || $PY -m moonep_ops.build -j 16 --diagnostics || return 1
  $PY scripts/check_abi.py && $PY scripts/check_abi.py --diagnostics
}
stage build 600 build
stage tests ${T_TESTS:-420} $PY -m pytest -q -rs tests/ -k cuda -p no:cacheprovider
stage diag 120 env MOONEP_LIB_DIR=moonep_ops/lib/diagnostics $PY -m pytest -q -rs \
  tests/test_plan_device_cuda.py -k "packed or batched or batches or pdl" -p no:cacheprovider
stage vranks 200 bash -c "$PY diagnostics/stream_queues.py && $PY diagnostics/virtual_rank_timeouts.py"
stage dataplane 300 bash -c "$PY benchmarks/bench_plan_device.py --skip-torch-graph && \
  $PY benchmarks/bench_data_plane_cuda.py"
stage moe 200 $PY benchmarks/bench_moe_step.py
stage costterms 200 $PY benchmarks/cost_terms_cuda.py
stage fp8 420 bash -c "$PY -m pytest -q -rs tests/test_grouped_mm_fp8_cuda.py -p no:cacheprovider && \
  $PY benchmarks/bench_fp8_gemm.py --out "$OUT" && $PY benchmarks/fp8_training.py --steps 200 && \
  for p in bf16 fp8; do $PY benchmarks/bench_moe_step.py --dim 7168 --hidden 2048 --experts 32 \
    --precision \$p --modes reduce-overhead --iters 10 || exit 1; done"
stage soak 300 $PY benchmarks/soak_cuda.py --steps 2000 --nan-every 100
stage gemm 420 $PY benchmarks/bench_gemm_zoo.py --out "$OUT" --time-limit-s 360
host() {
  local rc=0 t0=$SECONDS
  $PY benchmarks/bench_host_cost.py --out "$OUT" || rc=1
  # compilation starts only within the first 240 s of the layer benchmark (the stage's budget)
  $PY benchmarks/bench_layer_r1.py --out "$OUT" --time-limit-s 240 || rc=1
  if [ -d .gpu_carry/baseline/moonep_ops ] && [ $((SECONDS - t0)) -lt 330 ]; then
    # the same benchmarks, lighter, on the carried copy of an older package (with this tree's
    # libraries): the "before" of the host-cost tables, on the same GPU
    local base=$PWD/.gpu_carry/baseline
    { PYTHONPATH=$base:$PYTHONPATH MOONEP_LIB_DIR=$PWD/moonep_ops/lib timeout 90 $PY \
        benchmarks/bench_host_cost.py --sections gemm,step --rounds 2 --calls 100 || rc=1
      PYTHONPATH=$base:$PYTHONPATH MOONEP_LIB_DIR=$PWD/moonep_ops/lib timeout 90 $PY \
        benchmarks/bench_layer_r1.py --modes eager --rounds 2 --steps 4 || rc=1
    } > "$OUT/baseline_host.md" 2>&1
  elif [ -d .gpu_carry/baseline/moonep_ops ]; then
    echo "baseline skipped: $((SECONDS - t0)) s used of the stage's budget"
  fi
  # the tables, for the stage's summary (the log holds the progress lines too)
  echo "==== summary"
  sed '/^## Details/,$d' "$OUT/host_cost.md" | grep -v "^$"
  grep -v "^$" "$OUT/layer_r1.md"
  [ -f "$OUT/baseline_host.md" ] && echo "baseline: $(grep -c MISSED "$OUT/baseline_host.md") \
MISSED lines, tables in baseline_host.md"
  return $rc
}
TAIL=${TAIL:-150} stage host 560 host
if [ "$NG" -ge 2 ]; then
  stage nccl 300 env MOONEP_TEST_DIST=nccl $PY -m pytest -q -rs tests/test_data_plane.py \
    tests/test_moe.py -p no:cacheprovider
  stage job 330 $PY -m torch.distributed.run --standalone --nproc-per-node "$NG" -m apps.job \
    -E 256 -K 8 --dim 2048 --ffn 1024 --layers 9 --tokens 4096 --steps 2 --maxvio 0.2 20 \
    --no-compile --no-progress --out "$OUT/job"
fi
echo
echo "| stage | result | time | last line |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
