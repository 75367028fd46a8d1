"""Rollout correction: the train / rollout mismatch (verl's `algorithm.rollout_correction`, slime's `--use-tis`).

The rollout engine samples from pi_rollout; the trainer's PPO ratio uses pi_old, the training engine's log-probs of
the same weights. They differ (other kernels, precision, a different engine). With r_t = pi_old / pi_rollout per
response token, log r_t = old_log_prob_t - rollout_log_prob_t, this module owns (verl's rollout_corr_helper
semantics, "decoupled" mode, computed once per PPO step from the recomputed old log-probs):

  * truncated importance sampling (`rollout_is`): the per-token PG loss is multiplied by a detached weight
      token:    w_t = min(exp(log r_t), threshold)
      sequence: w_t = min(exp(sum_s log r_s), threshold) for every token of the sequence (the product of its ratios)
    (log-ratios, and the sequence's summed log-ratio, are clamped to +-20 before exp, as in verl);
  * rejection (`rollout_rs`): sequences whose mean divergence leaves the bound drop out of the response mask
      seq_mean_k1: keep when log(1/threshold) <= mean_t(-log r_t) <= log(threshold)   (geometric-mean ratio)
      seq_mean_k3: keep when mean_t(exp(log r_t) - 1 - log r_t) <= threshold           (k3 KL estimator)
  * the mismatch metrics, over the unrejected response tokens: rollout_corr/kl = mean(rollout - old) (verl's
    direct KL(pi_rollout || pi_old) estimator), rollout_corr/k3_kl, rollout_corr/abs_diff_max and _mean (of
    |old - rollout|), rollout_corr/is_truncated_frac (tokens, or sequences, whose weight was clamped),
    rollout_corr/rollout_is_mean (of the applied weights), rollout_corr/rs_rejected_frac (share of sequences
    rejected) and rs_rejected_token_frac.

`bypass_mode` (old_log_probs := rollout_log_probs, no recompute) is wired in the trainer; it leaves nothing for this
module to correct (log r = 0), so the config refuses it together with `rollout_is` / `rollout_rs`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from tripod.engine.algorithms.masked import masked_mean

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_MODES = ("seq_mean_k1", "seq_mean_k3")
SAFETY_BOUND = 20.0  # |log-ratio| cap before exp, as verl (exp(20) ~ 4.9e8)


@dataclass
class Correction:
    """What one PPO step's correction hands the update: `is_weights` [N, R] (detached, 0 outside the mask; None
    without rollout_is), `response_mask` with the rejected sequences zeroed, and the `rollout_corr/*` metrics."""
    is_weights: torch.Tensor | None
    response_mask: torch.Tensor
    metrics: dict[str, float]


def _sequence_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(-1)


def _sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str,
               threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(truncated weights, raw weights), both [N, R], detached and 0 outside `mask`; see the module docstring."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is={level!r} is not one of {list(ROLLOUT_IS_LEVELS)}")
    log_ratio, mask = log_ratio.detach(), mask.to(log_ratio.dtype)
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        seq = _sequence_sum(log_ratio, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        raw = torch.exp(seq)[:, None].expand_as(log_ratio)
    raw = raw * mask
    return raw.clamp(max=threshold), raw


def rejection_keep(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str,
                   threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep [N] bool, the per-sequence statistic [N]) of rejection `mode`; see the module docstring."""
    mask = mask.to(log_ratio.dtype)
    safe = log_ratio.detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if mode == "seq_mean_k1":
        stat = _sequence_mean(-safe, mask)
        bound = math.log(threshold)
        return (stat >= -bound) & (stat <= bound), stat
    if mode == "seq_mean_k3":
        stat = _sequence_mean(torch.exp(safe) - 1.0 - safe, mask)
        return stat <= threshold, stat
    raise ValueError(f"rollout_rs={mode!r} is not one of {list(ROLLOUT_RS_MODES)}")


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> float:
    counted = mask > 0
    return float(x[counted].max()) if counted.any() else 0.0


def mismatch_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                     mean: Callable = masked_mean, max_of: Callable = _masked_max) -> dict[str, float]:
    """rollout_corr/{kl, k3_kl, abs_diff_max, abs_diff_mean} over the tokens of `mask`; `mean(x, mask)` and
    `max_of(x, mask)` reduce (a batch sharded over DP ranks passes ones that reduce over them)."""
    diff = (old_log_probs - rollout_log_probs).detach()
    safe = diff.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    abs_diff = diff.abs()
    return {"rollout_corr/kl": float(mean(-diff, mask)),
            "rollout_corr/k3_kl": float(mean(torch.exp(safe) - 1.0 - safe, mask)),
            "rollout_corr/abs_diff_max": float(max_of(abs_diff, mask)),
            "rollout_corr/abs_diff_mean": float(mean(abs_diff, mask))}


