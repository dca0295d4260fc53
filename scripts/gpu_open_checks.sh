#!/usr/bin/env bash
# The GPU checks the open work still needs (logs in $OUT/<step>.log, each step with its own time
# limit).  The default steps take ~12 min on an H100, past one call's 10: run them in two calls,
# chained while the machine is warm, with the libraries built here carried:
#   run(command="STEPS=tests,zoo,hostops,experts bash scripts/gpu_open_checks.sh",
#       carry=["moonep_ops/lib", ".whl"])
#   run(command="STEPS=layer,host,fp8,gemm bash scripts/gpu_open_checks.sh", carry=[...the same])
# moonep_ops/lib: `python -m moonep_ops.build -j 2` of this tree.  Step planner also needs
# build/planner_base, the planner before its split into stage files (git archive f374fbe^
# moonep_ops benchmarks/bench_plan_device.py into it, and that tree's libmoonep_ep.so); step
# probe needs diagnostics/swiglu_probe.so (its build line: diagnostics/README.md).
# Steps (STEPS=a,b to run some; EXPERT_PRECISIONS, LAYER_MODES narrow the two benchmarks):
#   tests     the CUDA tests of the data plane, the SwiGLU kernels, the MoE layer (bf16, gated,
#             virtual ranks) and the transformers model on CUDA
#   probe     diagnostics/swiglu_probe.py (carry diagnostics/swiglu_probe.so): the SwiGLU
#             kernels' variants and the library's own exports, side by side
#   hostops   diagnostics/layer_host_profile.py on the small shape, compiled: host us of each
#             custom op's body as the compiled graph calls it
#   zoo       bench_gemm_zoo.py --no-calib --rounds 3 (~75 s on an H100): ours against
#             torch._grouped_mm on the model zoo with the constants of this GPU's kind
#             (gemm/tuning_h100.json on an H100: fitted, not yet run on the GPU)
#   planner   the device planner's CUDA tests, then bench_plan_device on the split planner and on
#             build/planner_base, three alternating rounds (the latency A/B)
#   symm      the symmetric backend's prefetch_weight / reduce_grad tests (more tensors than one
#             launch takes)
#   experts   the gated experts' CUDA tests (expert biases, the clamped SwiGLU), the converted
#             gpt-oss on CUDA, bench_expert_variants (bf16, fp8: the variant's step <= 1.03x)
#   layer     bench_layer_r1 on its four shapes, eager / compiled / captured + profile (titan-style
#             / ours at R = 1, the GEMMs in order) and the converted tiny Qwen3-MoE's host time
#   host      bench_host_cost's GEMM section (host us per call against torch._grouped_mm)
#   fp8       bench_fp8_step's variants at 8 experts a rank, 1 and 4 micro-batches
#   gemm      the rest of the CUDA tests of the GEMMs and the MoE layer
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
STEPS=${STEPS:-tests,zoo,hostops,experts,layer,host,fp8,gemm}
ROOT=$PWD
$PY scripts/check_abi.py | tail -3
T0=$SECONDS
step() {   # step NAME LIMIT_S COMMAND...: run it unless STEPS leaves it out
  local name=$1 limit=$2; shift 2
  [[ ",$STEPS," == *",$name,"* ]] || return 0
  echo "==== $name ($((SECONDS - T0)) s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "rc $? ($((SECONDS - T0)) s)"
  grep -E "passed|failed|MISMATCH|^FAILED|^ERROR" "$OUT/$name.log" | tail -8
}
planner() {
  $PY -m pytest -q -rs -p no:cacheprovider tests/test_plan_device_cuda.py tests/test_planner_cuda.py
  [ -d build/planner_base/moonep_ops ] || { echo "build/planner_base missing: no latency A/B"; return 1; }
  for i in 1 2 3; do
    echo "== round $i: split"
    $PY benchmarks/bench_plan_device.py --skip-torch-graph --torch-iters 1 --reps 3
    echo "== round $i: before the split"
    (cd build/planner_base && PYTHONPATH=$PWD${PYTHONPATH#$ROOT} $PY benchmarks/bench_plan_device.py \
      --skip-torch-graph --torch-iters 1 --reps 3)
  done
}
experts() {
  $PY -m pytest -q -rs -p no:cacheprovider tests/test_hf_gpt_oss.py -k cuda
  $PY benchmarks/bench_expert_variants.py --precisions "${EXPERT_PRECISIONS:-bf16,fp8}" \
    --rounds 3 --steps 4 --profile \
    --out "$OUT/expert_variants.json"
}
export -f planner experts
export PY ROOT
step tests 300 $PY -m pytest -q -rs -p no:cacheprovider tests/test_swiglu_cuda.py \
  tests/test_moe_ext_cuda.py tests/test_data_plane_cuda.py tests/test_symm_cuda.py \
  tests/test_async_cuda.py tests/test_moe_symm_cuda.py tests/test_virtual_ranks_fresh_cuda.py \
  tests/test_lifetimes_cuda.py tests/test_integrations_hf_cuda.py ${EXTRA_TESTS:-}
step probe 60 $PY diagnostics/swiglu_probe.py --reps 11
step zoo 150 $PY benchmarks/bench_gemm_zoo.py --no-calib --rounds 3 --out "$OUT"
step hostops 120 $PY diagnostics/layer_host_profile.py --shape small --modes compiled --steps 20 \
  --top 25
step planner 200 bash -c planner
step symm 120 $PY -m pytest -q -rs -p no:cacheprovider tests/test_symm_cuda.py \
  tests/test_async_cuda.py -k prefetch
step experts 150 bash -c experts
step layer 330 $PY benchmarks/bench_layer_r1.py --modes "${LAYER_MODES:-eager,compiled,captured,profile}" \
  --rounds 3 --steps 4 --time-limit-s 300 --out "$OUT"
step host 90 $PY benchmarks/bench_host_cost.py --sections gemm --rounds 3 --calls 100 --out "$OUT"
step fp8 70 $PY benchmarks/bench_fp8_step.py --experts 8 --micro 1,4 --iters 8 \
  --variants bf16,fp8,fp8_cache,fp8_base
step gemm 150 $PY -m pytest -q -p no:cacheprovider tests/test_grouped_gemm_cuda.py \
  tests/test_moe_symm_cuda.py tests/test_fp8_quant_cuda.py tests/test_fp8_wgrad_cuda.py \
  tests/test_grouped_mm_fp8_cuda.py
echo "==== done ($((SECONDS - T0)) s)"
grep -E "^\[|op bodies|calls/step" "$OUT/probe.log" "$OUT/hostops.log" 2>/dev/null | head -90
grep -E "^\| (fwd|dgrad|wgrad_lp) \|" "$OUT/zoo.log" 2>/dev/null | head -30
for f in layer experts fp8; do
  [ -f "$OUT/$f.log" ] && grep -E "^\| |captured|eager|compiled|ratio|MET|MISSED|^gpt" "$OUT/$f.log" | head -60
done
