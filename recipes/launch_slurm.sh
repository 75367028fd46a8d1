#!/usr/bin/env bash
# Several nodes under SLURM: sbatch --nodes=2 --gpus-per-node=8 recipes/launch_slurm.sh RECIPE.yaml [key=value ...]
#SBATCH --job-name=tripod
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
RECIPE=${1:?usage: sbatch recipes/launch_slurm.sh RECIPE.yaml [key=value ...]}; shift
GPUS=${SLURM_GPUS_ON_NODE:-8}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
srun torchrun --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="$GPUS" \
  --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d --rdzv-endpoint="$HEAD:29500" \
  -m engine.cli train "$RECIPE" trainer.nnodes="$SLURM_JOB_NUM_NODES" trainer.n_gpus_per_node="$GPUS" "$@"
