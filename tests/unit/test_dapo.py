"""DAPO's reward-side tools against closed forms: the overlong penalty (engine/rewards/overlong.py), the group filter
and the refilling loop of dynamic sampling (engine/algorithms/dynamic_sampling.py) with the data loader's position,
the bad-input lines of their keys, and every recipe loading and validating (the DAPO recipe among them)."""
import os

import pytest

from tripod.engine.algorithms.dynamic_sampling import DynamicSampler, kept_groups
from tripod.engine.config import ConfigError, load_config
from tripod.engine.config_validation import validate_config
from tripod.engine.data.dataset import PromptBatch, PromptDataLoader
from tripod.engine.launch import TrainingStopped
from tripod.engine.logging import Timer
from tripod.engine.rewards.overlong import OverlongShaper, overlong_penalty

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


# ---- overlong reward shaping ----------------------------------------------------------------------------------
@pytest.mark.parametrize("length, expected", [
    (0, 0.0), (16384, 0.0),                       # up to L_max - L_cache = 16384: no penalty
    (16385, -1 / 4096), (18432, -0.5), (20480, -1.0),  # then linear to -penalty_factor at L_max
])
def test_overlong_penalty_is_dapos_soft_punishment(length, expected):
    """DAPO's published setting: L_max = 20480, L_cache = 4096, factor 1 (exact in binary: powers of two)."""
    assert overlong_penalty(length, 20480, 4096, 1.0) == expected
    assert overlong_penalty(length, 20480, 4096, 0.5) == expected * 0.5


def test_overlong_penalty_refuses_a_buffer_outside_the_response():
    for bad in (0, 9):
        with pytest.raises(ValueError, match="reward_model.overlong_buffer.len"):
            overlong_penalty(4, 8, bad, 1.0)


def test_overlong_shaper_penalties_and_metrics():
    on = OverlongShaper(_Cfg(enable=True, len=4, penalty_factor=2.0), max_response_length=8)
    penalties = on.penalties([3, 4, 5, 6, 8])
    assert penalties == [0.0, 0.0, -0.5, -1.0, -2.0]  # -(len - 4) / 4 * 2
    assert on.metrics(penalties) == {"reward/overlong_penalty_mean": -3.5 / 5, "reward/overlong_frac": 3 / 5}
    off = OverlongShaper(_Cfg(enable=False, len=0, penalty_factor=1.0), max_response_length=8)
    assert off.penalties([3, 8]) == [0.0, 0.0] and off.metrics([0.0, 0.0]) == {}


# ---- the group filter ----------------------------------------------------------------------------------------
def test_kept_groups_are_those_with_nonzero_std():
    values = [1, 1, 0, 1, 0, 0, 0.5, 0.5, float("nan"), 1, -1, 1]
    assert kept_groups(values, 2) == [1, 5]  # all-equal groups and the NaN group are dropped
    assert kept_groups(values, 3) == [0, 1, 3]  # (0.5, 0.5, nan) is dropped for its NaN
    assert kept_groups([0.25] * 6, 3) == []
    with pytest.raises(ValueError, match="12 values do not split into groups of n=5"):
        kept_groups(values, 5)


# ---- the refilling loop ----------------------------------------------------------------------------------------
N = 2


class _Prompts:
    """A dataset of 12 prompts; prompt i's group scores are uniform 1 (i % 3 == 0), uniform 0 (i % 3 == 1) or mixed
    (i % 3 == 2: one response right, one wrong); response j of prompt i has 3 + i % 2 + j tokens."""
    files = ["fake"]

    def __len__(self):
        return 12

    def batch(self, indices):
        return PromptBatch(input_ids=[[i] for i in indices], ground_truths=[str(i) for i in indices],
                           data_sources=["fake"] * len(indices), indices=list(indices),
                           extra_infos=[{"i": i} for i in indices])


def _generate(calls):
    def generate(prompts, gen_batch):
        calls.append((gen_batch, list(prompts.indices)))
        return [[7] * (3 + i % 2 + j) for i in prompts.indices for j in range(N)]
    return generate


