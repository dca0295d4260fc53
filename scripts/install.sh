#!/usr/bin/env bash
# Install moonep_ops and its test deps into the current Python without ever pulling a CUDA torch.
# On these CPU machines torch 2.13.0 (CPU build) lies on disk; pip takes it by exact version.
set -euo pipefail
PY=${PY:-python3}
if ! $PY -c "import torch" >/dev/null 2>&1; then
  $PY -m pip install -q "torch==2.13.0"
fi
$PY -m pip install -q -e ".[test,demo]"
