#!/usr/bin/env bash
# tripod's GPU check: Triton kernels vs torch twins (correctness, GB/s, TFLOP/s), three bf16 PPO steps on one GPU
# with the embedded rollout engine, and the resharding bench on CUDA tensors. Writes bench/gpu_check/gpu_check.{json,md}.
#
#   make gpu-bundle                        # once, on a machine with PyPI: ./wheels (CPython 3.12, < 64 MiB)
#   bash scripts/gpu_check.sh              # on the CUDA machine, offline (one H200: docs/gpu_check.md has times)
#   bash scripts/gpu_check.sh --dry-run    # on CPU, tiny sizes: every step up to the first CUDA call (CI runs this)
#
# Install (offline, from $GPU_CHECK_WHEELS, default ./wheels): when $PYTHON (default python3) runs inside a virtual
# environment the wheels go into it; otherwise into ./.gpu-venv, created with --system-site-packages so the device's
# own torch and Triton stay the ones used. tripod itself is always reinstalled from the bundle's wheel of this tree.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-wheels}
in_venv=$("$PY" -c 'import sys; print(int(sys.prefix != sys.base_prefix))')
PIP=("$PY" -m pip)
if [ "$in_venv" = 0 ]; then
  BASE=$PY
  PY=$PWD/.gpu-venv/bin/python
  if [ ! -x "$PY" ]; then  # without ensurepip: a venv without pip, filled by the base pip (pip >= 22.3: --python)
    "$BASE" -m venv --system-site-packages .gpu-venv ||
      { rm -rf .gpu-venv && "$BASE" -m venv --system-site-packages --without-pip .gpu-venv; }
  fi
  if "$PY" -m pip --version >/dev/null 2>&1; then PIP=("$PY" -m pip); else PIP=("$BASE" -m pip --python "$PY"); fi
fi
if [ -d "$WHEELS" ]; then
  "${PIP[@]}" install -q --no-index --find-links "$WHEELS" -r requirements-gpu-check.txt megatron-core==0.16.1
  "${PIP[@]}" install -q --no-index --find-links "$WHEELS" --no-deps --force-reinstall tripod
fi
if ! "$PY" -c "import torch, megatron.core, omegaconf, transformers, rich, tripod" 2>/dev/null; then
  echo "gpu_check.sh: $PY cannot import torch, megatron.core, omegaconf, transformers, rich and tripod; build the" \
       "wheels with 'make gpu-bundle' and send ./wheels with the tree (GPU_CHECK_WHEELS=DIR names another folder)" >&2
  exit 1
fi
exec "$PY" scripts/gpu_check.py "$@"
