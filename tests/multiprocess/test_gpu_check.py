"""scripts/gpu_check.sh --dry-run: every step of the GPU check on CPU at tiny sizes (Triton through its interpreter,
one bf16 PPO step on trainer.device=cpu under the device guard, the reshard bench), so the script is known to work
up to the first CUDA call."""
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.common import REPO_ROOT


@pytest.mark.dist
def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path)], cwd=REPO_ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["dry_run"] and list(result["steps"]) == ["env", "roofline", "kernels", "ppo", "reshard"]
    assert all(s["ok"] for s in result["steps"].values()), {k: s.get("error") for k, s in result["steps"].items()}
    assert all(r["ok"] for r in result["steps"]["kernels"]["result"]["correctness"])
    assert result["steps"]["ppo"]["result"]["device_checked_steps"] == 1
    assert result["steps"]["reshard"]["result"]["traffic_ratio"] > 1  # micro-DP gather moves less than naive
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.count("| yes |") == 5
