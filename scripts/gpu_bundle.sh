#!/usr/bin/env bash
# `make gpu-bundle`: the wheels the offline GPU check installs (scripts/gpu_check.sh, docs/gpu_check.md), in ./wheels.
#
#   bash scripts/gpu_bundle.sh                 # for the lent GPU machine: CPython 3.12, manylinux x86_64
#   bash scripts/gpu_bundle.sh --python 3.11 --out DIR   # what the CI dry run builds for its own interpreter
#
# Contents: tripod (a wheel of this tree), megatron-core==0.16.1 (--no-deps: its metadata asks for torch, which the
# device brings), and requirements-gpu-check.txt with its dependencies, pinned to the versions installed for
# $PYTHON (the project venv the suite passes with: `pip freeze` as constraints). Never torch, Triton or pyarrow. Fails when
# the bundle is not under 64 MiB (what travels with the tree per device call).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=3.12
OUT=wheels
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PYVER=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "gpu_bundle.sh: unknown argument $1 (use --python X.Y, --out DIR)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
LIMIT=$((64 << 20))
rm -rf "$OUT"
mkdir -p "$OUT"
target=(--only-binary=:all: --implementation cp --python-version "$PYVER" --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any --dest "$OUT" -q)
"$PY" -m pip download "${target[@]}" --no-deps megatron-core==0.16.1
pins="$OUT/.constraints.txt"
"$PY" -m pip freeze --exclude-editable | grep -v -e ' @ ' -e '^-e' -e '^torch==' -e '^triton==' > "$pins" || true
"$PY" -m pip download "${target[@]}" -r requirements-gpu-check.txt -c "$pins"
rm -f "$pins"
"$PY" -m pip wheel --no-deps --no-build-isolation --wheel-dir "$OUT" -q .
if ls "$OUT" | grep -Eq '^(torch|triton|pyarrow|nvidia)[-_]'; then
  echo "gpu_bundle.sh: $OUT holds torch/triton/pyarrow/nvidia wheels; the bundle must not" >&2; exit 1
fi
size=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
echo "gpu_bundle.sh: $(ls "$OUT" | wc -l) wheels for CPython $PYVER in $OUT, $((size >> 20)) MiB ($size bytes)"
if [ "$size" -ge "$LIMIT" ]; then
  echo "gpu_bundle.sh: the bundle is $size bytes, over the 64 MiB that travels with the tree" >&2; exit 1
fi
