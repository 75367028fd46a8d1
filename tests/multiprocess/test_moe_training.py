"""MoE PPO across layouts: three greedy PPO steps of a tiny DeepSeek-V3-like model (MLA, sigmoid group-limited
routing with an expert bias, a shared expert, a dense first layer; actor, critic and reference all MoE) train alike
at (TP, PP, EP) = (1,1,1), (1,1,2) and (2,1,2) with expert TP 1 and sequence parallel, where the experts' gradients
also reduce over an expert-data-parallel group of 2. This test found megatron's MLA RoPE-key gradient bug at TP > 1
(parallel/megatron_patches/cpu_compat.py mla_rope_key_grad: the (2,1,2) run drifted 14x past its bound before the fix).

Bounds: those of tests/helpers/trainer_runs.py (fp32 reduction order, SGD weight updates), unchanged. Routing adds one
discontinuity: a token's top-k (or top group) flips only where two router scores lie within the layout's
perturbation of each other (~1e-6 relative, REL bounds it by 1.2e-3); the tiny model's random routers (logit scale
~0.5, tests/helpers/moe_models.py) leave gaps of order 0.1 among 4 experts, so over ~10^3 routing decisions per run a flip
has a chance of order 1e-3 -- a flake, not a systematic pass. The load-balancing loss (aux_loss) and the expert-bias
update (rate 1e-3, a sign of integer token counts: exact) are on in every run, so `actor/moe_aux_loss` and the
biases are compared too. The planted bug (expert gradients summed instead of averaged over expert-DP) must fail.

The expert bias itself: megatron adds rate * sign(mean count - count) to each expert's bias once per optimizer step
(finalize_model_grads), so after K steps every element moved by n * rate with an integer |n| <= K, and a layer whose
routing was ever unbalanced moved at all. `assert_expert_bias_moved` checks exactly that on the (1,1,1) run (the
cross-layout comparison cannot: a bias that never moves stays equal in every layout); a planted bug (the update
disabled) must fail it.

All runs of the module are made once, by the `runs` fixture (all the runs of one world size in one torchrun world,
the worlds side by side, their final actor weights exported in one 1-rank world); the tests assert on their outputs.
"""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import (
    GREEDY,
    LINEAR_OPTIM,
    REL,
    U32,
    OutOfBounds,
    assert_same_training,
    final_actor_weights_of,
    metrics,
    train_in_worlds,
)

STEPS = 3
OPT_STEPS = STEPS * 2
BIAS_RATE = 0.001
MOE = ["actor_rollout_ref.actor.megatron.moe_router_load_balancing_type=aux_loss",
       "actor_rollout_ref.actor.megatron.moe_aux_loss_coeff=0.01",
       f"actor_rollout_ref.actor.megatron.moe_router_bias_update_rate={BIAS_RATE}"]
LAYOUTS = {"tp1pp1ep1": (1, 1, 1, 1), "tp1pp1ep2": (1, 1, 2, 2), "tp2pp1ep2etp1sp": (2, 1, 2, 4)}
# run name -> (layout, planted bug, PPO steps); the frozen-bias plant needs one step (2 optimizer steps) to show
PLANTED = {"planted_expert_dp_grads": ("tp2pp1ep2etp1sp", "expert_dp_grads", STEPS),
           "planted_expert_bias_frozen": ("tp1pp1ep1", "expert_bias_frozen", 1)}


def _args(setup: dict, run_dir: str, tp: int, pp: int, ep: int, world: int, steps: int = STEPS) -> list[str]:
    args = tiny_overrides(setup, run_dir, world=world, tp=tp, pp=pp, steps=steps) + GREEDY + LINEAR_OPTIM + MOE
    sp = ["actor_rollout_ref.actor.megatron.sequence_parallel=true", "critic.megatron.sequence_parallel=true"] \
        if tp > 1 else []  # megatron's MoE layer expects SP whenever TP > 1 (the recipes use it too)
    return args + sp + [f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep}",
                   f"actor_rollout_ref.actor.megatron.expert_tensor_parallel_size={1 if ep > 1 else 'null'}",
                   f"critic.megatron.tensor_model_parallel_size={tp}",
                   f"critic.megatron.pipeline_model_parallel_size={pp}"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("moe_equivalence")
    return dict(make_ppo_setup(tmp, family="deepseek_v3", num_hidden_layers=2), root=str(tmp))


