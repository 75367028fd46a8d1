#!/usr/bin/env bash
# SLURM launcher for `tripod train`: sbatch -> srun (one task per node) -> torchrun (NPROC processes per node).
#
#   sbatch --nodes=2 --gpus-per-node=8 recipes/launch_slurm.sh RECIPE.yaml [key=value ...]
#   NPROC=2 sbatch --nodes=1 recipes/launch_slurm.sh ...      (CPU / explicit processes per node)
#
# Requeue-friendly: trainer.resume=auto (the default, restated here) continues from the newest complete checkpoint,
# so `scontrol requeue` or a resubmission picks up where the job stopped. --kill-on-bad-exit ends every node's
# task when one fails. Logs: tripod-<jobid>.out per job, plus torchrun's per-rank logs under
# ${LOG_ROOT:-logs}/<jobid>/. Extra env: MASTER_PORT (default 29500 + jobid % 1000), MAX_RESTARTS (torchrun
# restarts within the job, default 0), PYTHON.
#SBATCH --job-name=tripod
#SBATCH --ntasks-per-node=1
#SBATCH --output=tripod-%j.out
#SBATCH --requeue
set -euo pipefail
RECIPE=${1:?usage: sbatch recipes/launch_slurm.sh RECIPE.yaml [key=value ...]}; shift
PYTHON=${PYTHON:-python}
NPROC=${NPROC:-${SLURM_GPUS_ON_NODE:-8}}
NNODES=${SLURM_JOB_NUM_NODES:-1}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
LOGS=${LOG_ROOT:-logs}/$SLURM_JOB_ID
mkdir -p "$LOGS"
export THP_MEM_ALLOC_ENABLE=${THP_MEM_ALLOC_ENABLE:-1}  # torch's CPU tensors on huge pages (engine/launch.py)
echo "tripod job $SLURM_JOB_ID: $NNODES node(s) x $NPROC processes, rendezvous $HEAD:$PORT, logs $LOGS"
srun --kill-on-bad-exit=1 --ntasks-per-node=1 --nodes="$NNODES" \
  "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC" \
  --max-restarts="${MAX_RESTARTS:-0}" --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d --rdzv-endpoint="$HEAD:$PORT" \
  --log-dir="$LOGS" --redirects=3 --tee=3 \
  -m tripod train "$RECIPE" trainer.resume=auto "$@" \
  trainer.nnodes="$NNODES" trainer.n_gpus_per_node="$NPROC"
