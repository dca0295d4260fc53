#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh installs on a bare GPU box that cannot reach the network
# (Python 3.12 there): put them in .whl/ (ignored by git) on a machine with pip access, then
# carry .whl to the GPU box.  What each is for:
#   nvidia-cutlass 4.2.0.0  the CUTLASS headers (the build stage, when moonep_ops/lib is not
#                           carried)
#   expecttest              torch.library.opcheck's dependency (the opcheck tests)
#   transformers 5.24.0     the version moonep_ops.integrations.hf is tested against (the box
#                           may have another: under 5.17 the CUDA-graph cases of
#                           tests/test_integrations_hf_cuda.py fail in its attention masks)
#   torchtitan 0.3.0 + spmd_types, tyro, docstring-parser, typeguard
#                           the torchtitan integration's tests (torchtitan without its own
#                           dependency list, as scripts/install.sh installs it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
mkdir -p .whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
  nvidia-cutlass==4.2.0.0 expecttest==0.3.0 transformers==5.24.0 torchtitan==0.3.0 \
  spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
ls -l .whl
