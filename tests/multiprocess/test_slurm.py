"""`tripod train` on a real SLURM (single-node slurmctld + slurmd from scripts/slurm_local.sh; `make test-launch`):
sbatch --wait of recipes/launch_slurm.sh (sbatch -> srun -> torchrun, 2 ranks) finishes 3 steps and leaves a
checkpoint; plain `srun --ntasks=2` runs the same world in-process (ranks from SLURM_PROCID) and gives the same
numbers; an srun whose task count disagrees with the recipe stops with one line.
Marked `slurm`: excluded from `make test` (pytest.ini); selected with `-m slurm`, they fail when sbatch is missing."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.common import REPO_ROOT
from tests.helpers.common import free_port as _free_port
from tests.helpers.common import launch_env as _env
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides

pytestmark = pytest.mark.slurm
STEPS = 3


@pytest.fixture(autouse=True, scope="module")
def _needs_slurm():
    # pytest.ini's addopts deselect the `slurm` marker, so these run only when a command selects it (make test-launch):
    # there a missing SLURM is a failure, never a skip (a green target means sbatch and srun ran)
    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        pytest.fail("-m slurm needs SLURM's sbatch and srun on PATH: run `make test-launch` as root (it starts a "
                    "single-node SLURM with `bash scripts/slurm_local.sh start`)", pytrace=False)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {m["step"]: m for m in map(json.loads, f)}


def _args(setup, run_dir):
    return tiny_overrides(setup, run_dir, world=2, steps=STEPS) + [
        "data.val_files=[]", "trainer.val_before_train=false"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_ppo_setup(tmp_path_factory.mktemp("slurm"))


@pytest.fixture(scope="module")
def sbatch_run(setup, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sbatch")
    run_dir, log = str(tmp / "run"), str(tmp / "job-%j.out")
    args = [a for a in _args(setup, run_dir) if not a.startswith("trainer.resume=")]
    proc = subprocess.run(["sbatch", "--wait", "--nodes=1", f"--output={log}", f"--chdir={REPO_ROOT}",
                           "recipes/launch_slurm.sh", "recipes/defaults.yaml", *args],
                          env=_env(NPROC="2", LOG_ROOT=str(tmp / "logs"), MASTER_PORT=str(_free_port())),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    logs = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.startswith("job-")]
    text = "".join(open(p).read() for p in logs)
    assert proc.returncode == 0, proc.stdout + text[-5000:]
    return run_dir, text, str(tmp / "logs")


def test_sbatch_recipe_finishes_and_checkpoints(sbatch_run):
    run_dir, text, logs = sbatch_run
    assert "1 node(s) x 2 processes" in text
    assert sorted(_metrics(run_dir)) == list(range(1, STEPS + 1))
    assert os.path.exists(os.path.join(run_dir, "checkpoints", f"global_step_{STEPS}", "COMPLETE"))
    job_logs = os.listdir(logs)
    assert len(job_logs) == 1, job_logs  # one directory per job id
    with open(os.path.join(run_dir, "config.yaml")) as f:
        cfg = f.read()
    assert "resume: auto" in cfg and "n_gpus_per_node: 2" in cfg


def test_plain_srun_runs_in_process_with_the_same_numbers(setup, sbatch_run, tmp_path):
    run_dir = str(tmp_path / "run")
    proc = subprocess.run(["srun", "--ntasks=2", "--kill-on-bad-exit=1", sys.executable, "-m", "tripod", "train",
                           "recipes/defaults.yaml", *_args(setup, run_dir)], cwd=REPO_ROOT,
                          env=_env(MASTER_PORT=str(_free_port())), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert proc.stdout.count("final validation") <= 1
    want, got = _metrics(sbatch_run[0]), _metrics(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in want:  # same world, layout and threads as the sbatch -> torchrun run: identical numbers
        for k in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm"):
            assert got[step][k] == want[step][k], (step, k)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        assert len(f.readlines()) == STEPS  # one writer: the two tasks are one world, not two


def test_srun_task_count_mismatch_is_one_line(setup, tmp_path):
    proc = subprocess.run(["srun", "--ntasks=3", "--overcommit", "--kill-on-bad-exit=1", sys.executable, "-m",
                           "tripod", "train", "recipes/defaults.yaml", *_args(setup, str(tmp_path / "run"))],
                          cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [line for line in proc.stdout.splitlines() if line.startswith("tripod train: error:")]
    assert len(errors) == 1 and "srun with 3 tasks" in errors[0] and "trainer.n_gpus_per_node" in errors[0], \
        proc.stdout[-3000:]
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
