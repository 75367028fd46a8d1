"""The advantage estimators verl 0.9.1 registers beyond tripod's first five, under verl's names, and the ones tripod
refuses (`REFUSED_ESTIMATORS`, each with its reason; `algorithm.adv_estimator` names them in one line).

Outcome estimators over groups (one prompt's rollout.n responses, `index`): a response's score is the sum of its
token rewards counted by `score_mask` (default: the mask; after rollout correction's rejection the trainer passes the
mask from before it, so a rejected response keeps its score in its group and gets no advantage, as in
engine/algorithms/advantages.py). Formulas from verl's core_algos.py:
  grpo_vectorized  verl's vectorised GRPO: the same estimator as grpo (tripod's grpo is vectorised already)
  grpo_passk       Pass@k (arXiv 2503.19595): only each group's best response gets r_max - r_second (/ (std + eps))
  gdpo             GDPO (arXiv 2601.05242) on the one reward tripod's reward functions return: GRPO, then whitened
                   over the batch (per-component rewards, verl's algorithm.gdpo_reward_keys, are refused)
  opo              OPO (arXiv 2505.23585): score minus the group's length-weighted mean score
  gpg              GPG: alpha (score - group mean) / f_norm with alpha = batch size / nonzero scores, f_norm 1
  rloo_vectorized  verl's vectorised RLOO: as rloo, except that a group of one gets advantage 0 (rloo: its score)
"""
from __future__ import annotations

import torch

from tripod.engine.algorithms.advantages import (
    GRPO_EPS,
    _broadcast,
    _require,
    _sequence_scores,
    grpo_advantage,
    register_adv_est,
)
from tripod.engine.algorithms.masked import group_ids, group_mean_std, masked_whiten

REFUSED_ESTIMATORS = {
    "remax": "ReMax's baseline is the reward of a second, greedy rollout of every prompt (verl's reward_baselines), "
             "which tripod's step does not generate; use rloo or grpo",
    "optimal_token_baseline": "needs sum over the vocabulary of pi^2 per token from the old-log-prob forward (verl's "
                              "actor.calculate_sum_pi_squared), which tripod's log-prob pass does not compute",
    "tir_optimal_token_baseline": "needs sum over the vocabulary of pi^2 per token from the old-log-prob forward "
                                  "(verl's actor.calculate_sum_pi_squared), which tripod's log-prob pass does not "
                                  "compute",
}
# group estimators: need rollout.n >= 2 (config_validation) and get score_mask after rejection (row_shards)
OUTCOME_GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk", "gdpo", "rloo", "rloo_vectorized", "opo", "gpg",
                            "reinforce_plus_plus_baseline")
NORM_BY_STD_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk", "gdpo")  # read norm_adv_by_std_in_grpo


def estimator_options(algo) -> dict:
    """The options `compute_advantage` passes `algo.adv_estimator` from the `algorithm` section."""
    return {"norm_by_std": algo.norm_adv_by_std_in_grpo} if algo.adv_estimator in NORM_BY_STD_ESTIMATORS else {}


register_adv_est("grpo_vectorized")(grpo_advantage)


def _groups(scores: torch.Tensor, index) -> tuple[torch.Tensor, int]:
    return group_ids(index, len(scores), scores.device)


@register_adv_est("grpo_passk")
def grpo_passk_advantage(token_rewards, mask, *, values, index, gamma, lam, norm_by_std: bool = True,
                         eps: float = GRPO_EPS, score_mask=None):
    """Pass@k: in each group only the best response gets r_max - r_second_max, divided by (group std + eps) with
    norm_by_std; the others get 0. Needs >= 2 responses per group."""
    _require(index, "index", "grpo_passk")
    scores = _sequence_scores(token_rewards, mask if score_mask is None else score_mask)
    ids, num_groups = _groups(scores, index)
    _, std, size = group_mean_std(scores, ids, num_groups)
    if bool((size < 2).any()):
        raise ValueError("grpo_passk needs at least 2 responses per prompt (actor_rollout_ref.rollout.n >= 2)")
    advantage = torch.zeros_like(scores)
    for g in range(num_groups):
        members = torch.nonzero(ids == g, as_tuple=True)[0]
        top = torch.topk(scores[members], 2)
        gain = top.values[0] - top.values[1]
        best = members[top.indices[0]]
        advantage[best] = gain / (std[best] + eps) if norm_by_std else gain
    advantages = _broadcast(advantage, mask)
    return advantages, advantages


@register_adv_est("gdpo")
def gdpo_advantage(token_rewards, mask, *, values, index, gamma, lam, norm_by_std: bool = True,
                   eps: float = GRPO_EPS, score_mask=None, whiten=masked_whiten):
    """GDPO on one reward dimension: the GRPO advantage, whitened over the batch's tokens (by `whiten(x, mask)`)."""
    _require(index, "index", "gdpo")
    grpo, _ = grpo_advantage(token_rewards, mask, values=values, index=index, gamma=gamma, lam=lam,
                             norm_by_std=norm_by_std, eps=eps, score_mask=score_mask)
    advantages = whiten(grpo, mask) * mask.to(grpo.dtype)
    return advantages, advantages


@register_adv_est("opo")
def opo_advantage(token_rewards, mask, *, values, index, gamma, lam, score_mask=None):
    """OPO: score minus sum(len * score) / sum(len) over its group (len: counted tokens); a group of one keeps its
    score."""
    _require(index, "index", "opo")
    counted = mask if score_mask is None else score_mask
    scores = _sequence_scores(token_rewards, counted)
    lengths = counted.to(scores.dtype).sum(-1)
    ids, num_groups = _groups(scores, index)
    weighted = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, lengths * scores)
    total = torch.zeros_like(weighted).index_add_(0, ids, lengths)
    size = torch.bincount(ids, minlength=num_groups)
    baseline = torch.where(size > 1, weighted / total.clamp(min=1e-30), torch.zeros_like(weighted))
    advantages = _broadcast(scores - baseline[ids], mask)
    return advantages, advantages


@register_adv_est("gpg")
def gpg_advantage(token_rewards, mask, *, values, index, gamma, lam, f_norm: float = 1.0, score_mask=None):
    """GPG: alpha (score - group mean) / f_norm, alpha = batch size / number of nonzero scores (group of one: mean
    0)."""
    _require(index, "index", "gpg")
    scores = _sequence_scores(token_rewards, mask if score_mask is None else score_mask)
    ids, num_groups = _groups(scores, index)
    mean, _, _ = group_mean_std(scores, ids, num_groups)
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
    advantages = _broadcast(alpha * (scores - mean) / f_norm, mask)
    return advantages, advantages


@register_adv_est("rloo_vectorized")
def rloo_vectorized_advantage(token_rewards, mask, *, values, index, gamma, lam, score_mask=None):
    """(n score - group sum) / (n - 1): score minus the mean of the others; 0 for a group of one."""
    _require(index, "index", "rloo_vectorized")
    scores = _sequence_scores(token_rewards, mask if score_mask is None else score_mask)
    ids, num_groups = _groups(scores, index)
    mean, _, size = group_mean_std(scores, ids, num_groups)
    scale = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.zeros_like(size))
    advantages = _broadcast(scale * (scores - mean), mask)
    return advantages, advantages
