"""Divergence guard: the trip rules on metric sequences, and a run whose reward turns NaN for one step rolls back
to the last GOOD checkpoint, applies the remedies, recovers and finishes (or gives up after max_rollbacks)."""
import json
import math
import os

import pytest
import torch

from tests.helpers.common import launch_world
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tripod.engine.divergence_guard import GOOD, find_reasons

RULES = dict(max_kl=0.5, spike=10.0, min_history=3, best_val=None, val_ratio=0.5)


def test_trip_rules():
    hist = {"actor/grad_norm": [1.0, 1.2, 0.9]}
    assert find_reasons({"actor/pg_loss": 0.1, "actor/grad_norm": 1.1}, history=hist, **RULES) == []
    assert "non-finite actor/pg_loss" in find_reasons({"actor/pg_loss": float("nan")}, history={}, **RULES)[0]
    assert "non-finite critic/grad_norm" in find_reasons({"critic/grad_norm": float("inf")}, history={}, **RULES)[0]
    assert "max_kl" in find_reasons({"actor/ppo_kl": 0.6}, history={}, **RULES)[0]
    assert "running median" in find_reasons({"actor/grad_norm": 10.5}, history=hist, **RULES)[0]
    # the spike check arms only after min_history accepted steps
    assert find_reasons({"actor/grad_norm": 50.0}, history={"actor/grad_norm": [1.0, 1.0]}, **RULES) == []
    rules = dict(RULES, best_val=0.6)
    assert "val/reward_mean" in find_reasons({"val/reward_mean": 0.2}, history={}, **rules)[0]
    assert find_reasons({"val/reward_mean": 0.4}, history={}, **rules) == []
    assert find_reasons({"timing_s/step": float("nan")}, history={}, **RULES) == []  # not a training signal


def _poisoned_setup(tmp_path):
    from tripod.engine.data import make_arithmetic_rows, write_prompt_parquet

    setup = make_ppo_setup(tmp_path)
    rows = make_arithmetic_rows(16, seed=0, max_digits=1, instruction="Answer as #### N.")
    for row in rows:
        row["data_source"] = "poisoned_arithmetic"
    setup["train"] = str(tmp_path / "poisoned.parquet")
    write_prompt_parquet(rows, setup["train"])
    return setup


def _start(setup, run_dir, extra, poison_step, log, per_step=8, world=1):
    args = tiny_overrides(setup, run_dir, steps=3) + [
        "data.val_files=[]", "trainer.val_before_train=false", "trainer.save_freq=1",
        "trainer.divergence_guard.enabled=true", *extra]
    env = dict(POISON_FROM=str(per_step * (poison_step - 1)), POISON_TO=str(per_step * poison_step))
    return launch_world("guard_poisoned_reward.py", world, *args, log=log, env=env)


