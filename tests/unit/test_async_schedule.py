"""engine/async_rollout/schedule.py against its definition (verl's admission rule, brute force) and the async keys'
up-front checks (engine/config_validation.py)."""
from __future__ import annotations

import math

import pytest

from tripod.engine.async_rollout.schedule import StalenessSchedule
from tripod.engine.async_rollout.weights import bucket_layout
from tripod.engine.config import ConfigError, load_config
from tripod.engine.config_validation import validate_config


@pytest.mark.parametrize("threshold", [0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("sync_every", [1, 2, 3, 4])
def test_schedule_is_the_oldest_admissible_version(threshold, sync_every):
    s = StalenessSchedule(threshold, sync_every, 40)
    batch_prompts = 8  # B = require_batches x ppo_mini_batch_size
    budget = math.floor((1 + threshold) * sync_every * batch_prompts + 1e-9)  # verl: prompts per sync period
    for i in range(40):
        w = s.version_for(i)
        admissible = [v for v in range(0, i + 1, sync_every) if (i + 1) * batch_prompts <= v * batch_prompts + budget]
        assert w == admissible[0], (i, w, admissible)  # the oldest version verl's rule admits
        assert w <= i  # the trainer can make it from earlier batches: no deadlock
        assert 0 <= s.age(i) <= s.max_age
    assert max(s.age(i) for i in range(40)) == s.max_age  # the bound is reached: it is the tight one
    pushed = [k for k in range(1, 41) if s.syncs(k)]
    assert {s.version_for(i) for i in range(40)} - {0} <= set(pushed)  # every needed version is pushed
    for step in range(40):  # a resume at `step` regenerates exactly the batches made with weights >= step
        first = s.first_to_generate(step)
        assert all(s.version_for(i) < step for i in range(step, first))
        assert first == 40 or s.version_for(first) >= step


def test_named_schedules():
    assert [StalenessSchedule(0, 1, 5).version_for(i) for i in range(5)] == [0, 1, 2, 3, 4]
    assert [StalenessSchedule(1, 1, 5).version_for(i) for i in range(5)] == [0, 0, 1, 2, 3]
    assert [StalenessSchedule(0, 2, 6).version_for(i) for i in range(6)] == [0, 0, 2, 2, 4, 4]
    assert StalenessSchedule(1, 1, 5).first_to_generate(2) == 3  # batch 2 was made with version 1: queued
    assert StalenessSchedule(0, 1, 5).first_to_generate(2) == 2


def test_bucket_layout_covers_every_tensor_once():
    import torch
    shapes = {"a": (4, 4), "b": (100,), "c": (3,), "d": (2, 2)}
    dtypes = {"a": torch.float32, "b": torch.float32, "c": torch.bfloat16, "d": torch.float32}
    layout = bucket_layout(shapes, dtypes, 128)
    assert sorted(n for b in layout for n in b) == sorted(shapes)
    assert all(len({dtypes[n] for n in b}) == 1 for b in layout)
    assert ["b"] in layout  # larger than a bucket: alone


def _cfg(tmp_path, *overrides):
    from tests.helpers.ppo_setup import make_ppo_setup
    setup = make_ppo_setup(tmp_path)
    return load_config(None, [f"data.train_files={setup['train']}", f"actor_rollout_ref.model.path={setup['model']}",
                              "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                              "trainer.val_before_train=false", *overrides])


@pytest.mark.parametrize("overrides,message", [
    (["rollout.nnodes=1", "rollout.n_gpus_per_node=3", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
      "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
     "3 rollout ranks do not split into TP groups"),
    (["rollout.nnodes=0", "rollout.n_gpus_per_node=1"], "rollout.nnodes=0 must be >= 1"),
    (["rollout.nnodes=1", "rollout.n_gpus_per_node=1", "async_training.require_batches=2"],
     "async_training.require_batches=1"),
    (["rollout.nnodes=1", "rollout.n_gpus_per_node=1", "async_training.partial_rollout=true",
      "actor_rollout_ref.rollout.name=vllm"], "async_training.partial_rollout=true with actor_rollout_ref.rollout.name"),
    (["rollout.nnodes=1", "rollout.n_gpus_per_node=1", "async_training.staleness_threshold=-1"],
     "staleness_threshold=-1"),
    (["rollout.nnodes=1", "rollout.n_gpus_per_node=1", "trainer.divergence_guard.enabled=true",
      "trainer.save_freq=1", "async_training.partial_rollout=true"],
     "async_training.partial_rollout=true with trainer.divergence_guard.enabled=true"),
])
def test_bad_async_input_is_one_line_before_any_model(tmp_path, overrides, message):
    cfg = _cfg(tmp_path, *overrides)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, cfg.trainer.n_gpus_per_node)
    assert message in str(e.value)


def test_colocated_and_own_ranks_pass(tmp_path):
    for extra in ([], ["rollout.nnodes=1", "rollout.n_gpus_per_node=2", "async_training.staleness_threshold=1"]):
        cfg = _cfg(tmp_path / str(len(extra)), *extra)
        validate_config(cfg, 1)
