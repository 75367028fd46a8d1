"""The GPU check's CI dry run, through the same install path as on the lent machine, against the lent machine's own
versions where PyPI has CPU wheels for them: `scripts/gpu_bundle.sh` builds the wheels for this interpreter's Python
version (the device bundle is the same script with --python 3.12; the only CPU torch wheel on disk is cp311), a fresh
venv gets requirements.txt's CPU torch and the device's versions of Triton, transformers and the hub packages
(requirements-gpu-box.txt: Triton 3.6, transformers 5.17, ...), and `scripts/gpu_check.sh --dry-run` installs the
bundle offline into it and runs every step of the check on CPU at tiny sizes. The JSON is checked with the driver's
own schema (scripts/gpu_check_steps/schema.py): every step present and passed, every number finite, PASS.
A packaging check rather than a unit of the engine: `make test-gpu-bundle` runs it, and CI (.ci/run) calls that."""
import json
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.common import REPO_ROOT

BUNDLE_LIMIT = 64 << 20  # what travels with the tree per device call


def _pins(path: str, *names: str) -> list[str]:
    with open(os.path.join(REPO_ROOT, path)) as f:
        lines = [ln.strip() for ln in f]
    return [ln for ln in lines if re.match(rf"^({'|'.join(names)})==", ln)]


def _run(cmd, timeout: int, **kw) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{cmd[:3]} failed:\n{proc.stdout[-4000:]}"
    return proc.stdout


@pytest.mark.bundle
def test_gpu_check_dry_run_from_the_bundle(tmp_path):
    sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
    from gpu_check_steps.schema import STEPS, problems

    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "OUT")}
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
    torch_pin = _pins("requirements.txt", "torch")
    box = [ln for ln in open(os.path.join(REPO_ROOT, "requirements-gpu-box.txt")).read().splitlines()
           if ln and not ln.startswith("#")]
    assert len(torch_pin) == 1 and _pins("requirements-gpu-box.txt", "triton", "transformers") == \
        ["triton==3.6.0", "transformers==5.17.0"], (torch_pin, box)
    # numpy < 2.4 for Triton 3.6's interpreter (the dry run's stand-in for its compiler: it converts 1-element arrays
    # with int(), which NumPy 2.4 refuses); the device compiles the kernels and never runs the interpreter
    _run([python, "-m", "pip", "install", "-q", *torch_pin, *box, "numpy<2.4"], 900, env=clean)  # torch: CPU wheel

    out = tmp_path / "out"
    env = dict(clean, PYTHON=str(python), GPU_CHECK_WHEELS=str(wheels), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out)], cwd=REPO_ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    printed = [ln for ln in proc.stdout.splitlines() if ln.startswith("gpu_check: ")]
    assert proc.returncode == 0, proc.stdout[-6000:]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["dry_run"] and list(doc["steps"]) == [s.name for s in STEPS]
    assert problems(doc) == [] and doc["verdict"] == "PASS", problems(doc)
    assert len(printed) == len(STEPS) + 1 and printed[-1].split()[4] == "PASS", printed  # one line per step + total
    env_step = doc["steps"]["env"]["result"]
    assert env_step["tripod_from"].startswith(str(venv))  # the bundle's tripod, not the checkout
    assert (env_step["triton"], env_step["transformers"]) == ("3.6.0", "5.17.0")  # the device's versions ran
    assert env_step["sdpa_ops"], env_step  # the actor's attention went through torch's SDPA
    assert doc["steps"]["ppo_guarded"]["result"]["ops_off_device"] == 0
    ppo = doc["steps"]["ppo"]["result"]
    assert ppo["responses"] >= 8 and ppo["checkpoint_gb"] > 0 and ppo["plan_peak_gb"] > 0
    assert doc["steps"]["reshard"]["result"]["traffic_ratio"] > 1  # micro-DP gather moves less than naive
    offload = doc["steps"]["optim"]["result"]["offload"]  # the movers' worker, on CPU here (test_offload_movers.py)
    assert len(offload) == 5 and all(r["reload_checks"] > 0 and r["twin_max_diff"] == 0.0 for r in offload.values())
    assert (out / "gpu_check.md").read_text().count("| yes |") == len(STEPS)
