"""Rollout correction end to end (`tripod train`, tiny Qwen2, 2 PPO steps) with a real train /
rollout mismatch: the embedded rollout engine generates in bf16 (actor_rollout_ref.rollout.dtype=bf16) from the
fp32 actor, so its log-probs (log_softmax of bf16 logits) differ from the actor's fp32 recompute, as vLLM / SGLang
bf16 rollouts differ from an fp32 trainer. Four runs side by side: decoupled on 2 gloo ranks (DP2: two rollout
replicas whose log-probs travel through the exchange, the batch sharded by DP rank: engine/workers/row_shards.py;
token TIS + seq_mean_k1 rejection, rollout_corr/* logged every step); bypass_mode at PP2 (old log-probs := the
rollout's, the recompute skipped) and an exactly on-policy GRPO step at DP2 (no recompute either), both measuring
the gap on the update's first forward; and a bound that rejects every sequence, whose steps log and update
nothing."""
import math

import pytest

from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import metrics, train_together

RC = "algorithm.rollout_correction"
NO_VAL = ["data.val_files=[]", "trainer.val_before_train=false", "trainer.test_freq=-1"]
BF16_ROLLOUT = ["actor_rollout_ref.rollout.dtype=bf16", "actor_rollout_ref.rollout.temperature=1.0"]


@pytest.mark.dist
def test_bf16_rollout_mismatch_is_measured_corrected_and_bypassed(tmp_path):
    setup = make_ppo_setup(tmp_path)
    decoupled, bypass = str(tmp_path / "decoupled"), str(tmp_path / "bypass")
    on_policy, rejected = str(tmp_path / "on_policy"), str(tmp_path / "rejected")
    grpo = ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false"]
    # IS threshold 1.0: every token whose fp32 probability exceeds the bf16 rollout's is truncated (about half).
    # Rejection with verl's Geo-RS preset bound (geometric-mean ratio within [1/1.001, 1.001]): bf16 moves each
    # log-prob by ~3e-3, so a sequence's mean difference over 8 tokens is ~1e-3 = log(1.001): some go, some stay
    runs = {"decoupled": tiny_overrides(setup, decoupled, world=2, steps=2) + NO_VAL + BF16_ROLLOUT
            + [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=1.0", f"{RC}.rollout_rs=seq_mean_k1",
               f"{RC}.rollout_rs_threshold=1.001"],
            # PP2 and DP2: the gap measured on the last stage reaches every stage, and reduces over the DP ranks
            "bypass": tiny_overrides(setup, bypass, world=2, pp=2, steps=2) + NO_VAL + BF16_ROLLOUT
            + [f"{RC}.bypass_mode=true"],
            # one mini-batch of every row, one epoch: the update's forward is the old log-probs (nothing recomputed)
            "on_policy": tiny_overrides(setup, on_policy, world=2, steps=1) + NO_VAL + BF16_ROLLOUT + grpo
            + ["actor_rollout_ref.actor.ppo_mini_batch_size=4"],
            # no sequence has a mean k3 below 1e-12 under bf16: every step rejects every row
            "rejected": tiny_overrides(setup, rejected, steps=2) + NO_VAL + BF16_ROLLOUT + grpo
            + [f"{RC}.rollout_rs=seq_mean_k3", f"{RC}.rollout_rs_threshold=1e-12"]}
    train_together(runs, str(tmp_path))

    steps = [m for m in metrics(decoupled) if m["step"] >= 1]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        corr = {k: v for k, v in m.items() if k.startswith("rollout_corr/")}
        assert all(math.isfinite(v) for v in corr.values()), corr
        # bf16 (unit roundoff u = 2**-9) moves each O(1) logit of this 4-layer model by a few u (<= 0.02) and a
        # log-prob by at most twice that: measured 3e-3 mean, 9e-3 max. An exact copy would give 0; log-probs that
        # the gather shifted against their tokens would differ by the spread of the log-probs themselves
        assert 1e-4 < corr["rollout_corr/abs_diff_max"] < 0.05 and corr["rollout_corr/abs_diff_mean"] > 1e-5, corr
        assert corr["rollout_corr/abs_diff_max"] >= corr["rollout_corr/abs_diff_mean"]
        assert corr["rollout_corr/kl"] != 0.0 and corr["rollout_corr/k3_kl"] > 0.0, corr
        assert 0.0 < corr["rollout_corr/rollout_is_ratio_fraction_high"] < 1.0, corr
        # verl's IS metrics are of the weights before the truncation at 1.0: about half the tokens lie above it
        assert corr["rollout_corr/rollout_is_max"] > 1.0 > corr["rollout_corr/rollout_is_min"] > 0.0, corr
        assert abs(corr["rollout_corr/rollout_is_mean"] - 1.0) < 0.05, corr
        assert 0.0 <= corr["rollout_corr/rollout_rs_seq_masked_fraction"] < 1.0, corr
        assert m["timing_s/old_log_prob"] > 0 and math.isfinite(m["actor/pg_loss"])
    assert any(m["rollout_corr/rollout_rs_seq_masked_fraction"] > 0 for m in steps), "the bound never rejected"

    gap_keys = {"training_ppl", "rollout_ppl", "log_ppl_diff", "kl", "k3_kl", "chi2_token", "chi2_seq",
                "abs_diff_max", "abs_diff_mean"}
    for run, steps in ((bypass, 2), (on_policy, 1)):
        rows = [m for m in metrics(run) if m["step"] >= 1]
        assert len(rows) == steps
        for m in rows:
            assert "timing_s/old_log_prob" not in m, f"{run} recomputed the old log-probs"
            corr = {k.removeprefix("rollout_corr/"): v for k, v in m.items() if k.startswith("rollout_corr/")}
            # measured on the update's first forward against the bf16 rollout: the same gap as the recompute's
            assert corr.keys() == gap_keys and all(math.isfinite(v) for v in corr.values()), (run, corr)
            assert 1e-4 < corr["abs_diff_max"] < 0.05 and corr["k3_kl"] > 0.0 and corr["training_ppl"] > 1.0, corr
            assert math.isfinite(m["actor/pg_loss"])
        # the PPO ratio of bypass_mode is pi_theta / pi_rollout: its KL to the bf16 rollout is the mismatch, not 0
    assert all(m["actor/ppo_kl"] != 0.0 for m in metrics(bypass) if m["step"] >= 1)

    rows = [m for m in metrics(rejected) if m["step"] >= 1]
    assert [m["step"] for m in rows] == [1, 2], "an all-rejected step stopped the run"
    for m in rows:  # logged, and nothing updated
        assert m["rollout_corr/rollout_rs_masked_fraction"] == 1.0 == m["rollout_corr/rollout_rs_seq_masked_fraction"]
        assert not any(k.startswith("actor/pg_loss") for k in m) and m["critic/advantages/nonzero_frac"] == 0.0
