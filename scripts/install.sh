#!/usr/bin/env bash
# Install moonep_ops with everything its tests and the main job need into the current Python ($PY),
# never pulling a CUDA torch:
#   1. torch 2.13.0 (the CPU build, on this machine's disk) first, when no torch is installed, so
#      that nothing later can ask pip for another torch;
#   2. the package with its test and demo extras (setup.py);
#   3. torchtitan 0.3.0 for its integration's tests and example, without its dependencies: its
#      metadata asks for torchdata, datasets and wandb (and through them another torch); its model
#      code needs spmd_types, einops, tyro and safetensors, its Trainer torchdata (again without
#      dependencies), tokenizers, tensorboard and datasets.
set -euo pipefail
PY=${PY:-python3}
if ! $PY -c "import torch" >/dev/null 2>&1; then
  $PY -m pip install -q "torch==2.13.0"
fi
$PY -m pip install -q -e ".[test,demo]"
$PY -m pip install -q --no-deps "torchtitan==0.3.0"
$PY -m pip install -q --no-deps "torchdata==0.11.0"
# (pip then reports torchtitan's undeclared dependencies as conflicts: expected, not printed)
log=$($PY -m pip install -q "spmd_types==0.2.3" einops tyro safetensors tokenizers tensorboard \
  "datasets>=3.6.0,<4.8.0" 2>&1) || { echo "$log"; exit 1; }
echo "$log" | grep -v "torchtitan\|dependency resolver\|^WARNING" || true
