#!/usr/bin/env bash
# One node: bash recipes/launch_torchrun.sh RECIPE.yaml [key=value ...]
# GPUs per node come from the recipe's trainer.n_gpus_per_node (override NPROC to change the launch).
set -euo pipefail
RECIPE=${1:?usage: launch_torchrun.sh RECIPE.yaml [key=value ...]}; shift
NPROC=${NPROC:-$(python -c "from engine.config import load_config; import sys; print(load_config(sys.argv[1], sys.argv[2:]).trainer.n_gpus_per_node)" "$RECIPE" "$@")}
exec torchrun --standalone --nproc-per-node="$NPROC" -m engine.cli train "$RECIPE" "$@"
