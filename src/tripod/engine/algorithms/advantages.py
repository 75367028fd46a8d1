"""Advantage estimators, chosen by name through a registry: gae, grpo, rloo, reinforce_plus_plus,
reinforce_plus_plus_baseline.

Every estimator maps token rewards [B, T] and a response mask [B, T] to (advantages, returns),
both [B, T] and zero where the mask is 0. Add one with `@register_adv_est("name")`; list them with
`list_adv_estimators()`; run one with `compute_advantage(name, ...)`.

Outcome-level estimators (grpo, rloo, ++baseline) score a response as the sum of its token rewards counted by
`score_mask` (default: the mask) and broadcast the advantage over the mask: after rollout correction's rejection
(engine/algorithms/rollout_correction.py) the trainer passes the mask from before it, so a rejected response keeps
its real score in its group's statistics and gets no advantage, as verl's (which sums the token rewards whatever
the mask). Their group (per-prompt) statistics use scatter ops (engine/algorithms/masked.py).
Formulas follow verl (`core_algos.py`): GRPO eps 1e-6 with unbiased std and a group of one scored
against mean 0 / std 1; RLOO score_i - mean of the other samples of its group; REINFORCE++ the
discounted return whitened over the batch; REINFORCE++-baseline score minus group mean, whitened
over the batch. Sequential recurrences (gae, discounted return) run on kernels.gae, so masked
tokens inside a response pass the running value through instead of resetting it.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

from tripod.engine.algorithms.masked import group_ids, group_mean_std, masked_whiten
from tripod.kernels._triton_dispatch import check_float_tensors, check_mask
from tripod.kernels.gae_scan import gae as gae_scan

GRPO_EPS = 1e-6
AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]
_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_adv_est(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering an estimator `fn(token_rewards, mask, *, values, index, gamma, lam, **options)`."""
    def register(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in _ESTIMATORS and _ESTIMATORS[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered by {_ESTIMATORS[name].__name__}")
        _ESTIMATORS[name] = fn
        return fn
    return register


def list_adv_estimators() -> list[str]:
    return sorted(_ESTIMATORS)


def get_adv_estimator(name: str) -> AdvantageEstimator:
    if name not in _ESTIMATORS:
        raise ValueError(f"name={name!r} is not a registered advantage estimator; choose one of {list_adv_estimators()}")
    return _ESTIMATORS[name]


def compute_advantage(
    name: str,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    values: torch.Tensor | None = None,
    index: torch.Tensor | Sequence | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator `name` -> (advantages, returns), [B, T] float, zero where mask is 0."""
    estimator = get_adv_estimator(name)
    shape = check_float_tensors(token_rewards=token_rewards, values=values)
    if len(shape) != 2:
        raise ValueError(f"token_rewards must be [batch, response_len], got shape {tuple(shape)}")
    check_mask(mask, shape)
    if options.get("score_mask") is not None:
        check_mask(options["score_mask"], shape, "score_mask")
    accepted = inspect.signature(estimator).parameters
    unknown = sorted(k for k in options if k not in accepted)
    if unknown:
        known = sorted(k for k, p in accepted.items() if p.kind == p.KEYWORD_ONLY
                       and k not in ("values", "index", "gamma", "lam"))
        raise ValueError(f"option(s) {unknown} are not understood by advantage estimator {name!r}; "
                         f"its options are {known}")
    with torch.no_grad():
        return estimator(token_rewards, mask, values=values, index=index, gamma=gamma, lam=lam, **options)


def _require(value, arg: str, name: str) -> None:
    if value is None:
        raise ValueError(f"advantage estimator {name!r} needs `{arg}`; pass {arg}=...")


def _sequence_scores(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Outcome score of each response: the sum of its counted token rewards, in float32 or wider."""
    rewards = token_rewards.to(torch.promote_types(token_rewards.dtype, torch.float32))
    return (rewards * mask.to(rewards.dtype)).sum(-1)


def _broadcast(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_sample.unsqueeze(-1) * mask.to(per_sample.dtype)


@register_adv_est("gae")
def gae_advantage(token_rewards, mask, *, values, index, gamma, lam, backend: str = "auto",
                  logp=None, ref_logp=None, kl_coef: float = 0.0, kl_kind: str = "k1", whiten=masked_whiten):
    """GAE with a critic; advantages whitened over the mask (by `whiten(x, mask)`: a batch sharded over DP ranks
    passes one that reduces over them), returns = unwhitened A + V."""
    _require(values, "values", "gae")
    advantages, returns = gae_scan(token_rewards, values, mask, gamma, lam, backend=backend, logp=logp,
                                   ref_logp=ref_logp, kl_coef=kl_coef, kl_kind=kl_kind)
    m = mask.to(advantages.dtype)
    return whiten(advantages, mask) * m, returns * m


@register_adv_est("grpo")
def grpo_advantage(token_rewards, mask, *, values, index, gamma, lam, norm_by_std: bool = True,
                   eps: float = GRPO_EPS, score_mask=None):
    """(score - group mean) / (group std + eps); norm_by_std=False is Dr.GRPO (no std division)."""
    _require(index, "index", "grpo")
    scores = _sequence_scores(token_rewards, mask if score_mask is None else score_mask)
    ids, num_groups = group_ids(index, len(scores), scores.device)
    mean, std, _ = group_mean_std(scores, ids, num_groups)
    advantage = (scores - mean) / (std + eps) if norm_by_std else scores - mean
    advantages = _broadcast(advantage, mask)
    return advantages, advantages


@register_adv_est("rloo")
def rloo_advantage(token_rewards, mask, *, values, index, gamma, lam, score_mask=None):
    """score_i minus the mean score of the other samples of its group (a group of one keeps its score)."""
    _require(index, "index", "rloo")
    scores = _sequence_scores(token_rewards, mask if score_mask is None else score_mask)
    ids, num_groups = group_ids(index, len(scores), scores.device)
    mean, _, size = group_mean_std(scores, ids, num_groups)
    # score - (sum - score) / (n - 1) == n / (n - 1) * (score - mean); mean is 0 for a group of one
    scale = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.ones_like(size))
    advantages = _broadcast(scale * (scores - mean), mask)
    return advantages, advantages


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus_advantage(token_rewards, mask, *, values, index, gamma, lam, backend: str = "auto",
                                  whiten=masked_whiten):
    """Discounted return G_t = r_t + gamma G_{t+1} over counted tokens, whitened over the batch (by `whiten(x, mask)`,
    as gae's)."""
    # GAE with V = 0 and lam = 1 is exactly the discounted return.
    returns, _ = gae_scan(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0, backend=backend)
    m = mask.to(returns.dtype)
    return whiten(returns, mask) * m, returns * m


@register_adv_est("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(token_rewards, mask, *, values, index, gamma, lam, whiten=masked_whiten,
                                           score_mask=None):
    """Score minus its group mean (0 for a group of one), broadcast over tokens, whitened over the batch (by
    `whiten(x, mask)`, as gae's)."""
    _require(index, "index", "reinforce_plus_plus_baseline")
    scores = _sequence_scores(token_rewards, mask if score_mask is None else score_mask)
    ids, num_groups = group_ids(index, len(scores), scores.device)
    mean, _, _ = group_mean_std(scores, ids, num_groups)
    m = mask.to(scores.dtype)
    advantages = whiten(_broadcast(scores - mean, mask), mask) * m
    return advantages, advantages
