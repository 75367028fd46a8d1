"""tripod.engine.algorithms.compute_advantage: every registered estimator against a float64 reference
written straight from its formula (Python loops over tokens / samples / groups), on random
rewards with gapped masks, all-masked rows and length-1 responses; index given as a LongTensor,
strings, uuids or a numpy array; bad input raises ValueError naming the argument."""
from __future__ import annotations

import statistics
import uuid

import numpy as np
import pytest
import torch

from tripod.engine.algorithms import compute_advantage, list_adv_estimators, masked_whiten, register_adv_est


# ---------------------------------------------------------------- float64 references
def whiten_reference(x, mask):
    counted = x[mask.bool()]
    return (x - counted.mean()) / torch.sqrt(counted.var(unbiased=True) + 1e-8)


def discounted_scan_reference(rewards, values, mask, gamma, lam):
    """Per-token GAE loop; masked tokens pass next value and running advantage through."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        next_value, running = 0.0, 0.0
        for t in reversed(range(T)):
            if mask[i, t]:
                delta = rewards[i, t].item() + gamma * next_value - values[i, t].item()
                running = delta + gamma * lam * running
                next_value = values[i, t].item()
            adv[i, t] = running
    return adv


def scores_reference(rewards, mask):
    return [sum(rewards[i, t].item() for t in range(rewards.shape[1]) if mask[i, t]) for i in range(len(rewards))]


def grouped(labels):
    groups = {}
    for i, label in enumerate(labels):
        groups.setdefault(label, []).append(i)
    return groups


def grpo_reference(rewards, mask, labels, norm_by_std, eps=1e-6):
    scores = scores_reference(rewards, mask)
    out = [0.0] * len(scores)
    for members in grouped(labels).values():
        group_scores = [scores[i] for i in members]
        mean = statistics.mean(group_scores) if len(members) > 1 else 0.0
        std = statistics.stdev(group_scores) if len(members) > 1 else 1.0
        for i in members:
            out[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return torch.tensor(out, dtype=torch.float64)


def rloo_reference(rewards, mask, labels):
    scores = scores_reference(rewards, mask)
    out = list(scores)
    for members in grouped(labels).values():
        if len(members) > 1:
            for i in members:
                out[i] = scores[i] - statistics.mean(scores[j] for j in members if j != i)
    return torch.tensor(out, dtype=torch.float64)


def baseline_reference(rewards, mask, labels):
    scores = scores_reference(rewards, mask)
    out = list(scores)
    for members in grouped(labels).values():
        if len(members) > 1:
            mean = statistics.mean(scores[i] for i in members)
            for i in members:
                out[i] = scores[i] - mean
    return torch.tensor(out, dtype=torch.float64)


# ---------------------------------------------------------------- inputs
def make_batch(B, T, seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=gen)
    values = torch.randn(B, T, generator=gen)
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[0] = False  # all-masked row
    mask[1, T // 2:] = False  # right padding
    mask[2, 0] = True  # at least two counted tokens overall
    mask[3, -1] = True
    return rewards, values, mask


def assert_matches(actual, expected, what, tol=1e-6):
    err = (actual.double() - expected).abs().max().item()
    assert err <= tol * max(1.0, expected.abs().max().item()), f"{what}: max error {err:.3g}"


LABEL_FORMS = {
    "long_tensor": lambda labels: torch.tensor(labels),
    "strings": lambda labels: [f"prompt-{k}" for k in labels],
    "uuids": lambda labels: [uuid.UUID(int=k + 1) for k in labels],
    "numpy": lambda labels: np.array([f"p{k}" for k in labels], dtype=object),
}


def test_registry_lists_every_estimator_once():
    assert list_adv_estimators() == ["gae", "gdpo", "gpg", "grpo", "grpo_passk", "grpo_vectorized", "opo",
                                     "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "rloo_vectorized"]
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("gae")(lambda *a, **k: None)


@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_estimator(T, gamma, lam):
    rewards, values, mask = make_batch(6, T, seed=T)
    if T == 1:
        mask = torch.tensor([[False], [True], [True], [True], [False], [True]])
    adv, ret = compute_advantage("gae", rewards, mask, values=values, gamma=gamma, lam=lam)
    raw = discounted_scan_reference(rewards.double(), values.double(), mask, gamma, lam)
    m = mask.double()
    assert_matches(adv, whiten_reference(raw, mask) * m, "gae advantages")
    assert_matches(ret, (raw + values.double()) * m, "gae returns")
    counted = adv[mask]
    assert abs(counted.mean().item()) < 1e-6 and abs(counted.std().item() - 1) < 1e-5


def test_gae_with_fused_kl_shaping_matches_shaped_rewards():
    rewards, values, mask = make_batch(5, 12, seed=4)
    gen = torch.Generator().manual_seed(9)
    logp, ref_logp = -torch.rand(5, 12, generator=gen) * 3, -torch.rand(5, 12, generator=gen) * 3
    adv, ret = compute_advantage("gae", rewards, mask, values=values, gamma=0.99, lam=0.9, logp=logp,
                                 ref_logp=ref_logp, kl_coef=0.2, kl_kind="k1")
    shaped = rewards.double() - 0.2 * (logp.double() - ref_logp.double())
    raw = discounted_scan_reference(shaped, values.double(), mask, 0.99, 0.9)
    assert_matches(adv, whiten_reference(raw, mask) * mask, "gae+kl advantages")
    assert_matches(ret, (raw + values.double()) * mask, "gae+kl returns")


@pytest.mark.parametrize("form", sorted(LABEL_FORMS))
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo(form, norm_by_std):
    rewards, _, mask = make_batch(9, 7, seed=2)
    labels = [0, 0, 0, 5, 5, 3, 2, 2, 2]  # groups of 3, 2, 1 (single) and 3
    adv, ret = compute_advantage("grpo", rewards, mask, index=LABEL_FORMS[form](labels), norm_by_std=norm_by_std)
    expected = grpo_reference(rewards.double(), mask, labels, norm_by_std).unsqueeze(-1) * mask
    assert_matches(adv, expected, f"grpo ({form}, norm_by_std={norm_by_std})")
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("form", ["long_tensor", "strings"])
def test_rloo(form):
    rewards, _, mask = make_batch(8, 5, seed=3)
    labels = [1, 1, 1, 1, 7, 9, 9, 9]
    adv, _ = compute_advantage("rloo", rewards, mask, index=LABEL_FORMS[form](labels))
    assert_matches(adv, rloo_reference(rewards.double(), mask, labels).unsqueeze(-1) * mask, "rloo")


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(gamma):
    rewards, _, mask = make_batch(5, 11, seed=5)
    adv, ret = compute_advantage("reinforce_plus_plus", rewards, mask, gamma=gamma)
    returns = discounted_scan_reference(rewards.double(), torch.zeros(5, 11), mask, gamma, 1.0)
    assert_matches(ret, returns * mask, "reinforce++ returns")
    assert_matches(adv, whiten_reference(returns, mask) * mask, "reinforce++ advantages")


def test_reinforce_plus_plus_baseline():
    rewards, _, mask = make_batch(7, 6, seed=6)
    labels = ["a", "a", "b", "b", "b", "c", "a"]
    adv, _ = compute_advantage("reinforce_plus_plus_baseline", rewards, mask, index=labels)
    per_sample = baseline_reference(rewards.double(), mask, labels).unsqueeze(-1) * mask
    assert_matches(adv, whiten_reference(per_sample, mask) * mask, "reinforce++ baseline")


def test_masked_whiten_matches_unbiased_statistics_and_needs_two_tokens():
    gen = torch.Generator().manual_seed(8)
    x, mask = torch.randn(4, 6, generator=gen) * 3 + 1, torch.rand(4, 6, generator=gen) < 0.5
    mask[0, :2] = True
    assert_matches(masked_whiten(x.double(), mask), whiten_reference(x.double(), mask), "masked_whiten")
    one = torch.zeros(4, 6, dtype=torch.bool)
    one[2, 3] = True
    with pytest.raises(ValueError, match="at least 2 tokens"):
        masked_whiten(x, one)


def test_bad_inputs_name_the_argument():
    rewards, values, mask = make_batch(4, 5, seed=1)
    with pytest.raises(ValueError, match="name='gea'"):
        compute_advantage("gea", rewards, mask, values=values)
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", rewards, mask)
    with pytest.raises(ValueError, match="index"):
        compute_advantage("grpo", rewards, mask)
    with pytest.raises(ValueError, match="index"):
        compute_advantage("rloo", rewards, mask)
    with pytest.raises(ValueError, match="index has 3 entries"):
        compute_advantage("grpo", rewards, mask, index=[0, 1, 2])
    with pytest.raises(ValueError, match="index"):
        compute_advantage("grpo", rewards, mask, index=torch.rand(4))
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", rewards, mask, values=values[:, :3])
    with pytest.raises(ValueError, match="token_rewards"):
        compute_advantage("grpo", rewards.long(), mask, index=[0, 0, 1, 1])
    with pytest.raises(ValueError, match="mask"):
        compute_advantage("grpo", rewards, mask[:, :2], index=[0, 0, 1, 1])
    with pytest.raises(ValueError, match="norm_by_sd"):
        compute_advantage("grpo", rewards, mask, index=[0, 0, 1, 1], norm_by_sd=False)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        compute_advantage("gae", rewards, torch.zeros_like(mask), values=values)


# ---------------------------------------------------------------- group estimators after rollout correction's rejection
def verl_group_reference(token_level_rewards, response_mask, index, estimator, norm_adv_by_std_in_grpo=True,
                         epsilon=1e-6):
    """float64 from verl's published core_algos.compute_grpo_outcome_advantage / compute_rloo_outcome_advantage: a
    row's score is the sum of ALL its token rewards (whatever the response mask); per group, one row -> mean 0 (std
    1); else the mean and the unbiased std of the group's scores; GRPO (score - mean) / (std + eps) (or score - mean),
    RLOO (score - mean) * n / (n - 1); the per-row result times the response mask."""
    scores = [sum(float(x) for x in row) for row in token_level_rewards]
    out = []
    for i, s in enumerate(scores):
        group = [scores[j] for j in range(len(scores)) if index[j] == index[i]]
        n = len(group)
        mean = sum(group) / n if n > 1 else 0.0
        std = (sum((g - mean) ** 2 for g in group) / (n - 1)) ** 0.5 if n > 1 else 1.0
        if estimator == "grpo":
            adv = (s - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else s - mean
        else:
            adv = (s - mean) * n / (n - 1) if n > 1 else s
        out.append([adv * float(m) for m in response_mask[i]])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("estimator,norm_by_std", [("grpo", True), ("grpo", False), ("rloo", True)])
def test_group_advantages_after_rejection_are_verls(estimator, norm_by_std, sharded):
    """The trainer's advantages after rollout correction rejected rows (the whole batch, and a batch sharded by DP
    rank: RowShards.outcome_advantages after its recount) equal verl's estimator on the same rows: the rejected
    rows' real scores stay in their groups' statistics, their advantages are 0; a group rejected whole and a step
    rejected whole give 0 advantages and no error."""
    from types import SimpleNamespace

    from tripod.engine.workers.batch import PPOBatch, RowLengths
    from tripod.engine.workers.row_shards import RowShards, step_advantages

    gen = torch.Generator().manual_seed(21)
    n_rows, width, index = 16, 6, [0] * 4 + [1] * 4 + [2] * 4 + [3] * 3 + [4]  # a group of one as well
    lengths = torch.randint(1, width + 1, (n_rows,), generator=gen)
    scored = (torch.arange(width)[None, :] < lengths[:, None]).float()
    scores = torch.rand(n_rows, generator=gen).tolist()
    rewards = torch.zeros(n_rows, width)
    rewards[torch.arange(n_rows), lengths - 1] = torch.tensor(scores)  # at each response's last token, as the trainer
    algo = SimpleNamespace(adv_estimator=estimator, norm_adv_by_std_in_grpo=norm_by_std, gamma=1.0, lam=1.0)
    batch = PPOBatch({"input_ids": torch.zeros(n_rows, 2, dtype=torch.long), "index": torch.tensor(index)})
    for rejected in ([1, 6, 7], [8, 9, 10, 11, 15], list(range(n_rows))):  # some rows; group 2 and the single; all
        mask = scored.clone()
        mask[rejected] = 0
        shards = None
        if sharded:
            shards = RowShards(list(range(n_rows)), RowLengths.of_rollout([2] * n_rows, lengths.tolist(), index),
                               None, 1)
            shards.recount(mask)
        adv, ret = step_advantages(algo, rewards, mask, batch, scores, shards, scored)
        want = verl_group_reference(rewards.double(), mask, index, estimator, norm_by_std)
        torch.testing.assert_close(adv.double(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ret.double(), want, rtol=1e-5, atol=1e-6)
        assert (adv[rejected] == 0).all()
        kept = [i for i in range(n_rows) if i not in rejected and index.count(index[i]) > 1]
        assert not kept or (adv[kept] != 0).any(), "the kept rows' advantages must be exercised"
