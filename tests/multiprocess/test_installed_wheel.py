"""tripod installed from its wheel (not the editable checkout, as the GPU check installs it): `tripod plan` of a
recipe whose model is a hub name finds the bundled architecture copy beside the recipe (recipes/model_configs/),
from a directory that is not the checkout. The bug this guards: the copies were looked up beside the installed
package, where a wheel has no recipes/ ("recipes/model_configs/ holds only ;").

The wheel is built from a copy of setup.py and src/ (the shared checkout gets no build/ or egg-info) and installed
with --no-deps into a fresh venv that sees the project venv's packages through a plain path line (so the project
venv's editable `.pth`, which names src/, is not processed there): offline, ~15 s."""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys

from tests.helpers.common import REPO_ROOT

RECIPE = "recipes/qwen2.5/7b-gsm8k-grpo-lora.yaml"


def _run(cmd: list, cwd, env: dict) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-4000:]}"
    return proc.stdout


def test_plan_from_an_installed_wheel_finds_the_recipes_model_configs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(REPO_ROOT / "setup.py", tree)
    shutil.copytree(REPO_ROOT / "src" / "tripod", tree / "src" / "tripod",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), symlinks=False)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "--wheel-dir",
          tmp_path / "wheels", tree], tmp_path, env)
    (wheel,) = (tmp_path / "wheels").glob("tripod-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path, env)
    python = venv / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env).strip()
    with open(os.path.join(purelib, "project_venv.pth"), "w") as f:  # torch, megatron, ... (plain paths only)
        f.write("\n".join(p for p in site.getsitepackages() if os.path.isdir(p)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", wheel], tmp_path, env)

    user = tmp_path / "user"  # a user's directory with the recipes, not the checkout
    shutil.copytree(REPO_ROOT / "recipes", user / "recipes", ignore=shutil.ignore_patterns("*.sh"))
    where = _run([python, "-c", "import tripod; print(tripod.__file__)"], user, env).strip()
    assert where.startswith(str(venv)), f"tripod was imported from {where}, not from the installed wheel"
    out = _run([venv / "bin" / "tripod", "plan", RECIPE], user, env)
    expected = user / "recipes" / "model_configs" / "Qwen--Qwen2.5-7B-Instruct.json"
    assert f"architecture: {expected}" in out, out[-3000:]
    assert "memory per rank" in out, out[-3000:]
