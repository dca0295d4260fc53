#!/usr/bin/env bash
# Everything that needs the H200, in one call (device tool):  bash scripts/gpu_check.sh
#   1. install carried wheels (expecttest) and the package; print the environment
#   2. tests: the whole suite on the GPU box (CPU tests on torch 2.11 + every CUDA test);
#      cuda: only the CUDA test files (tests/*_cuda.py)
#      nccl: (several GPUs) the multi-rank cases of test_data_plane / test_moe over NCCL
#   3. dataplane: device planner latency, dispatch/combine bandwidth, eager vs CUDA-graph steps,
#      the 1000-step soak
#   4. moe: MoE layer step benchmark (eager vs compiled vs reduce-overhead)
#      job: the main job under torchrun on every GPU (not in the default STAGES)
#   5. gemm: scripts/gpu_check_gemm.sh (build if needed, CUDA tests, calibrate, bench)
# The libraries are built on the CPU machine (python -m moonep_ops.build) and carried:
#   run(command="bash scripts/gpu_check.sh", carry=["moonep_ops/lib", ".gpu_carry"])
# Results land in $OUT; a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
STAGES=${STAGES:-tests,dataplane,moe,gemm}
[ -d .gpu_carry/wheels ] && $PY -m pip install -q --no-index --no-deps .gpu_carry/wheels/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name())"
summary=()
if [[ $STAGES == *tests* ]]; then
  timeout ${T_TESTS:-300} $PY -m pytest -q -rs tests 2>&1 | tee "$OUT/pytest_all.log" | tail -15
  summary+=("tests: $(tail -1 "$OUT/pytest_all.log")")
fi
if [[ $STAGES == *cuda* ]]; then
  timeout ${T_CUDA:-300} $PY -m pytest -q -rs tests/*_cuda.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -40
  summary+=("cuda tests: $(tail -1 "$OUT/pytest_cuda.log")")
fi
if [[ $STAGES == *nccl* ]]; then   # several GPUs: the multi-rank test cases over NCCL, a GPU per rank
  NG=$($PY -c "import torch; print(torch.cuda.device_count())")
  if [ "$NG" -ge 2 ]; then
    MOONEP_TEST_DIST=nccl timeout ${T_NCCL:-300} $PY -m pytest -q -rs tests/test_data_plane.py \
      tests/test_moe.py 2>&1 | tee "$OUT/pytest_nccl.log" | tail -6
    summary+=("nccl tests (R <= $NG): $(tail -1 "$OUT/pytest_nccl.log")")
  fi
fi
if [[ $STAGES == *dataplane* ]]; then
  [ -f benchmarks/bench_plan_device.py ] && timeout ${T_PLAN:-200} $PY benchmarks/bench_plan_device.py 2>&1 | tee "$OUT/bench_plan_device.log" | tail -12
  timeout ${T_WST:-60} $PY benchmarks/plan_warp_stamps.py 2>&1 | tee "$OUT/plan_warp_stamps.log" | tail -6
  timeout ${T_DP:-240} $PY benchmarks/bench_data_plane_cuda.py 2>&1 | tee "$OUT/bench_data_plane.log" | tail -16
  timeout ${T_SOAK:-240} $PY benchmarks/soak_cuda.py 2>&1 | tee "$OUT/soak.log" | tail -3
  summary+=("soak: $(tail -1 "$OUT/soak.log")")
  NG=$($PY -c "import torch; print(torch.cuda.device_count())")
  if [ "$NG" -ge 2 ]; then      # several GPUs: MoonEP vs the NCCL all-to-all baseline
    timeout ${T_MG:-240} $PY -m torch.distributed.run --nproc_per_node=$NG \
      benchmarks/bench_multigpu_dispatch.py 2>&1 | tee "$OUT/bench_multigpu.log" | grep -v "^W\|^\*" | tail -8
  fi
fi
if [[ $STAGES == *job* ]]; then    # the main job under torchrun on every GPU (CUDA backends)
  NG=$($PY -c "import torch; print(torch.cuda.device_count())")
  # JOB_ARGS default: the 9-layer, 256-expert, top-8 setting of issue #8 (about 200 s at R=2,
  # most of it start-up and the profile; a shorter timeout kills it before the table prints).
  JOB_ARGS=${JOB_ARGS:--E 256 -K 8 --hidden 2048 --ffn 1024 --layers 9 --tokens 4096 --steps 2 --maxvio 0.2 20 --no-compile --profile}
  timeout ${T_JOB:-330} $PY -m torch.distributed.run --standalone --nproc-per-node $NG \
    -m moonep_ops $JOB_ARGS --no-progress --out "$OUT/job" 2>&1 | tee "$OUT/job.log" | grep -v "^W1" | tail -16
  summary+=("job: $(grep -c '^| ' "$OUT/job.log") table rows")
fi
if [[ $STAGES == *moe* ]]; then
  timeout ${T_MOE:-200} $PY benchmarks/bench_moe_step.py 2>&1 | tee "$OUT/bench_moe_step.log" | tail -12
  summary+=("moe: $(tail -1 "$OUT/bench_moe_step.log")")
fi
if [[ $STAGES == *gemm* ]]; then
  OUT=$OUT bash scripts/gpu_check_gemm.sh 2>&1 | tee "$OUT/gemm.log" | tail -40
fi
echo "==== summary ===="
printf '%s\n' "${summary[@]}"