def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       rollout_is: str | None = None, rollout_is_threshold: float = 2.0, rollout_rs: str | None = None,
                       rollout_rs_threshold: float | None = None, mean: Callable = masked_mean,
                       max_of: Callable = _masked_max) -> Correction:
    """IS weights, rejection and metrics of one batch ([N, R] tensors aligned with the response tokens). The weights
    and the rejection are per row; the metrics reduce by `mean(x, mask)` (tokens, or rows with a [N] mask) and
    `max_of(x, mask)`: a batch sharded over DP rows passes ones that reduce over the ranks (engine/workers/
    row_shards.py), so every rank gets the whole batch's metrics."""
    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != response_mask.shape:
        raise ValueError(f"old_log_probs {tuple(old_log_probs.shape)}, rollout_log_probs "
                         f"{tuple(rollout_log_probs.shape)} and response_mask {tuple(response_mask.shape)} must match")
    log_ratio = (old_log_probs - rollout_log_probs).detach().float()
    mask = response_mask.to(log_ratio.dtype)
    nonempty = mask.sum(-1) > 0
    metrics = mismatch_metrics(old_log_probs.float(), rollout_log_probs.float(), mask, mean, max_of)
    weights = None
    if rollout_is is not None:
        weights, raw = is_weights(log_ratio, mask, rollout_is, rollout_is_threshold)
        clamped = (raw > rollout_is_threshold).float()
        if rollout_is == "token":
            truncated = mean(clamped, mask)
        else:  # one weight per sequence: the share of (non-empty) sequences
            truncated = mean(clamped.amax(-1), nonempty)
        metrics["rollout_corr/is_truncated_frac"] = float(truncated)
        metrics["rollout_corr/rollout_is_mean"] = float(mean(weights, mask))
    new_mask = response_mask
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold")
        keep, _ = rejection_keep(log_ratio, mask, rollout_rs, rollout_rs_threshold)
        rejected = ~keep & nonempty
        metrics["rollout_corr/rs_rejected_frac"] = float(mean(rejected.float(), nonempty))
        metrics["rollout_corr/rs_rejected_token_frac"] = float(mean(rejected[:, None].float().expand_as(mask), mask))
        new_mask = response_mask * keep[:, None].to(response_mask.dtype)
        if weights is not None:
            weights = weights * keep[:, None].to(weights.dtype)
    return Correction(weights, new_mask, metrics)


def correct_batch(batch, cfg, shards=None) -> dict[str, float]:
    """Apply `cfg` (algorithm.rollout_correction) to a PPO batch holding "old_log_probs", "rollout_log_probs" and
    "response_mask" (engine/workers/batch.py's PPOBatch): rejected sequences leave "response_mask", the IS weights
    go to "rollout_is_weights" (the actor's policy loss multiplies by them). Returns the rollout_corr/* metrics.
    `shards` (engine/workers/row_shards.py's RowShards): the batch holds this DP rank's rows only; the metrics reduce
    over the ranks and, after a rejection, every row's counted tokens are shared (`RowShards.recount`: the loss
    normalisers and the group estimators read them)."""
    reduce = {} if shards is None else {"mean": shards.masked_mean, "max_of": shards.masked_max}
    out = rollout_correction(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"],
                             cfg.rollout_is, cfg.rollout_is_threshold, cfg.rollout_rs, cfg.rollout_rs_threshold,
                             **reduce)
    if cfg.rollout_rs is not None:
        kept = bool(out.response_mask.any()) if shards is None else shards.recount(out.response_mask) > 0
        if not kept:  # decided alike on every rank (the sharded count is every row's)
            raise RuntimeError(f"algorithm.rollout_correction.rollout_rs={cfg.rollout_rs} rejected every sequence of "
                               f"this step (rollout_corr/kl={out.metrics['rollout_corr/kl']:.4g}, abs_diff_max="
                               f"{out.metrics['rollout_corr/abs_diff_max']:.4g}); raise algorithm.rollout_correction."
                               f"rollout_rs_threshold={cfg.rollout_rs_threshold} or find why the rollout engine's "
                               "log-probs differ this much from the actor's")
    batch["response_mask"] = out.response_mask
    if shards is not None:
        batch.shard = shards.batch_shard
    if out.is_weights is not None:
        batch["rollout_is_weights"] = out.is_weights
    return out.metrics
