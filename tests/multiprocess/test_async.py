"""The rollout on its own ranks (engine/async_rollout/): staleness 0 is the synchronous run bit for bit, staleness 1
trains step k on the weights after step k-2, a dead rollout rank stops the run in one line and the resume from its
last checkpoint (whose queue holds the batches made with older weights) is exact. Each equivalence is shown failing
on a planted bug (tests/multiprocess/workers/train_with_hooks.py)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.helpers.bounds import worst
from tests.helpers.common import run_torchrun
from tests.helpers.ppo_setup import make_ppo_setup
from tests.helpers.trainer_runs import final_actor_weights_of, metrics, train_in_world, train_together
from tripod.engine.checkpoints.manager import latest_complete

pytestmark = pytest.mark.timeout(1200)
OWN_RANKS = ["rollout.nnodes=1", "rollout.n_gpus_per_node=1"]
# wall-clock times, what only the async run logs, and the weight bytes only the colocated rollout hands its engine
VOLATILE = ("timing_s/", "perf/", "async/", "training/", "rollout/weight_sync_bytes")


def _overrides(setup: dict, run_dir: str, steps: int, *extra: str) -> list[str]:
    """GRPO with sampling (temperature 1, 2 samples a prompt), Adam: the arithmetic of a real run, one thread a rank."""
    return [f"data.train_files={setup['train']}", "data.max_prompt_length=64", "data.train_batch_size=4",
            "data.shuffle=false", f"actor_rollout_ref.model.path={setup['model']}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.response_length=8", "algorithm.adv_estimator=grpo",
            f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.threads_per_rank=1", "trainer.logger=[jsonl]", "trainer.resume=auto",
            f"trainer.default_local_dir={run_dir}", f"trainer.rollout_data_dir={run_dir}/rollouts", *extra]


def _steady(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _dumps(run_dir: str, steps) -> list[list[dict]]:
    out = []
    for k in steps:
        with open(os.path.join(run_dir, "rollouts", f"{k}.jsonl")) as f:
            out.append([json.loads(line) for line in f])
    return out


def _same_run(a: str, b: str, steps: int) -> bool:
    """Equal per-step metrics (NaN never equals), equal rollouts (tokens, log-probs, scores, versions) and
    bit-identical final actor weights."""
    wa, wb = final_actor_weights_of({a: steps, b: steps}).values()
    same_weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return _steady(metrics(a)) == _steady(metrics(b)) and _dumps(a, range(1, steps + 1)) == \
        _dumps(b, range(1, steps + 1)) and same_weights


def _dapo_setup(tmp_path) -> dict:
    """make_ppo_setup's, with every prompt scored by tests/helpers/dapo_reward.py (odd answers keep their group)."""
    from tests.helpers import dapo_reward
    from tripod.engine.data import make_arithmetic_rows, write_prompt_parquet

    setup = make_ppo_setup(tmp_path / "dapo", n_train=32)
    rows = make_arithmetic_rows(32, seed=0, max_digits=1, instruction="Answer as #### N.")
    for row in rows:
        row["data_source"] = dapo_reward.DATA_SOURCE
    setup["train"] = str(tmp_path / "dapo" / "train_odd.parquet")
    write_prompt_parquet(rows, setup["train"])
    return setup


DAPO = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=8", "reward_model.num_workers=1"]


def test_staleness_zero_is_the_synchronous_run(tmp_path):
    """Also with dynamic sampling (the rollout ranks draw the extra generation batches from their own loader)."""
    setup, dapo = make_ppo_setup(tmp_path, max_digits=2), _dapo_setup(tmp_path)
    runs = {name: _overrides(s, str(tmp_path / name), 3, *extra) for name, s, extra in
            (("colocated", setup, []), ("own_ranks", setup, OWN_RANKS), ("planted", setup, OWN_RANKS),
             ("colocated_dapo", dapo, DAPO), ("own_ranks_dapo", dapo, [*OWN_RANKS, *DAPO]))}
    train_together(runs, str(tmp_path), run_envs={"planted": {"TRIPOD_TEST_PLANT": "async_version_off_by_one"}})
    own = metrics(str(tmp_path / "own_ranks"))
    assert {r["async/staleness_max"] for r in own} == {0.0}
    # the bytes each rollout rank received: its generation shard, as the reshard plan counts it
    from tripod.engine.config import load_config
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.hybrid_engine import reshard_plan_from_config
    cfg = load_config("recipes/defaults.yaml", runs["own_ranks"])
    plan = reshard_plan_from_config(cfg, 1, arch_from_hf(setup["model"]))
    assert {r["async/weight_bytes_per_replica"] for r in own if "async/weight_bytes_per_replica" in r} == \
        {float(plan.generation_shard_bytes())}
    assert _same_run(str(tmp_path / "colocated"), str(tmp_path / "own_ranks"), 3)
    assert not _same_run(str(tmp_path / "colocated"), str(tmp_path / "planted"), 3)
    dapo_rows = metrics(str(tmp_path / "own_ranks_dapo"))
    assert sum(r["train/num_gen_batches"] for r in dapo_rows) > 3  # groups were dropped and batches drawn again
    assert _same_run(str(tmp_path / "colocated_dapo"), str(tmp_path / "own_ranks_dapo"), 3)


