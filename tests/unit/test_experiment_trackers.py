"""trainer.logger wandb and mlflow, for real: an offline wandb run (WANDB_MODE=offline) and an MLflow local file store,
each read back (history, run config, sample tables); validation samples in val_generations.jsonl and TensorBoard's
text tab; a missing package is one config line naming the extra."""
import json
import os
import random

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.wandb_offline import history, offline_run_dir, read_records, run_info
from tripod.engine.config import TrainerConfig
from tripod.engine.logging import Tracker

CONFIG = {"actor_rollout_ref": {"actor": {"optim": {"lr": 3.0e-5}, "ppo_epochs": 2}},
          "trainer": {"project_name": "proj", "experiment_name": "exp", "logger": ["jsonl", "wandb"]}}


def _steps(seed: int) -> dict[int, dict[str, float]]:
    rng = random.Random(seed)
    return {step: {"actor/pg_loss": rng.uniform(-1, 1), "critic/score/mean": rng.random(),
                   "timing_s/gen": rng.uniform(0.1, 3)} for step in (1, 2, 3)}


def _samples(seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": f"What is {a} + {b}?", "response": f"{a} + {b} = {a + b + rng.randint(0, 1)} | ok",
             "score": float(rng.randint(0, 1)), "reference": str(a + b)}
            for a, b in ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(3))]


def test_wandb_offline_run_holds_metrics_config_and_samples(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="pip install 'tripod[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    os.makedirs(tmp_path / "wandb_home")
    logged, samples = _steps(0), _samples(1)
    with Tracker(tmp_path / "run", ["jsonl", "wandb"], project_name="proj", experiment_name="exp",
                 config=CONFIG) as tracker:
        for step, metrics in logged.items():
            tracker.log({**metrics, "note": "strings stay in the jsonl"}, step)
        tracker.log_samples(samples, 3)

    run = offline_run_dir(str(tmp_path / "wandb_home"))
    records = read_records(run)
    project, name, config = run_info(records)
    assert (project, name) == ("proj", "exp")
    assert config["actor_rollout_ref"] == CONFIG["actor_rollout_ref"] and config["trainer"] == CONFIG["trainer"]
    hist = history(records)
    for step, metrics in logged.items():
        for key, value in metrics.items():
            assert hist[step][key] == pytest.approx(value, rel=1e-12), (step, key)
        assert "note" not in hist[step]
    table_file = os.path.join(run, "files", hist[3]["val/generations/path"])
    with open(table_file) as f:
        table = json.load(f)
    assert table["columns"] == ["prompt", "response", "score", "reference"]
    assert table["data"] == [[s["prompt"], s["response"], s["score"], s["reference"]] for s in samples]


def test_mlflow_file_store_holds_metrics_config_and_samples(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="pip install 'tripod[mlflow]'")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run_dir = tmp_path / "run"
    logged, samples = _steps(2), _samples(3)
    with Tracker(run_dir, ["mlflow"], project_name="proj", experiment_name="exp", config=CONFIG) as tracker:
        for step, metrics in logged.items():
            tracker.log(metrics, step)
        tracker.log_samples(samples, 2)

    client = MlflowClient(tracking_uri="file:" + str(run_dir / "mlruns"))
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    assert run.data.params["actor_rollout_ref.actor.optim.lr"] == "3e-05"
    assert run.data.params["trainer.logger"] == "['jsonl', 'wandb']"
    for key in logged[1]:
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert got == pytest.approx({s: m[key] for s, m in logged.items()}, rel=1e-12), key
    artifacts = run_dir / "mlruns" / run.info.experiment_id / run.info.run_id / "artifacts"
    with open(artifacts / "config.json") as f:
        assert json.load(f) == CONFIG
    with open(artifacts / "val" / "generations" / "step_2.json") as f:
        table = json.load(f)
    assert table == {"columns": ["prompt", "response", "score", "reference"],
                     "data": [[s["prompt"], s["response"], s["score"], s["reference"]] for s in samples]}


def test_samples_go_to_jsonl_and_tensorboard_text(tmp_path):
    samples = _samples(4)
    no_reference = [{k: v for k, v in s.items() if k != "reference"} for s in _samples(5)]
    with Tracker(tmp_path, ["jsonl", "tensorboard"]) as tracker:
        tracker.log_samples(samples, 0)
        tracker.log_samples(no_reference, 2)
        tracker.log_samples([], 3)  # a step without validation writes nothing
    with open(tmp_path / "val_generations.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert rows == [{"step": 0, **s} for s in samples] + [{"step": 2, **s} for s in no_reference]
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors("val/generations/text_summary")
    assert [e.step for e in events] == [0, 2]
    first = events[0].tensor_proto.string_val[0].decode()
    assert first.splitlines()[0] == "| prompt | response | score | reference |"
    assert samples[0]["response"].replace("|", "\\|") in first  # a '|' in a response does not break the table
    assert "reference" not in events[1].tensor_proto.string_val[0].decode()

    # a resumed run keeps the samples up to its resume step
    with Tracker(tmp_path, ["jsonl"], resume_step=1):
        pass
    with open(tmp_path / "val_generations.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [0, 0, 0]


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_missing_package_is_one_config_line(monkeypatch, backend):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == backend else real(name, *a))
    problems = TrainerConfig(logger=["console", backend]).check()
    assert problems == [f"trainer.logger includes {backend!r} but the {backend} package is not installed; "
                        f"pip install 'tripod[{backend}]' (or drop {backend!r} from trainer.logger)"]