def _score(prompts, responses):
    table = {0: [1.0, 1.0], 1: [0.0, 0.0], 2: [1.0, 0.0]}
    return [s for i in prompts.indices for s in table[i % 3]], {"reward/num_errors": 1.0}


def _sampler(loader, enable=True, metric="acc", max_gen=0, train_batch=3, shaping=False):
    cfg = _Cfg(enable=enable, metric=metric, max_num_gen_batches=max_gen)
    shaper = OverlongShaper(_Cfg(enable=shaping, len=4, penalty_factor=1.0), max_response_length=4)
    return DynamicSampler(cfg, train_batch, N, draw=lambda: next(iter(loader)), shaper=shaper)


def test_dynamic_sampling_refills_to_the_train_batch_and_trims():
    """gen batch 4, train batch 3, prompts in order: batch 1 (0-3) keeps prompt 2, batch 2 (4-7) keeps 5, batch 3
    (8-11) keeps 8 and 11 -> 4 kept, the first 3 (2, 5, 8) train, 11 is the surplus. The loader handed out all 3
    batches of epoch 0: its saved position is the start of epoch 1, what a resume continues from."""
    loader, calls = PromptDataLoader(_Prompts(), 4, shuffle=False), []
    out, metrics = _sampler(loader).collect(next(iter(loader)), _generate(calls), _score, Timer())
    assert calls == [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7]), (2, [8, 9, 10, 11])]  # one seed per generation batch
    assert out.prompts.indices == [2, 5, 8] and out.prompts.ground_truths == ["2", "5", "8"]
    assert out.prompts.extra_infos == [{"i": 2}, {"i": 5}, {"i": 8}] and out.prompts.input_ids == [[2], [5], [8]]
    assert out.scores == out.rewards == [1.0, 0.0] * 3 and out.penalties == [0.0] * 6
    assert [len(r) for r in out.responses] == [3, 4, 4, 5, 3, 4]  # each kept prompt's own responses
    assert metrics == {"reward/num_errors": 3.0,  # summed over the 3 scored batches
                       "train/num_gen_batches": 3.0, "dynamic_sampling/extra_gen_batches": 2.0,
                       "dynamic_sampling/groups_generated": 12.0, "dynamic_sampling/groups_dropped": 8.0,
                       "dynamic_sampling/groups_kept": 4.0, "dynamic_sampling/groups_surplus": 1.0,
                       "dynamic_sampling/kept_frac": 4 / 12}
    assert (loader.state_dict()["epoch"], loader.state_dict()["offset"]) == (1, 0)


def test_dynamic_sampling_off_is_one_plain_batch():
    loader, calls = PromptDataLoader(_Prompts(), 3, shuffle=False), []
    out, metrics = _sampler(loader, enable=False).collect(next(iter(loader)), _generate(calls), _score, Timer())
    assert calls == [(0, [0, 1, 2])] and out.prompts.indices == [0, 1, 2]
    assert out.scores == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0] and metrics == {"reward/num_errors": 1.0}
    assert loader.state_dict()["offset"] == 1


def test_seq_reward_metric_sees_the_overlong_penalty():
    """With shaping (L_max 4, buffer 4: penalty -len/4) the uniform-score groups differ by length (3 + j tokens) and
    are kept under seq_reward; acc still drops them."""
    loader = PromptDataLoader(_Prompts(), 3, shuffle=False)
    out, metrics = _sampler(loader, metric="seq_reward", shaping=True).collect(next(iter(loader)), _generate([]),
                                                                              _score, Timer())
    assert out.prompts.indices == [0, 1, 2] and metrics["train/num_gen_batches"] == 1.0
    assert out.penalties == [-0.75, -1.0, -1.0, -1.25, -0.75, -1.0]
    assert out.rewards == [0.25, 0.0, -1.0, -1.25, 0.25, -1.0]  # score + penalty
    assert metrics["reward/overlong_penalty_mean"] == -5.75 / 6 and metrics["reward/overlong_frac"] == 1.0
    loader = PromptDataLoader(_Prompts(), 3, shuffle=False)
    out, _ = _sampler(loader, metric="acc", shaping=True).collect(next(iter(loader)), _generate([]), _score, Timer())
    assert out.prompts.indices == [2, 5, 8]