@pytest.fixture(scope="module")
def runs(setup) -> dict[str, tuple[list[dict], dict[str, torch.Tensor]]]:
    """Every run of the module: name -> (metrics, final actor weights)."""
    plan = {name: (name, None, STEPS) for name in LAYOUTS} | PLANTED
    run_dirs = {name: os.path.join(setup["root"], name) for name in plan}
    # one torchrun world per world size makes all the runs of that size (planted ones after the clean ones)
    train_in_worlds({name: (LAYOUTS[layout][3], _args(setup, run_dirs[name], *LAYOUTS[layout], steps=steps), bug)
                     for name, (layout, bug, steps) in plan.items()}, setup["root"])
    weights = final_actor_weights_of({run_dirs[name]: plan[name][2] for name in plan})
    return {name: (metrics(run_dirs[name]), weights[run_dirs[name]]) for name in plan}


def _check(setup: dict, runs: dict, got: tuple[list[dict], dict], label: str) -> None:
    w0 = load_file(os.path.join(setup["model"], "model.safetensors"))
    base = runs["tp1pp1ep1"]
    assert_same_training(w0, base, got, OPT_STEPS, label)
    for a, b in zip(base[0], got[0]):  # the load-balancing loss: a mean of positive terms (no cancellation)
        if "actor/moe_aux_loss" in a:
            assert abs(a["actor/moe_aux_loss"] - b["actor/moe_aux_loss"]) <= REL * a["actor/moe_aux_loss"], \
                (label, a["step"], a["actor/moe_aux_loss"], b["actor/moe_aux_loss"])


def assert_expert_bias_moved(w0: dict[str, torch.Tensor], final: dict[str, torch.Tensor],
                             opt_steps: int) -> dict[str, list[int]]:
    """Each MoE layer's expert bias moved, every element by n * BIAS_RATE with an integer |n| <= opt_steps; returns
    the n of each bias tensor.

    Each step adds sign(.) * rate to an fp32 bias of magnitude <= |b0| + K * rate: rounding <= u * (that + rate)
    per step, so |delta - n * rate| <= K * u * (max|b0| + (K + 1) * rate) -- about 1e-8 here, against a step of 1e-3.
    """
    names = sorted(k for k in w0 if k.endswith("e_score_correction_bias"))
    assert names, "the model has no expert bias: the check is vacuous"
    whole_steps = {}
    for name in names:
        b0, delta = w0[name].double(), final[name].double() - w0[name].double()
        steps = delta / BIAS_RATE
        n = steps.round()
        rounding = opt_steps * U32 * (float(b0.abs().max()) + (opt_steps + 1) * BIAS_RATE) / BIAS_RATE
        assert float((steps - n).abs().max()) <= rounding, (name, steps.tolist(), "not whole update steps")
        assert float(n.abs().max()) <= opt_steps, (name, n.tolist(), f"more than {opt_steps} update steps")
        assert float(n.abs().max()) >= 1, f"{name}: the expert bias did not move in {opt_steps} optimizer steps"
        whole_steps[name] = [int(x) for x in n]
    return whole_steps


@pytest.mark.dist
@pytest.mark.parametrize("name", ["tp1pp1ep2", "tp2pp1ep2etp1sp"])
def test_moe_layout_trains_like_one_rank(setup, runs, name):
    _check(setup, runs, runs[name], name)
    last = runs["tp1pp1ep1"][0][-1]
    assert last["actor/moe_aux_loss"] > 0 and last["critic/moe_aux_loss"] > 0 and last["actor/grad_norm"] > 0
    assert last["actor/pg_clipfrac"] == 0.0 and last["critic/vf_clipfrac"] == 0.0


@pytest.mark.dist
def test_planted_expert_dp_bug_fails_the_check(setup, runs):
    with pytest.raises(OutOfBounds) as failure:
        _check(setup, runs, runs["planted_expert_dp_grads"], "planted expert_dp_grads")
    print(f"planted expert_dp_grads: {failure.value}")
    assert failure.value.worst > 10


@pytest.mark.dist
def test_expert_bias_moves_by_whole_update_steps(setup, runs):
    w0 = load_file(os.path.join(setup["model"], "model.safetensors"))
    print(f"expert-bias update steps (x {BIAS_RATE}): {assert_expert_bias_moved(w0, runs['tp1pp1ep1'][1], OPT_STEPS)}")


@pytest.mark.dist
def test_planted_frozen_expert_bias_fails_the_bias_check(setup, runs):
    w0 = load_file(os.path.join(setup["model"], "model.safetensors"))
    with pytest.raises(AssertionError, match="the expert bias did not move") as failure:
        assert_expert_bias_moved(w0, runs["planted_expert_bias_frozen"][1], 2)
    print(f"planted expert_bias_frozen: {failure.value}")
