"""The operator's view on a real `tripod train` run (tiny model, one rank): a profiled step's trace with a range per
stage and no trace for the other step, validation samples, the resolved config as the wandb (offline) and MLflow
run config, actor.target_kl stopping the PPO epochs early (fewer optimizer steps, with the reason logged), and
`tripod report` on the run directory. One run serves all of these: a tiny run costs ~1 min, mostly start-up."""
import gzip
import json
import os
import subprocess

import pytest

from tests.helpers.common import REPO_ROOT
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import TRIPOD, env, metrics, train_in_world
from tests.helpers.wandb_offline import history, offline_run_dir, read_records, run_info

EPOCHS, MINI_BATCHES = 4, 2  # train_batch_size 4 / ppo_mini_batch_size 2
STAGES = ("reshard", "gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
          "validation", "checkpoint")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("wandb", reason="pip install 'tripod[wandb]'")
    pytest.importorskip("mlflow", reason="pip install 'tripod[mlflow]'")
    tmp = tmp_path_factory.mktemp("operator_view")
    setup = make_ppo_setup(tmp)
    run_dir, wandb_dir = str(tmp / "run"), str(tmp / "wandb_home")
    os.makedirs(wandb_dir)
    args = tiny_overrides(setup, run_dir, world=1, steps=2) + [
        "trainer.logger=[jsonl,tensorboard,wandb,mlflow]", "trainer.project_name=opview",
        "trainer.experiment_name=tiny", "trainer.test_freq=1", "trainer.log_val_generations=3",
        "global_profiler.steps=[2]",
        # a large LR and several epochs: the second mini-batch already sees ppo_kl far above target_kl
        f"actor_rollout_ref.actor.ppo_epochs={EPOCHS}", "actor_rollout_ref.actor.target_kl=1e-4",
        "actor_rollout_ref.actor.optim.lr=1e-2"]
    proc = train_in_world(args, 1, tmp / "train.log",  # MLflow in the run's directory: no tracking URI
                          env=dict(WANDB_MODE="offline", WANDB_DIR=wandb_dir, WANDB_SILENT="true",
                                   MLFLOW_TRACKING_URI=""))
    assert proc.returncode == 0, proc.stdout[-5000:]
    return {"dir": run_dir, "wandb": wandb_dir, "stdout": proc.stdout, "metrics": metrics(run_dir)}


@pytest.mark.dist
def test_profiled_step_has_a_range_per_stage_and_other_steps_write_nothing(run):
    assert os.listdir(os.path.join(run["dir"], "profile")) == ["step_2"]
    assert os.listdir(os.path.join(run["dir"], "profile", "step_2")) == ["rank_0.trace.json.gz"]
    with gzip.open(os.path.join(run["dir"], "profile", "step_2", "rank_0.trace.json.gz"), "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert [s for s in STAGES if f"tripod/{s}" not in names] == []


@pytest.mark.dist
def test_target_kl_stops_the_epochs_early_and_says_why(run):
    steps = [m for m in run["metrics"] if m["step"] >= 1]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["actor/early_stopped"] == 1.0
        assert 1 <= m["actor/num_updates"] < EPOCHS * MINI_BATCHES, m["actor/num_updates"]
    reasons = [line for line in run["stdout"].splitlines() if line.startswith("actor: PPO epochs stopped early")]
    assert len(reasons) == 2, run["stdout"][-3000:]
    for line, m in zip(reasons, steps):
        assert line.startswith(f"actor: PPO epochs stopped early after {int(m['actor/num_updates'])} of "
                               f"{EPOCHS} x {MINI_BATCHES} optimizer steps: actor/ppo_kl=")
        assert float(line.split("actor/ppo_kl=")[1].split(" ")[0]) > 1e-4 and line.endswith("actor.target_kl=0.0001")


@pytest.mark.dist
def test_validation_samples_each_validation(run):
    with open(os.path.join(run["dir"], "val_generations.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for r in rows:
        assert set(r) == {"step", "prompt", "response", "score", "reference"}
        # (the tests' character-level tokenizer decodes without the spaces)
        assert "Answeras####N." in r["prompt"].replace(" ", "") and r["reference"].lstrip("-").isdigit()


@pytest.mark.dist
def test_trackers_get_the_resolved_config_and_the_metrics(run, monkeypatch):
    records = read_records(offline_run_dir(run["wandb"]))
    project, name, config = run_info(records)
    assert (project, name) == ("opview", "tiny")
    assert config["actor_rollout_ref"]["actor"]["target_kl"] == 1e-4
    assert config["trainer"]["default_local_dir"] == run["dir"]  # resolved, not "${...}"
    hist = history(records)
    for m in run["metrics"]:
        if m["step"] >= 1:
            assert hist[m["step"]]["actor/num_updates"] == m["actor/num_updates"]
    assert hist[2]["val/generations/nrows"] == 3

    from mlflow.tracking import MlflowClient

    # reading the run's file store back needs the same opt-in the trainer's sink sets in its own process
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri="file:" + os.path.join(run["dir"], "mlruns"))
    (mlrun,) = client.search_runs([client.get_experiment_by_name("opview").experiment_id])
    assert mlrun.info.run_name == "tiny"
    assert mlrun.data.params["actor_rollout_ref.actor.ppo_epochs"] == str(EPOCHS)
    assert mlrun.data.params["trainer.default_local_dir"] == run["dir"]
    vals = {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, "val/reward_mean")}
    assert vals == pytest.approx({m["step"]: m["val/reward_mean"] for m in run["metrics"]})


@pytest.mark.dist
def test_report_reads_the_run(run):
    proc = subprocess.run([*TRIPOD, "report", run["dir"]], cwd=REPO_ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"dashboard {os.path.join(run['dir'], 'report.png')}" in proc.stdout
    assert os.path.getsize(os.path.join(run["dir"], "report.png")) > 10_000
    assert "NOTE 3 logged steps, 0..2" in proc.stdout
