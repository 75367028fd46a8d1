"""Routing replay in `tripod train`: a tiny Qwen3-MoE (near-tied routers, as tests/multiprocess/test_routing_replay.py)
trained 3 steps in bf16 (actor and embedded rollout) with the rollout recording experts, as
  measure  actor.router_replay.mode=disabled: the old-log-prob pass routes freely, `moe/routing_mismatch_frac` counts
  r3       mode=R3: the rollout's experts replayed in the old-log-prob, reference and update forwards (mismatch 0)
  r2       mode=R2: the old-log-prob pass records (and is measured), the update replays its record
  r3dp2, r2dp2  the same on 2 ranks (DP2: the batch sharded by DP rank)
  onpolicy one mini-batch without KL in reward: no old-log-prob pass, the update's forward is measured
each step logging the mismatch fraction, `moe/routed_experts_bytes` and the rollout/trainer log-prob gap
(`rollout_corr/abs_diff_mean`, the old-log-prob pass against the rollout's). The config checks refuse R3 without the
rollout's record and replay under full recomputation. Prints `RRT <run> step=<k> <metric>=<value>` lines
(bench/RESULTS.md quotes them)."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import metrics, train_together

STEPS = 3
ON_POLICY = ["algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
RUNS = {"measure": "disabled", "r3": "R3", "r2": "R2", "r3dp2": "R3", "r2dp2": "R2",  # *dp2: 2 ranks, sharded batch
        "onpolicy": "disabled"}  # one mini-batch, no KL in reward: no old-log-prob pass, the update measures


def _near_tie(model_dir: str) -> None:
    path = os.path.join(model_dir, "model.safetensors")
    state = load_file(path)
    for name in state:
        if name.endswith("mlp.gate.weight"):
            state[name] = state[name] * 0.2
        elif ".mlp.experts." in name:
            state[name] = state[name] * 3.0
    save_file(state, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routing_replay_trainer")
    setup = make_ppo_setup(tmp, family="qwen3_moe", max_digits=2)
    _near_tie(setup["model"])
    common = ["actor_rollout_ref.actor.megatron.param_dtype=bf16", "actor_rollout_ref.rollout.dtype=bf16",
              "actor_rollout_ref.rollout.enable_rollout_routing_replay=true", "data.max_response_length=16",
              "trainer.val_before_train=false", "trainer.test_freq=-1"]
    dirs = {name: str(tmp / name) for name in RUNS}
    train_together({name: tiny_overrides(setup, dirs[name], world=2 if name.endswith("dp2") else 1, steps=STEPS) + common +
                    [f"actor_rollout_ref.actor.router_replay.mode={mode}"] + ON_POLICY * (name == "onpolicy")
                    for name, mode in RUNS.items()}, str(tmp))
    out = {name: [m for m in metrics(d) if "moe/routed_experts_bytes" in m] for name, d in dirs.items()}
    for name, steps in out.items():
        for m in steps:
            print(f"RRT {name} step={m['step']} " + " ".join(
                f"{k}={m[k]:.6g}" for k in ("moe/routing_mismatch_frac", "rollout_corr/abs_diff_mean",
                                            "rollout_corr/k3_kl", "moe/routed_experts_bytes") if k in m))
    return out


@pytest.mark.dist
def test_replay_in_training(runs):
    for name, steps in runs.items():
        assert len(steps) == STEPS, name
        for m in steps:
            assert 0 <= m["moe/routing_mismatch_frac"] <= 1 and m["moe/routed_experts_bytes"] > 0, (name, m)
    assert all(m["moe/routing_mismatch_frac"] == 0 for m in runs["r3"]), runs["r3"]
    # without replay bf16 rounding flips some near-tied choices (the first step: same weights in both runs)
    assert runs["measure"][0]["moe/routing_mismatch_frac"] > 0
    assert runs["r2"][0]["moe/routing_mismatch_frac"] == runs["measure"][0]["moe/routing_mismatch_frac"]
    assert runs["r3"][0]["rollout_corr/abs_diff_mean"] < runs["measure"][0]["rollout_corr/abs_diff_mean"]
    # two DP ranks: each holds (and logs the bytes of) its own rows only; R3 still agrees everywhere
    assert all(m["moe/routing_mismatch_frac"] == 0 for m in runs["r3dp2"]), runs["r3dp2"]
    assert runs["r3dp2"][0]["moe/routed_experts_bytes"] < runs["r3"][0]["moe/routed_experts_bytes"]
    assert runs["r2dp2"][0]["moe/routing_mismatch_frac"] > 0
    # exactly on-policy: counted in the update's forward (the step's weights), as the old pass would have
    assert runs["onpolicy"][0]["moe/routing_mismatch_frac"] == runs["measure"][0]["moe/routing_mismatch_frac"]


def test_config_refuses_what_replay_cannot_do():
    from types import SimpleNamespace as NS

    from tripod.parallel.router_replay import replay_problems

    def cfg(mode, record, recompute=None, name="embedded", filter_groups=False, separate=False):
        actor = NS(router_replay=NS(mode=mode), megatron=NS(recompute_granularity=recompute))
        rollout = NS(enable_rollout_routing_replay=record, name=name)
        return NS(actor_rollout_ref=NS(actor=actor, rollout=rollout),
                  algorithm=NS(filter_groups=NS(enable=filter_groups)), separate_rollout=separate)

    assert replay_problems(cfg("R3", True)) == [] and replay_problems(cfg("R2", False)) == []
    assert "enable_rollout_routing_replay" in replay_problems(cfg("R3", False))[0]
    assert "recompute_granularity" in replay_problems(cfg("R2", False, "full"))[0]
    assert "one of disabled, R2, R3" in replay_problems(cfg("R4", False))[0]
    assert "rollout.name=vllm" in replay_problems(cfg("R3", True, name="vllm"))[0]
    assert "filter_groups" in replay_problems(cfg("disabled", True, filter_groups=True))[0]
    from tripod.parallel.router_replay import routing_dtype
    assert routing_dtype(254) == torch.uint8 and routing_dtype(255) == torch.int16 and routing_dtype(256) == torch.int16
