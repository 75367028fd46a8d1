"""engine/step_plan.py: every per-run decision of the PPO step, from the config (issue 44). Each case names what the
trainer did per step before the plan existed (PPOTrainer.on_policy_update, the bypass / reference / sharding branches
of train_step), so a wrong rule shows here before it shows as a slower or wrong training step."""
import pytest

from tripod.engine.config import load_config
from tripod.engine.step_plan import StepPlan

ONE_UPDATE = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
              "actor_rollout_ref.actor.ppo_epochs=1", "algorithm.use_kl_in_reward=false"]


def plan(overrides, critic=False, reference=False, moe=False, source_shards_rows=True, reward_model=False):
    cfg = load_config(None, overrides)
    return StepPlan.of(cfg, has_critic=critic, has_reference_model=reference, moe=moe,
                       source_shards_rows=source_shards_rows, dynamic_sampling=cfg.algorithm.filter_groups.enable,
                       reward_model=reward_model)


def test_the_demo_recipe_recomputes_shards_and_takes_the_reference_model():
    cfg = load_config("recipes/demo/smollm2-135m-arithmetic.yaml", [])
    p = StepPlan.of(cfg, has_critic=True, has_reference_model=True, moe=False, source_shards_rows=True,
                    dynamic_sampling=False, reward_model=False)
    assert (p.old_log_probs, p.reference, p.values, p.shard_rows, p.kl_in_reward, p.correction) == \
        ("recompute", "model", True, True, True, False)
    assert p.recomputes_old(0) and p.updates_actor(0)
    assert "old log-probs recomputed by the actor" in p.describe() and "rows sharded by DP rank" in p.describe()


def test_one_epoch_of_one_mini_batch_skips_the_recompute_except_in_the_critic_warmup():
    p = plan(ONE_UPDATE + ["trainer.critic_warmup=2"])
    assert p.old_log_probs == "update"
    assert [p.recomputes_old(s) for s in range(4)] == [True, True, False, False]  # the actor sits the warm-up out
    assert [p.updates_actor(s) for s in range(4)] == [False, False, True, True]
    assert "actor updates from step 3" in p.describe()


@pytest.mark.parametrize("extra, why", [
    (["actor_rollout_ref.actor.ppo_mini_batch_size=4"], "two mini-batches: the second is off-policy"),
    (["actor_rollout_ref.actor.ppo_epochs=2"], "a second epoch"),
    (["algorithm.use_kl_in_reward=true"], "the KL penalty reads the old log-probs"),
    (["algorithm.rollout_correction.rollout_is=token"], "the correction reads them"),
    (["rollout.nnodes=1", "rollout.n_gpus_per_node=1", "async_training.staleness_threshold=1"],
     "a stale batch: correction on by default"),
])
def test_anything_off_policy_recomputes(extra, why):
    p = plan(ONE_UPDATE + extra)
    assert p.old_log_probs == "recompute", why


def test_bypass_takes_the_rollouts_log_probs_and_corrects_nothing():
    p = plan(ONE_UPDATE + ["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.actor.ppo_epochs=2"])
    assert p.old_log_probs == "rollout" and not p.correction and not p.recomputes_old(5)


def test_stale_batches_plan_the_correction():
    own = ["rollout.nnodes=1", "rollout.n_gpus_per_node=1"]
    assert plan(own + ["async_training.staleness_threshold=1"], source_shards_rows=False).correction
    assert not plan(own, source_shards_rows=False).correction  # staleness 0: the synchronous run
    assert "rollout correction on" in plan(own + ["async_training.staleness_threshold=1"]).describe()


def test_the_reference_is_the_model_or_the_lora_actor_without_adapters():
    kl = ["actor_rollout_ref.actor.use_kl_loss=true"]
    assert plan(kl, reference=True).reference == "model"
    assert plan(kl + ["actor_rollout_ref.model.lora.rank=4"]).reference == "actor_without_adapters"
    assert plan(["actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false"]).reference == "none"


def test_rows_stay_whole_where_the_step_reads_them_all():
    assert plan([]).shard_rows
    assert not plan([], reward_model=True).shard_rows  # the reward model scores every row
    assert not plan([], source_shards_rows=False).shard_rows  # the rollout's own ranks send the whole batch
    dapo = ["algorithm.filter_groups.enable=true", "actor_rollout_ref.rollout.n=2", "trainer.total_training_steps=2"]
    assert not plan(dapo).shard_rows  # the kept rows are known only after scoring


def test_r3_attaches_the_rollouts_routing_for_moe_only():
    r3 = ["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]
    assert plan(r3, moe=True).attach_rollout_routing and plan(r3, moe=True).replay == "R3"
    assert not plan(r3, moe=False).attach_rollout_routing


def test_the_passes_take_their_micro_batches_and_token_budgets():
    p = plan(["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
              "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
              "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=512",
              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=null",
              "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=false",
              "critic.ppo_micro_batch_size_per_gpu=5", "critic.use_dynamic_bsz=true",
              "critic.forward_max_token_len_per_gpu=256"])
    assert (p.old_pass.micro, p.old_pass.token_budget) == (3, 512)
    assert (p.ref_pass.micro, p.ref_pass.token_budget) == (None, None)
    assert (p.value_pass.micro, p.value_pass.token_budget) == (5, 256)

    class Batch:
        size = 11
    assert p.ref_pass.micro_of(Batch()) == 11 and p.old_pass.micro_of(Batch()) == 3  # None: the whole batch in one
