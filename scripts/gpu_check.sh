#!/usr/bin/env bash
# tripod's GPU check: Triton kernels vs torch twins (correctness, GB/s, TFLOP/s), three bf16 PPO steps on one GPU
# with the embedded rollout engine, and the resharding bench on CUDA tensors. Writes bench/gpu_check/gpu_check.{json,md}.
#
#   bash scripts/gpu_check.sh            # on a CUDA machine (one H200: about 3-5 minutes)
#   bash scripts/gpu_check.sh --dry-run  # on CPU, tiny sizes: every step up to the first CUDA call (CI runs this)
#
# Offline machines: the pure-Python dependencies travel with the tree as wheels in ./wheels (see docs/gpu_check.md
# for the `pip download` line); they are installed from there, without an index, when they are not importable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [ -d wheels ] && ! "$PY" -c "import megatron.core, omegaconf, safetensors, pyarrow, transformers" 2>/dev/null; then
  "$PY" -m pip install --no-index --find-links wheels -r requirements-gpu-check.txt -q
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" scripts/gpu_check.py "$@"