def test_one_step_behind_is_generated_by_the_weights_before_the_last_step(tmp_path):
    setup = make_ppo_setup(tmp_path, max_digits=2)
    async1 = OWN_RANKS + ["async_training.staleness_threshold=1", "trainer.save_freq=1"]
    runs = {name: _overrides(setup, str(tmp_path / name), 3, *async1) for name in ("one_behind", "planted")}
    train_together(runs, str(tmp_path), run_envs={"planted": {"TRIPOD_TEST_PLANT": "rollout_weights_stale"}})
    assert [r["async/staleness_max"] for r in metrics(str(tmp_path / "one_behind"))] == [0.0, 1.0, 1.0]
    for name in ("one_behind", "planted"):  # the versions the runs recorded, regenerated from their checkpoints
        run_dir = str(tmp_path / name)
        out = run_torchrun("async_reference.py", 1, json.dumps(
            {"overrides": runs[name], "run_dir": run_dir, "dump_dir": run_dir + "/rollouts", "steps": [2, 3]}),
            timeout=600).stdout
        equal = [f"ASYNC_REFERENCE {k} equal=True" in out for k in (2, 3)]
        # the plant leaves the initial weights in the engine: batch 3, labelled version 1, is version 0's
        assert equal == ([True, True] if name == "one_behind" else [True, False]), (name, out[-3000:])
    assert [rows[0]["weight_versions"] for rows in _dumps(str(tmp_path / "one_behind"), (1, 2, 3))] == \
        [[[0, 0]], [[0, 0]], [[0, 1]]]


def test_dead_rollout_rank_stops_in_one_line_and_resumes_exactly(tmp_path):
    setup = make_ppo_setup(tmp_path, max_digits=2)
    async1 = OWN_RANKS + ["async_training.staleness_threshold=1", "trainer.save_freq=1"]
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    train_together({"whole": _overrides(setup, whole, 4, *async1)}, str(tmp_path))
    out = train_in_world(_overrides(setup, killed, 4, *async1), 2, tmp_path / "killed.log",
                         env={"TRIPOD_TEST_PLANT": "rollout_rank_dies"})
    # the launcher stops the world when a rank dies (torchrun does; tripod's own spawn says "worker 1 died") and
    # names it in one line; the trainer never sees a half-written batch (a message is whole or not received)
    assert out.returncode != 0 and "rank 1 (pid" in out.stdout and "exited with 17" in out.stdout, out.stdout[-3000:]
    ckpts = os.path.join(killed, "checkpoints")
    last = latest_complete(ckpts)
    resumed_at = int(last.rsplit("_", 1)[1]) if last else 0
    assert resumed_at < 4
    shutil.rmtree(os.path.join(killed, "rollouts"), ignore_errors=True)
    train_together({"resumed": _overrides(setup, killed, 4, *async1)}, str(tmp_path))
    later = range(resumed_at + 1, 5)
    last_rows = {r["step"]: r for r in _steady(metrics(killed))}  # a step logged twice: the resumed run's
    assert [last_rows[k] for k in later] == [r for r in _steady(metrics(whole)) if r["step"] > resumed_at]
    assert _dumps(killed, later) == _dumps(whole, later)
    wa, wb = final_actor_weights_of({whole: 4, killed: 4}).values()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_partial_rollout_records_the_version_of_every_token(tmp_path):
    """Weights land while batches are generated (a 0.25 s decode step: not a bug, the timing that makes it happen);
    every token's recorded version is the one that generated it: each segment of each row is regenerated greedily
    from its checkpoint, prompt + the tokens before it. The dead-weights plant breaks that."""
    setup = make_ppo_setup(tmp_path, max_digits=2)
    partial = OWN_RANKS + ["async_training.staleness_threshold=1", "async_training.partial_rollout=true",
                           "trainer.save_freq=1", "actor_rollout_ref.rollout.do_sample=false",
                           "actor_rollout_ref.rollout.response_length=12"]
    runs = {name: _overrides(setup, str(tmp_path / name), 4, *partial) for name in ("partial", "planted")}
    train_together(runs, str(tmp_path), run_envs={"partial": {"TRIPOD_TEST_PLANT": "slow_decode"},
                                                  "planted": {"TRIPOD_TEST_PLANT": "rollout_weights_stale"}})
    rows = metrics(str(tmp_path / "partial"))
    assert sum(r["async/partial_switches"] for r in rows) > 0, "no weight version landed mid-batch: nothing checked"
    assert worst(r["async/staleness_max"] for r in rows) <= 1.0  # fresher mid-batch, never older than the bound
    for name in ("partial", "planted"):
        run_dir = str(tmp_path / name)
        out = run_torchrun("async_reference.py", 1, json.dumps(
            {"overrides": runs[name], "run_dir": run_dir, "dump_dir": run_dir + "/rollouts", "steps": [2, 3, 4]}),
            timeout=600).stdout
        equal = [f"ASYNC_REFERENCE {k} equal=True" in out for k in (2, 3, 4)]
        assert all(equal) == (name == "partial"), (name, out[-3000:])