def test_dynamic_sampling_stops_after_max_num_gen_batches():
    loader = PromptDataLoader(_Prompts(), 4, shuffle=False)
    with pytest.raises(TrainingStopped) as err:
        _sampler(loader, max_gen=2).collect(next(iter(loader)), _generate([]), _score, Timer())
    message = str(err.value)
    assert "kept 2 of the data.train_batch_size=3 groups after 2 generation batches" in message
    assert "algorithm.filter_groups.max_num_gen_batches=2" in message and "\n" not in message


def test_dynamic_sampling_rolls_into_the_next_epoch():
    """Train batch 5 needs 4 mixed prompts + 1: the loader rolls over into epoch 1 (prompt 2 again)."""
    loader = PromptDataLoader(_Prompts(), 4, shuffle=False)
    out, metrics = _sampler(loader, train_batch=5).collect(next(iter(loader)), _generate([]), _score, Timer())
    assert out.prompts.indices == [2, 5, 8, 11, 2] and metrics["train/num_gen_batches"] == 4.0
    assert (loader.state_dict()["epoch"], loader.state_dict()["offset"]) == (1, 1)


# ---- bad input -------------------------------------------------------------------------------------------------
@pytest.fixture()
def dapo_run(run_files):
    """A valid GRPO run of 2 ranks around the files of conftest's `run_files`."""
    return run_files + ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.n_gpus_per_node=2",
                        "algorithm.adv_estimator=grpo", "trainer.total_training_steps=5"]


DAPO_ON = ["actor_rollout_ref.rollout.n=2", "algorithm.filter_groups.enable=true", "data.gen_batch_size=24",
           "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=128"]


def test_a_dapo_config_passes(dapo_run):
    validate_config(load_config(None, dapo_run + DAPO_ON), world_size=2)


@pytest.mark.parametrize("overrides, expected", [
    (["actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=gae"],
     "algorithm.filter_groups.enable=true drops groups whose responses all score alike, and "
     "actor_rollout_ref.rollout.n=1 makes every group one response; set actor_rollout_ref.rollout.n >= 2"),
    (["trainer.total_training_steps=null"], "set trainer.total_training_steps"),
    (["algorithm.filter_groups.metric=pass_rate"], "algorithm.filter_groups.metric='pass_rate' is not one of "
                                                   "['acc', 'score', 'seq_reward', 'seq_final_reward']"),
    (["algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"],
     "algorithm.filter_groups.metric=seq_final_reward: tripod applies the KL-in-reward penalty after filtering"),
    (["algorithm.filter_groups.enable=false"], "data.gen_batch_size=24 differs from data.train_batch_size=8"),
    (["data.gen_batch_size=0"], "data.gen_batch_size=0 must be a positive integer"),
    (["reward_model.overlong_buffer.len=0"], "reward_model.overlong_buffer.len=0 must be in (0, "
                                              "actor_rollout_ref.rollout.response_length=512]"),
    (["reward_model.overlong_buffer.len=513"], "reward_model.overlong_buffer.len=513 must be in"),
    (["reward_model.overlong_buffer.penalty_factor=-1"], "reward_model.overlong_buffer.penalty_factor=-1.0 must be"),
])
def test_each_dapo_problem_is_one_line_naming_its_key(dapo_run, overrides, expected):
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(None, dapo_run + DAPO_ON + overrides), world_size=2)
    assert expected in str(err.value), str(err.value)


def test_verls_overlong_log_key_points_at_the_metrics():
    with pytest.raises(ConfigError, match="tripod always logs the overlong penalty"):
        load_config(None, ["reward_model.overlong_buffer.log=true"])


# ---- the recipe ----------------------------------------------------------------------------------------------
def test_the_dapo_recipe_has_dapos_settings():
    cfg = load_config(os.path.join(REPO, "recipes", "qwen2.5", "7b-dapo-math.yaml"), [])
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert not (actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not cfg.uses_reference
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.metric == "acc"
    ob = cfg.reward_model.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor, rollout.response_length) == (True, 4096, 1.0, 20480)
    assert (rollout.n, actor.optim.lr, cfg.data.train_batch_size, cfg.data.gen_batch_size) == (16, 1e-6, 512, 1536)