# What step 2's rollout produced, before any update: the prompts (data position), the sampled responses (RNG) and
# the restored critic's values on them. The guard's remedies (lr, clip ratio, kl_coef) act only after these.
ROLLOUT = ("prompt_length/mean", "response_length/mean", "critic/score/mean", "critic/values/mean")


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two one-rank runs side by side (one thread each, so each one's arithmetic is what it would be alone):
    "recovered", whose step-2 rewards are NaN, and "gave_up", with max_rollbacks=0 and the poison in step 3: its
    steps 1 and 2 run clean (the reference for the replayed step 2, same seed and config), step 3 trips and the run
    stops. Returns {name: (returncode, stdout, run_dir)}."""
    plan = {"recovered": ([], 2), "gave_up": (["trainer.divergence_guard.max_rollbacks=0"], 3)}
    procs = {}
    for name, (extra, poison_step) in plan.items():
        tmp = tmp_path_factory.mktemp(name)
        procs[name] = (_start(_poisoned_setup(tmp), str(tmp / "run"), extra, poison_step, tmp / "out.log"), tmp)
    out = {}
    for name, (proc, tmp) in procs.items():
        proc.wait(timeout=900)
        out[name] = (proc.returncode, (tmp / "out.log").read_text(), str(tmp / "run"))
    return out


@pytest.mark.dist
def test_nan_reward_rolls_back_recovers_and_finishes(tmp_path, runs):
    """Rewards of step 2 are NaN (4 prompts x n=2 = 8 scorer calls per step): step 2 trips, the run reloads
    global_step_1, halves the lr, clips at 0.1, raises kl_coef by 0.002, replays step 2 cleanly and finishes.
    The replay restarts from step 1's data position and RNG: its rollout is bit for bit the clean run's step 2
    (same process layout and thread count, so the same arithmetic in the same order)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    returncode, stdout, run_dir = runs["recovered"]
    assert returncode == 0, stdout[-5000:]
    lines = [l for l in stdout.splitlines() if l.startswith("guard:")]
    assert len(lines) == 1 and "step 2 tripped (non-finite" in lines[0] and "rolled back to global_step_1" in lines[0]
    assert "clip_ratio 0.2->0.1" in lines[0] and "kl_coef 0.001->0.003" in lines[0]
    assert "actor lr 0.001->0.0005" in lines[0], lines[0]
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    clean = {m["step"]: m for m in _metrics(runs["gave_up"][2])}
    assert sorted(clean) == [1, 2], sorted(clean)
    replayed = {k: metrics[1][k] for k in ROLLOUT}
    assert replayed == {k: clean[2][k] for k in ROLLOUT}, ("the replayed step 2 did not start from step 1's data "
                                                           "position and RNG", replayed, clean[2])
    assert {k: metrics[0][k] for k in ROLLOUT} == {k: clean[1][k] for k in ROLLOUT}  # the runs agree before the trip
    assert [m["guard/rollbacks"] for m in metrics] == [0.0, 1.0, 1.0]
    assert [m["guard/tripped"] for m in metrics] == [0.0, 1.0, 0.0]
    assert metrics[2]["guard/lr_scale"] == 0.5 and metrics[2]["guard/clip_ratio"] == 0.1
    for m in metrics:
        assert all(math.isfinite(m[k]) for k in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm"))
    ckpts = os.path.join(run_dir, "checkpoints")
    for step in (1, 2, 3):
        assert os.path.exists(os.path.join(ckpts, f"global_step_{step}", GOOD)), step
    dcp_to_torch_save(os.path.join(ckpts, "global_step_3", "actor", "model"), str(tmp_path / "final.pt"))
    weights = {k: v for k, v in torch.load(str(tmp_path / "final.pt"), weights_only=False).items()
               if isinstance(v, torch.Tensor)}
    assert weights and all(torch.isfinite(v).all() for v in weights.values())


@pytest.mark.dist
def test_guard_gives_up_after_max_rollbacks(runs):
    returncode, stdout, run_dir = runs["gave_up"]
    assert returncode != 0
    err = [l for l in stdout.splitlines() if l.startswith("tripod train: error:")]
    assert len(err) == 1 and "step 3 diverged (non-finite" in err[0] and "max_rollbacks" in err[0], stdout[-3000:]
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "global_step_2", GOOD))
    assert not os.path.exists(os.path.join(run_dir, "checkpoints", "global_step_3"))


@pytest.mark.dist
def test_rollback_with_the_rollout_on_its_own_rank(tmp_path):
    """The same poisoned step 2 with the rollout on a rank of its own (staleness 0, docs/async.md): the trainer rolls
    back to global_step_1, the rollout rank drops the batch it made from the diverged weights and starts again from
    step 1's data position and weights; the replayed step 2 is the rollout's batch 1 again, made with version 1."""
    setup = _poisoned_setup(tmp_path)
    run_dir = str(tmp_path / "run")
    extra = ["rollout.n_gpus_per_node=1", "async_training.require_batches=2",
             f"trainer.rollout_data_dir={run_dir}/rollouts"]
    proc = _start(setup, run_dir, extra, 2, tmp_path / "out.log", world=2)
    proc.wait(timeout=900)
    stdout = (tmp_path / "out.log").read_text()
    assert proc.returncode == 0, stdout[-5000:]
    lines = [line for line in stdout.splitlines() if line.startswith("guard:")]
    assert len(lines) == 1 and "step 2 tripped (non-finite" in lines[0] and "rolled back to global_step_1" in lines[0]
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3] and [m["guard/rollbacks"] for m in metrics] == [0.0, 1.0, 1.0]
    assert [m["async/staleness_max"] for m in metrics] == [0.0, 0.0, 0.0]
    for m in metrics:
        assert all(math.isfinite(m[k]) for k in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm"))
    with open(os.path.join(run_dir, "rollouts", "2.jsonl")) as f:
        replayed = [json.loads(line) for line in f]
    assert {row["weight_versions"][0][1] for row in replayed} == {1}
    assert all(math.isfinite(row["score"]) for row in replayed)  # the poisoned batch was dropped, not trained
