#!/usr/bin/env bash
# tripod's GPU check, the one command of a lent GPU machine (docs/gpu_check.md): installs the bundle offline, runs
# scripts/gpu_check.py (env, roofline, kernels, PPO guarded, PPO at a real size, reshard, distributed optimizer and
# offload: one line each, the JSON written after every step to $OUT, else bench/gpu_check/), then `pytest -m gpu`.
#
#   make gpu-bundle                        # once, on a machine with PyPI: ./wheels (CPython 3.12, < 64 MiB)
#   bash scripts/gpu_check.sh              # on the CUDA machine, offline; every step capped: 8 minutes at most
#   bash scripts/gpu_check.sh --dry-run    # on CPU, tiny sizes, every step (CI: make test-gpu-bundle); no pytest
#   bash scripts/gpu_check.sh --steps ppo  # rerun some steps (no pytest either)
#
# Install (offline, from $GPU_CHECK_WHEELS, default ./wheels): when $PYTHON (default python3) runs inside a virtual
# environment the wheels go into it; otherwise into ./.gpu-venv, created with --system-site-packages so the device's
# own torch and Triton stay the ones used. tripod itself is always reinstalled from the bundle's wheel of this tree.
# The exit status is the driver's (PASS: 0), or pytest's when the driver passed: a failing step never skips pytest.
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
set +e
"$PY" scripts/gpu_check.py "$@"
rc=$?
case " $* " in *" --dry-run "*|*" --steps "*) exit $rc ;; esac
log=${OUT:-bench/gpu_check}/pytest_gpu.txt
mkdir -p "$(dirname "$log")"
timeout 60 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_gpu_paths.py tests/multiprocess/test_rollout.py \
  2>&1 | tee "$log" | tail -25
prc=${PIPESTATUS[0]}
echo "gpu_check.sh: pytest -m gpu exited $prc (output in $log); the check exited $rc"
[ "$rc" = 0 ] && exit "$prc"
exit "$rc"
