#!/usr/bin/env bash
# torchrun launcher for `tripod train`, one node or several.
#
#   one node:    bash recipes/launch_torchrun.sh RECIPE.yaml [key=value ...]
#   many nodes:  on every node (same command, NODE_RANK 0..NNODES-1):
#                NNODES=2 NODE_RANK=0 MASTER_ADDR=<node 0 host> bash recipes/launch_torchrun.sh RECIPE.yaml [...]
#
# NNODES / NPROC default to the recipe's trainer.nnodes / trainer.n_gpus_per_node (after the overrides). Whatever
# is used is also passed to tripod train as trainer.nnodes / trainer.n_gpus_per_node, so the launch and the recipe
# agree on the world size (tripod train refuses a launch that does not match, in one line).
# Optional: MASTER_PORT (29500), RDZV_ID (run id shared by the nodes), MAX_RESTARTS (torchrun --max-restarts:
# restart the whole group after a crash; use with trainer.resume=auto, the default), PYTHON (python).
set -euo pipefail
RECIPE=${1:?usage: launch_torchrun.sh RECIPE.yaml [key=value ...]}; shift
PYTHON=${PYTHON:-python}
read -r CFG_NNODES CFG_NPROC < <("$PYTHON" -c "
import sys
from tripod.engine.config import load_config
t = load_config(sys.argv[1], sys.argv[2:]).trainer
print(t.nnodes, t.n_gpus_per_node)" "$RECIPE" "$@")
NNODES=${NNODES:-$CFG_NNODES}
export THP_MEM_ALLOC_ENABLE=${THP_MEM_ALLOC_ENABLE:-1}  # torch's CPU tensors on huge pages (engine/launch.py)
NPROC=${NPROC:-$CFG_NPROC}
ARGS=(--nnodes="$NNODES" --nproc-per-node="$NPROC" --max-restarts="${MAX_RESTARTS:-0}")
if [[ "$NNODES" == 1 && -z "${MASTER_ADDR:-}" ]]; then
  ARGS+=(--standalone)
else
  ARGS+=(--node-rank="${NODE_RANK:-0}" --rdzv-backend=c10d --rdzv-id="${RDZV_ID:-tripod}"
         --rdzv-endpoint="${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}:${MASTER_PORT:-29500}")
fi
exec "$PYTHON" -m torch.distributed.run "${ARGS[@]}" -m tripod train "$RECIPE" "$@" \
  trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$NPROC"
