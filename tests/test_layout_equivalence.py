"""Cross-layout equivalence of whole PPO runs: every parallel layout trains like (TP, PP, DP) = (1, 1, 1).

Each case of CASES is a 3-step greedy PPO run compared with the same run at (1,1,1): rollouts identical, losses and
grad norms within the fp32 reduction-order bound, and the SGD weight updates within the bound derived in
tests/trainer_runs.py. A new layout joins by appending one `Case(name, tp, pp, world, extra_overrides)`.
The planted-bug tests run the same check on a run with one bug injected (tests/dist/train_with_hooks.py) and
require it to fail: proof that the check can catch a wrong split rule or a lost gradient.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
from safetensors.torch import load_file

from ppo_setup import make_ppo_setup, tiny_overrides
from trainer_runs import (GREEDY, LINEAR_OPTIM, OutOfBounds, assert_same_training, env, final_actor_weights, metrics,
                          train)

STEPS = 3
OPT_STEPS = STEPS * 2  # 2 mini-batches of 2 prompts per step (GREEDY: train_batch_size 4, rollout.n 1)
CRITIC_FREE = ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
               "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
               "actor_rollout_ref.actor.kl_loss_type=low_var_kl"]
ESTIMATORS = {"gae": [], "grpo_kl_loss": CRITIC_FREE}


@dataclass(frozen=True)
class Case:
    name: str
    tp: int
    pp: int
    world: int
    extra: list[str] = field(default_factory=list)
    estimator: str = "gae"  # which (1,1,1) baseline it is compared with (ESTIMATORS)


def _critic_layout(tp: int, pp: int) -> list[str]:
    return [f"critic.megatron.tensor_model_parallel_size={tp}", f"critic.megatron.pipeline_model_parallel_size={pp}"]


CASES = [
    Case("tp2pp2", 2, 2, 4),
    Case("tp1pp2dp2", 1, 2, 4),
    Case("token_budget", 1, 1, 1, ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=70"]),
    Case("actor_tp2dp2_critic_pp2dp2", 2, 1, 4, _critic_layout(1, 2)),
    Case("grpo_kl_loss_tp2pp2", 2, 2, 4, estimator="grpo_kl_loss"),
]
PLANTED = {"lm_head_tp_split": Case("planted", 2, 1, 2), "pp_stage_grads": Case("planted", 1, 2, 2)}


def _args(setup: dict, run_dir: str, case: Case) -> list[str]:
    args = tiny_overrides(setup, run_dir, world=case.world, tp=case.tp, pp=case.pp, steps=STEPS) + GREEDY
    return args + LINEAR_OPTIM + ESTIMATORS[case.estimator] + case.extra


def _run(setup: dict, run_dir: str, case: Case, plant: str | None = None) -> str:
    proc = train(_args(setup, run_dir, case), hooks=True, run_env=env(**({"TRIPOD_TEST_PLANT": plant} if plant else {})))
    assert proc.returncode == 0, proc.stdout[-5000:]
    return run_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    import pyarrow.parquet as pq

    tmp = tmp_path_factory.mktemp("equivalence")
    paths = make_ppo_setup(tmp)
    # the same prompts, scored by a reward the random model earns in varying amounts (critic-free estimators)
    table = pq.read_table(paths["train"])
    paths["char_mix"] = str(tmp / "train_char_mix.parquet")
    pq.write_table(table.set_column(table.schema.get_field_index("data_source"), "data_source",
                                    [["test/char_mix"] * table.num_rows]), paths["char_mix"])
    paths["root"] = str(tmp)
    return paths


_baselines: dict[str, tuple[list[dict], dict]] = {}


def baseline(setup: dict, estimator: str) -> tuple[list[dict], dict]:
    """The (1,1,1) run of an estimator (run once per module): its metrics and final actor weights."""
    if estimator not in _baselines:
        run_dir = _run(_data(setup, estimator), os.path.join(setup["root"], f"base_{estimator}"),
                       Case("base", 1, 1, 1, estimator=estimator))
        base = metrics(run_dir)
        assert [m["step"] for m in base] == list(range(STEPS + 1))
        _baselines[estimator] = (base, final_actor_weights(run_dir, STEPS))
    return _baselines[estimator]


def _data(setup: dict, estimator: str) -> dict:
    return dict(setup, train=setup["char_mix"]) if estimator != "gae" else setup


def check_same_training(setup: dict, run_dir: str, case: Case) -> None:
    """Raises OutOfBounds (listing the quantities out of bounds) unless the run trained like (1,1,1)."""
    w0 = load_file(os.path.join(setup["model"], "model.safetensors"))
    got = (metrics(run_dir), final_actor_weights(run_dir, STEPS))
    assert_same_training(w0, baseline(setup, case.estimator), got, OPT_STEPS, case.name)


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_layout_trains_like_one_rank(setup, case):
    run_dir = _run(_data(setup, case.estimator), os.path.join(setup["root"], case.name), case)
    check_same_training(setup, run_dir, case)
    base, _ = baseline(setup, case.estimator)
    last = base[-1]
    assert last["actor/pg_loss"] != 0.0 and last["actor/grad_norm"] > 0.0
    assert last["actor/pg_clipfrac"] == 0.0  # the bounds assume no token sits at a clip boundary
    if case.estimator == "gae":
        assert last["critic/vf_loss"] > 0.0 and last["critic/vf_clipfrac"] == 0.0
    else:
        assert "critic/vf_loss" not in last and last["actor/kl_loss"] > 0.0
        assert last["critic/score/max"] > last["critic/score/min"]  # the group advantages are not all zero


@pytest.mark.dist
@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_planted_bug_fails_the_check(setup, plant):
    case = PLANTED[plant]
    run_dir = _run(setup, os.path.join(setup["root"], f"planted_{plant}"), case, plant=plant)
    with pytest.raises(OutOfBounds) as failure:
        check_same_training(setup, run_dir, case)
    print(f"planted {plant}: {failure.value}")
    assert failure.value.worst > 10, "the planted bug is caught, but only barely: the bounds are too loose"
