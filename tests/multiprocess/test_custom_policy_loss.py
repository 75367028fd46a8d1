"""A policy loss written for verl (tests/helpers/verl_style_loss.py: verl's call, config attributes and
`agg_loss(..., **config.global_batch_info)`), registered by a test module, trains by name: a 2-step GRPO run at DP2
with `actor_rollout_ref.actor.policy_loss.loss_mode=verl_style_reinforce` and seq-mean-token-sum-norm aggregation.
The loss's own metric shows it ran on every micro-batch (1 per mini-batch after the actor's weighting), and an unknown
loss_mode stops the CLI at start with one line listing the choices."""
import json
import math
import os

from tests.helpers.common import launch_world
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import metrics, train


def test_a_verl_style_loss_registered_by_a_test_module_trains_by_name(tmp_path):
    setup = make_ppo_setup(tmp_path)
    run_dir = str(tmp_path / "run")
    args = tiny_overrides(setup, run_dir, world=2, steps=2) + [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        "actor_rollout_ref.actor.policy_loss.loss_mode=verl_style_reinforce",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"]
    log = tmp_path / "world.log"
    world = launch_world("custom_loss_commands.py", 2, json.dumps([["train", "recipes/defaults.yaml", *args]]),
                         log=log)
    world.wait(timeout=900)
    assert world.returncode == 0, log.read_text()[-4000:]
    steps = [m for m in metrics(run_dir) if "actor/pg_loss" in m]
    assert len(steps) == 2, steps
    for m in steps:
        assert abs(m["actor/verl_style_calls"] - 1.0) < 1e-6, m
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]), m
    assert os.path.isdir(run_dir)


def test_an_unknown_loss_mode_is_one_line_listing_the_choices(tmp_path):
    setup = make_ppo_setup(tmp_path, n_train=4, n_val=2)
    out = train(tiny_overrides(setup, str(tmp_path / "run")) + ["actor_rollout_ref.actor.policy_loss.loss_mode=nope"],
                timeout=300)
    assert out.returncode != 0
    lines = [line for line in out.stdout.splitlines() if "policy_loss.loss_mode" in line]
    assert lines and "'nope' is not one of" in lines[0] and "gspo" in lines[0], out.stdout[-2000:]
