#!/usr/bin/env bash
# Install moonep_ops with its test and demo dependencies into the current Python ($PY), never
# pulling a CUDA torch: on these CPU machines torch 2.13.0 (CPU build) lies on disk and pip takes
# it by exact version before anything else can ask for a torch.
set -euo pipefail
PY=${PY:-python3}
if ! $PY -c "import torch" >/dev/null 2>&1; then
  $PY -m pip install -q "torch==2.13.0"
fi
$PY -m pip install -q -e ".[test,demo]"
