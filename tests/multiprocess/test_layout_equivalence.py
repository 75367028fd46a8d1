"""Cross-layout equivalence of whole PPO runs: every parallel layout trains like (TP, PP, DP) = (1, 1, 1).

Each case of CASES is a 3-step greedy PPO run compared with the same run at (1,1,1): rollouts identical, losses and
grad norms within the fp32 reduction-order bound, and the SGD weight updates within the bound derived in
tests/helpers/trainer_runs.py. A new layout joins by appending one `Case(name, tp, pp, world, extra_overrides)`.
The planted-bug tests run the same check on a run with one bug injected (tests/multiprocess/workers/train_with_hooks.py) and
require it to fail: proof that the check can catch a wrong split rule or a lost gradient. Every run is made once, by
the `runs` fixture (all the runs of one world size in one torchrun world, the worlds side by side, the final actor
weights exported in one 1-rank world); the tests assert on its outputs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
from safetensors.torch import load_file

from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import (
    GREEDY,
    LINEAR_OPTIM,
    OutOfBounds,
    assert_same_training,
    final_actor_weights_of,
    metrics,
    train_in_worlds,
)

STEPS = 3
OPT_STEPS = STEPS * 2  # 2 mini-batches of 2 prompts per step (GREEDY: train_batch_size 4, rollout.n 1)
# GRPO needs groups (rollout.n >= 2); greedy rollouts make a group's responses identical, so its advantages are 0
# and the policy-gradient term vanishes. The entropy bonus moves the actor away from the reference, so the KL loss
# (through the reference model) and the entropy term carry the gradient, on the critic-free path.
CRITIC_FREE = ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "actor_rollout_ref.rollout.n=2",
               "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
               "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0.01"]
ESTIMATORS = {"gae": [], "grpo_kl_loss": CRITIC_FREE}
CP2 = ["actor_rollout_ref.actor.megatron.context_parallel_size=2"]


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
    # every pass under a token budget, micro-batches of their own lengths (prompts of 41-43 tokens) through PP2: the
    # updates one row per micro-batch (70 tokens), the forward passes two rows, regrouped by length (100 tokens)
    Case("token_budget_pp2", 1, 2, 2, ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                                       "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=70",
                                       "critic.ppo_max_token_len_per_gpu=70",
                                       "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=100",
                                       "critic.forward_max_token_len_per_gpu=100", *_critic_layout(1, 2)]),
    Case("actor_tp2dp2_critic_pp2dp2", 2, 1, 4, _critic_layout(1, 2)),
    # GRPO's prompt groups packed under a budget: each DP rank gets whole groups, a micro-batch one group (53 of 70
    # tokens) in the update and two in the forward passes
    Case("grpo_token_budget_dp2", 1, 1, 2, ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                                            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=70",
                                            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=120"],
         estimator="grpo_kl_loss"),
    Case("grpo_kl_loss_tp2pp2", 2, 2, 4, estimator="grpo_kl_loss"),
    # rollout TP larger than the actor's: each generation shard regrouped point to point from the two DP replicas
    # (parallel/hybrid_engine/regroup.py), the embedded engine at TP2 in the local slice order
    Case("rollout_tp2_over_actor_tp1dp2", 1, 1, 2, ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"]),
    # context parallelism (actor, critic and reference: the critic's and reference's keys follow the actor's): each
    # sequence cut into 2*CP load-balanced chunks (parallel/context_parallel.py), rows padded to a multiple of 4;
    # padding-free packing is on by default, so one case turns it off
    Case("cp2", 1, 1, 2, CP2),
    Case("tp2cp2", 2, 1, 4, CP2),
    # CP with GRPO's shared prompts packed into one model row per prompt group
    Case("grpo_kl_loss_cp2", 1, 1, 2, CP2, estimator="grpo_kl_loss"),
    Case("cp2_padded_rows", 1, 1, 2, CP2 + ["actor_rollout_ref.model.use_remove_padding=false",
                                            "critic.model.use_remove_padding=false"]),
]
PLANTED = {"lm_head_tp_split": Case("planted", 2, 1, 2), "pp_stage_grads": Case("planted", 1, 2, 2),
           "cp_sum_grad": Case("planted", 1, 1, 2, CP2)}


def _args(setup: dict, run_dir: str, case: Case) -> list[str]:
    args = tiny_overrides(setup, run_dir, world=case.world, tp=case.tp, pp=case.pp, steps=STEPS) + GREEDY
    return args + LINEAR_OPTIM + ESTIMATORS[case.estimator] + case.extra


def _plan() -> dict[str, tuple[Case, str | None]]:
    """Every run of the module: name -> (case, planted bug)."""
    plan = {f"base_{e}": (Case("base", 1, 1, 1, estimator=e), None) for e in ESTIMATORS}
    plan.update({c.name: (c, None) for c in CASES})
    plan.update({f"planted_{p}": (c, p) for p, c in PLANTED.items()})
    return plan


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("equivalence")
    return dict(make_ppo_setup(tmp, max_digits=2), root=str(tmp))


@pytest.fixture(scope="module")
def runs(setup) -> dict[str, tuple[list[dict], dict]]:
    """Every run of the module made once (one torchrun world per world size runs all the runs of that size, final
    actor weights exported in one 1-rank world): name -> (metrics, final actor weights)."""
    plan = _plan()
    run_dirs = {name: os.path.join(setup["root"], name) for name in plan}
    train_in_worlds({name: (case.world, _args(setup, run_dirs[name], case), bug) for name, (case, bug) in plan.items()},
                    setup["root"])
    weights = final_actor_weights_of({d: STEPS for d in run_dirs.values()})
    out = {name: (metrics(run_dirs[name]), weights[run_dirs[name]]) for name in plan}
    for e in ESTIMATORS:
        assert [m["step"] for m in out[f"base_{e}"][0]] == list(range(STEPS + 1))
    return out


def check_same_training(setup: dict, runs: dict, name: str) -> None:
    """Raises OutOfBounds (listing the quantities out of bounds) unless the run trained like (1,1,1)."""
    w0 = load_file(os.path.join(setup["model"], "model.safetensors"))
    case = _plan()[name][0]
    assert_same_training(w0, runs[f"base_{case.estimator}"], runs[name], OPT_STEPS, case.name)


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_layout_trains_like_one_rank(setup, runs, case):
    check_same_training(setup, runs, case.name)
    base, _ = runs[f"base_{case.estimator}"]
    last = base[-1]
    assert last["actor/grad_norm"] > 0.0 and last["actor/pg_clipfrac"] == 0.0  # no token at a clip boundary
    if case.estimator == "gae":
        assert last["actor/pg_loss"] != 0.0 and last["critic/vf_loss"] > 0.0 and last["critic/vf_clipfrac"] == 0.0
    else:  # critic-free, with the reference model in the loss
        assert "critic/vf_loss" not in last and last["actor/kl_loss"] > 0.0


@pytest.mark.dist
@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_planted_bug_fails_the_check(setup, runs, plant):
    with pytest.raises(OutOfBounds) as failure:
        check_same_training(setup, runs, f"planted_{plant}")
    print(f"planted {plant}: {failure.value}")
    assert failure.value.worst > 10, "the planted bug is caught, but only barely: the bounds are too loose"
