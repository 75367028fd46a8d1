"""Facts derived from the config, each computed in one place and read by every site: which models a run builds
(`TripodConfig.uses_critic` / `uses_reference`: the trainer, validation, preflight, `tripod plan` and the memory
plan), DP = world / (TP*PP) (`MegatronConfig.data_parallel_size`), and the resharding plan of a recipe
(`reshard_plan_from_config`: `tripod plan` and the bench's prediction)."""
import pytest

from tests.helpers.common import REPO_ROOT

RECIPE = str(REPO_ROOT / "recipes" / "defaults.yaml")
ESTIMATORS = ["gae", "grpo", "rloo", "reinforce_plus_plus_baseline"]


def _cfg(*overrides: str):
    from tripod.engine.config import load_config

    return load_config(RECIPE, list(overrides))


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("kl_in_reward,kl_loss", [(False, False), (True, False), (False, True), (True, True)])
def test_which_models_a_run_builds(estimator, kl_in_reward, kl_loss):
    cfg = _cfg(f"algorithm.adv_estimator={estimator}", f"algorithm.use_kl_in_reward={kl_in_reward}",
               f"actor_rollout_ref.actor.use_kl_loss={kl_loss}")
    assert cfg.uses_critic == (estimator == "gae")  # only GAE reads values
    assert cfg.uses_reference == (kl_in_reward or kl_loss)  # any KL term needs the reference log-probs


@pytest.mark.parametrize("estimator,kl_loss", [("gae", False), ("grpo", True), ("grpo", False), ("gae", True)])
def test_memory_plan_lists_the_models_the_config_builds(estimator, kl_loss):
    """The memory plan's models are those the trainer builds (it reads the same two properties)."""
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import plan_from_config

    cfg = _cfg(f"algorithm.adv_estimator={estimator}", f"actor_rollout_ref.actor.use_kl_loss={kl_loss}",
               "trainer.n_gpus_per_node=2")
    arch = arch_from_hf(dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    names = [m.name for m in plan_from_config(cfg, 2, arch).models]
    expected = ["actor"] + ["critic"] * cfg.uses_critic + ["reference"] * cfg.uses_reference
    assert names == expected


@pytest.mark.parametrize("world,tp,pp,dp", [(8, 2, 2, 2), (8, 1, 1, 8), (6, 3, 1, 2), (4, 1, 4, 1)])
def test_data_parallel_size(world, tp, pp, dp):
    cfg = _cfg(f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
               f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}")
    assert cfg.actor_rollout_ref.actor.megatron.data_parallel_size(world) == dp
    # the critic and the reference follow the actor's layout unless set (interpolated keys)
    assert cfg.critic.megatron.data_parallel_size(world) == dp
    assert cfg.actor_rollout_ref.ref.megatron.data_parallel_size(world) == dp


def test_reshard_plan_from_config_takes_every_layout_key():
    """An MoE recipe with virtual stages, expert parallelism and a bf16 rollout: the plan carries all of them (the
    bench's prediction used to drop VPP, EP, ETP and the rollout dtype)."""
    import torch

    from tests.helpers.moe_models import COMMON, FAMILIES
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.hybrid_engine import build_reshard_plan, reshard_plan_from_config

    arch = arch_from_hf({**COMMON, **FAMILIES["qwen3_moe"], "model_type": "qwen3_moe"})
    m = "actor_rollout_ref.actor.megatron."
    cfg = _cfg(f"{m}tensor_model_parallel_size=2", f"{m}pipeline_model_parallel_size=2",
               f"{m}virtual_pipeline_model_parallel_size=2", f"{m}expert_model_parallel_size=2",
               f"{m}expert_tensor_parallel_size=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
               "actor_rollout_ref.rollout.dtype=bf16")
    plan = reshard_plan_from_config(cfg, 8, arch, bucket_bytes=4096)
    by_hand = build_reshard_plan(arch, 2, 2, 2, 1, bucket_bytes=4096, world_size=8, vpp=2, ep=2, etp=1,
                                 dtype=torch.bfloat16)
    assert (plan.tp, plan.pp, plan.dp, plan.rollout_tp, plan.ep, plan.etp, plan.dtype) == (2, 2, 2, 1, 2, 1,
                                                                                           torch.bfloat16)
    assert plan.specs == by_hand.specs and plan.describe() == by_hand.describe()
    assert [plan.bytes_received(r) for r in range(8)] == [by_hand.bytes_received(r) for r in range(8)]
