# Sourced by the GPU scripts (gpu_check.sh, gpu_fp8_step.sh, gpu_open_checks.sh): the repository
# root as the working directory, $OUT (exported: stage functions run in a child bash), the
# environment every GPU run sets, $PY, and the carried wheels of .whl/ installed and on
# PYTHONPATH after the repository.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/gpu_out}
export OUT
mkdir -p "$OUT"
# NVLink multicast stays off (it can take a shared host's GPUs out of service).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/moonep_site .whl/*.whl 2>&1 | tail -1
  export PYTHONPATH=/tmp/moonep_site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
