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
"""
from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file

from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import (
    GREEDY,
    LINEAR_OPTIM,
    REL,
    OutOfBounds,
    assert_same_training,
    env,
    final_actor_weights,
    metrics,
    train,
)

STEPS = 3
OPT_STEPS = STEPS * 2
MOE = ["actor_rollout_ref.actor.megatron.moe_router_load_balancing_type=aux_loss",
       "actor_rollout_ref.actor.megatron.moe_aux_loss_coeff=0.01",
       "actor_rollout_ref.actor.megatron.moe_router_bias_update_rate=0.001"]
LAYOUTS = {"tp1pp1ep1": (1, 1, 1, 1), "tp1pp1ep2": (1, 1, 2, 2), "tp2pp1ep2etp1sp": (2, 1, 2, 4)}


def _args(setup: dict, run_dir: str, tp: int, pp: int, ep: int, world: int) -> list[str]:
    args = tiny_overrides(setup, run_dir, world=world, tp=tp, pp=pp, steps=STEPS) + GREEDY + LINEAR_OPTIM + MOE
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


_runs: dict[str, tuple[list[dict], dict]] = {}


def _run(setup: dict, name: str, plant: str | None = None) -> tuple[list[dict], dict]:
    if name not in _runs or plant:
        run_dir = os.path.join(setup["root"], name + (f"_planted_{plant}" if plant else ""))
        proc = train(_args(setup, run_dir, *LAYOUTS[name]), hooks=True,
                     run_env=env(**({"TRIPOD_TEST_PLANT": plant} if plant else {})))
        assert proc.returncode == 0, proc.stdout[-5000:]
        out = (metrics(run_dir), final_actor_weights(run_dir, STEPS))
        if plant:
            return out
        _runs[name] = out
    return _runs[name]


def _check(setup: dict, got: tuple[list[dict], dict], label: str) -> None:
    w0 = load_file(os.path.join(setup["model"], "model.safetensors"))
    base = _run(setup, "tp1pp1ep1")
    assert_same_training(w0, base, got, OPT_STEPS, label)
    for a, b in zip(base[0], got[0]):  # the load-balancing loss: a mean of positive terms (no cancellation)
        if "actor/moe_aux_loss" in a:
            assert abs(a["actor/moe_aux_loss"] - b["actor/moe_aux_loss"]) <= REL * a["actor/moe_aux_loss"], \
                (label, a["step"], a["actor/moe_aux_loss"], b["actor/moe_aux_loss"])


@pytest.mark.dist
@pytest.mark.parametrize("name", ["tp1pp1ep2", "tp2pp1ep2etp1sp"])
def test_moe_layout_trains_like_one_rank(setup, name):
    _check(setup, _run(setup, name), name)
    last = _run(setup, "tp1pp1ep1")[0][-1]
    assert last["actor/moe_aux_loss"] > 0 and last["critic/moe_aux_loss"] > 0 and last["actor/grad_norm"] > 0
    assert last["actor/pg_clipfrac"] == 0.0 and last["critic/vf_clipfrac"] == 0.0


@pytest.mark.dist
def test_planted_expert_dp_bug_fails_the_check(setup):
    got = _run(setup, "tp2pp1ep2etp1sp", plant="expert_dp_grads")
    with pytest.raises(OutOfBounds) as failure:
        _check(setup, got, "planted expert_dp_grads")
    print(f"planted expert_dp_grads: {failure.value}")
    assert failure.value.worst > 10
