"""The GPU check's CI dry run, through the same install path as on the lent machine: `scripts/gpu_bundle.sh` builds the
wheels (for this interpreter's Python version: the only CPU torch on disk is cp311; the device bundle is the same
script with --python 3.12), a fresh venv gets the CPU torch + Triton pinned in requirements.txt and nothing else, and
`scripts/gpu_check.sh --dry-run` installs the bundle offline into it and runs every step on CPU at tiny sizes (Triton
through its interpreter, one bf16 PPO step on trainer.device=cpu under the device guard, the reshard bench, the
offload movers' worker).
A packaging check rather than a unit of the engine: `make test-gpu-bundle` runs it, and CI (.ci/run) calls that."""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.common import REPO_ROOT

BUNDLE_LIMIT = 64 << 20  # what travels with the tree per device call


def _pins(*names: str) -> list[str]:
    with open(os.path.join(REPO_ROOT, "requirements.txt")) as f:
        lines = [ln.strip() for ln in f]
    return [ln for ln in lines if re.match(rf"^({'|'.join(names)})==", ln)]


def _run(cmd, timeout: int, **kw) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{cmd[:3]} failed:\n{proc.stdout[-4000:]}"
    return proc.stdout


@pytest.mark.bundle
def test_gpu_check_dry_run_from_the_bundle(tmp_path):
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    wheels = tmp_path / "wheels"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    _run(["bash", "scripts/gpu_bundle.sh", "--python", version, "--out", wheels], 600,
         env=dict(clean, PYTHON=sys.executable))
    names = sorted(os.listdir(wheels))
    assert any(n.startswith("tripod-") for n in names) and any(n.startswith("megatron_core-0.16.1") for n in names)
    assert not [n for n in names if re.match(r"(torch|triton|pyarrow|nvidia)[-_]", n)], names
    assert sum(os.path.getsize(wheels / n) for n in names) < BUNDLE_LIMIT

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], 300, env=clean)
    python = venv / "bin" / "python"
    pins = _pins("torch", "triton")
    assert len(pins) == 2, pins
    _run([python, "-m", "pip", "install", "-q", *pins], 900, env=clean)  # the CPU torch wheel on disk, never CUDA

    out = tmp_path / "out"
    env = dict(clean, PYTHON=str(python), GPU_CHECK_WHEELS=str(wheels), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out)], cwd=REPO_ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["dry_run"] and list(result["steps"]) == ["env", "roofline", "kernels", "ppo", "reshard", "offload"]
    assert all(s["ok"] for s in result["steps"].values()), {k: s.get("error") for k, s in result["steps"].items()}
    assert result["steps"]["env"]["result"]["tripod"].startswith(str(venv))  # the bundle's tripod, not the checkout
    assert all(r["ok"] for r in result["steps"]["kernels"]["result"]["correctness"])
    assert result["steps"]["ppo"]["result"]["device_checked_steps"] == 1
    assert result["steps"]["reshard"]["result"]["traffic_ratio"] > 1  # micro-DP gather moves less than naive
    offload = result["steps"]["offload"]["result"]  # the movers' worker, on CPU here (test_offload_movers.py)
    assert len(offload) == 5 and all(r["reload_checks"] > 0 and r["twin_max_diff"] == 0.0 for r in offload.values())
    assert (out / "gpu_check.md").read_text().count("| yes |") == 6
