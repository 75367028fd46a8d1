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
    their scores still count in their groups' statistics (the advantage estimators' `score_mask`), as verl's;
  * the `rollout_corr/*` metrics under verl's names (`mismatch_metrics`, `is_metrics`, `rejection_metrics`), over
    the response tokens before any rejection. The trainer logs `mismatch_metrics` on every step whose rollout
    returned log-probs: against the recomputed old log-probs here, else against the actor update's first forward
    (engine/workers/ppo_workers.py; exactly on-policy steps and bypass_mode).

`bypass_mode` (old_log_probs := rollout_log_probs, no recompute) is wired in the trainer; it leaves nothing for this
module to correct (log r = 0), so the config refuses it together with `rollout_is` / `rollout_rs`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from tripod.engine.algorithms.masked import masked_mean

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_MODES = ("seq_mean_k1", "seq_mean_k3")
SAFETY_BOUND = 20.0  # |log-ratio| cap before exp, as verl (exp(20) ~ 4.9e8)
Mean = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MaxOf = Callable[[torch.Tensor, torch.Tensor], float]


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
                     mean: Mean = masked_mean, max_of: MaxOf = _masked_max) -> dict[str, float]:
    """verl's off-policy metrics over the tokens of `mask` (per-sequence ones over every row, as verl's):
    training_ppl / rollout_ppl (mean over sequences of exp(-mean log-prob)), log_ppl_diff (mean over sequences of
    rollout minus old mean log-prob), kl = mean(rollout - old), k3_kl = mean(exp(log r) - 1 - log r), chi2_token =
    mean(r^2) - 1, chi2_seq = mean over sequences of (prod r)^2 - 1; and tripod's abs_diff_max / abs_diff_mean of
    |old - rollout|. `mean(x, mask)` and `max_of(x, mask)` reduce (tokens with an [N, R] mask, sequences with [N]):
    a batch split over DP ranks passes ones that reduce over them."""
    old, rollout = old_log_probs.detach().float(), rollout_log_probs.detach().float()
    m = mask.to(old.dtype)
    rows = torch.ones(m.shape[0], dtype=torch.bool, device=m.device)
    log_ratio = old - rollout
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_old, seq_rollout = _sequence_mean(old, m), _sequence_mean(rollout, m)
    seq_log_ratio = _sequence_sum(log_ratio, m).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    abs_diff = log_ratio.abs()
    out = {"training_ppl": mean(torch.exp(-seq_old), rows), "rollout_ppl": mean(torch.exp(-seq_rollout), rows),
           "log_ppl_diff": mean(seq_rollout - seq_old, rows), "kl": mean(-log_ratio, m),
           "k3_kl": mean(torch.exp(safe) - 1.0 - safe, m), "chi2_token": mean(torch.exp(2.0 * safe), m) - 1.0,
           "chi2_seq": mean(torch.exp(2.0 * seq_log_ratio), rows) - 1.0,
           "abs_diff_max": max_of(abs_diff, m), "abs_diff_mean": mean(abs_diff, m)}
    return {f"rollout_corr/{k}": float(v) for k, v in out.items()}


def is_metrics(log_ratio: torch.Tensor, raw: torch.Tensor, mask: torch.Tensor, level: str, threshold: float,
               mean: Mean = masked_mean, max_of: MaxOf = _masked_max) -> dict[str, float]:
    """verl's IS weight metrics of the raw (untruncated) weights `raw` [N, R]: rollout_is_mean over the tokens of
    `mask`, rollout_is_std there of the weights clamped to [1/threshold, threshold] (verl's, for stability);
    rollout_is_max / min and rollout_is_ratio_fraction_high / low (the share above threshold / below 1/threshold)
    of the tokens' weights, or with level sequence of every sequence's weight (an empty one's is 1)."""
    m = mask.to(raw.dtype)
    lower = 1.0 / threshold
    clamped = raw.clamp(lower, threshold)
    mu = mean(clamped, m)
    if level == "token":
        weight, counted = raw, m
    else:
        weight = torch.exp(_sequence_sum(log_ratio, m).clamp(-SAFETY_BOUND, SAFETY_BOUND))
        counted = torch.ones(m.shape[0], dtype=torch.bool, device=m.device)
    out = {"rollout_is_mean": float(mean(raw, m)), "rollout_is_max": max_of(weight, counted),
           "rollout_is_min": -max_of(-weight, counted),
           "rollout_is_std": math.sqrt(max(float(mean(clamped.square(), m) - mu.square()), 0.0)),
           "rollout_is_ratio_fraction_high": float(mean((weight > threshold).to(raw.dtype), counted)),
           "rollout_is_ratio_fraction_low": float(mean((weight < lower).to(raw.dtype), counted))}
    return {f"rollout_corr/{k}": v for k, v in out.items()}


def rejection_metrics(rejected: torch.Tensor, mask: torch.Tensor, mean: Mean = masked_mean) -> dict[str, float]:
    """verl's rejection shares of the rejected sequences `rejected` [N]: rollout_rs_masked_fraction over the response
    tokens of `mask`, rollout_rs_seq_masked_fraction over every sequence (verl's denominators)."""
    m = mask.float()
    every = torch.ones_like(rejected, dtype=torch.bool)
    return {"rollout_corr/rollout_rs_masked_fraction": float(mean(rejected[:, None].float().expand_as(m), m)),
            "rollout_corr/rollout_rs_seq_masked_fraction": float(mean(rejected.float(), every))}


def rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       rollout_is: str | None = None, rollout_is_threshold: float = 2.0, rollout_rs: str | None = None,
                       rollout_rs_threshold: float | None = None, mean: Mean = masked_mean,
                       max_of: MaxOf = _masked_max) -> Correction:
    """IS weights, rejection and metrics of one batch ([N, R] tensors aligned with the response tokens). The weights
    and the rejection are per row; the metrics reduce by `mean(x, mask)` (tokens, or rows with a [N] mask) and
    `max_of(x, mask)`: a batch sharded over DP rows passes ones that reduce over the ranks (engine/workers/
    row_shards.py), so every rank gets the whole batch's metrics."""
    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != response_mask.shape:
        raise ValueError(f"old_log_probs {tuple(old_log_probs.shape)}, rollout_log_probs "
                         f"{tuple(rollout_log_probs.shape)} and response_mask {tuple(response_mask.shape)} must match")
    log_ratio = (old_log_probs - rollout_log_probs).detach().float()
    mask = response_mask.to(log_ratio.dtype)
    metrics = mismatch_metrics(old_log_probs, rollout_log_probs, mask, mean, max_of)
    weights = None
    if rollout_is is not None:
        weights, raw = is_weights(log_ratio, mask, rollout_is, rollout_is_threshold)
        metrics.update(is_metrics(log_ratio, raw, mask, rollout_is, rollout_is_threshold, mean, max_of))
    new_mask = response_mask
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold")
        keep, _ = rejection_keep(log_ratio, mask, rollout_rs, rollout_rs_threshold)
        metrics.update(rejection_metrics(~keep & (mask.sum(-1) > 0), mask, mean))
        new_mask = response_mask * keep[:, None].to(response_mask.dtype)
        if weights is not None:
            weights = weights * keep[:, None].to(weights.dtype)
    return Correction(weights, new_mask, metrics)


def correct_batch(batch, cfg, shards=None) -> tuple[dict[str, float], int]:
    """Apply `cfg` (algorithm.rollout_correction) to a PPO batch holding "old_log_probs", "rollout_log_probs" and
    "response_mask" (engine/workers/batch.py's PPOBatch): rejected sequences leave "response_mask", the IS weights
    go to "rollout_is_weights" (the actor's policy loss multiplies by them). Returns (the rollout_corr/* metrics, the
    response tokens every row keeps: 0 when everything was rejected, the same on every rank).
    `shards` (engine/workers/row_shards.py's RowShards): the batch holds this DP rank's rows only; the metrics reduce
    over the ranks and, after a rejection, every row's counted tokens are shared (`RowShards.recount`: the loss
    normalisers and the group estimators read them)."""
    reduce = {} if shards is None else {"mean": shards.masked_mean, "max_of": shards.masked_max}
    out = rollout_correction(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"],
                             cfg.rollout_is, cfg.rollout_is_threshold, cfg.rollout_rs, cfg.rollout_rs_threshold,
                             **reduce)
    if shards is None:
        kept = int(out.response_mask.sum().round())
    elif cfg.rollout_rs is not None:
        kept = shards.recount(out.response_mask)
    else:
        kept = int(shards.lengths.response_lens.sum())
    if kept == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"algorithm.rollout_correction.rollout_rs={cfg.rollout_rs} rejected every sequence of this step "
              f"(rollout_corr/kl={out.metrics['rollout_corr/kl']:.4g}): the step updates nothing", flush=True)
    batch["response_mask"] = out.response_mask
    if shards is not None:
        batch.shard = shards.batch_shard
    if out.is_weights is not None:
        batch["rollout_is_weights"] = out.is_weights
    return out.metrics, kept


class GroupReduce:
    """`mean(x, mask)` / `max_of(x, mask)` for `mismatch_metrics` over rows split across the ranks of `group` (each row
    on one of them): sums and maxima all-reduced there."""

    def __init__(self, group, size: int) -> None:
        self.group, self.size = group, size

    def mean(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.bool()
        t = torch.stack([torch.where(m, x, 0).sum().double(), m.sum().double()])
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return (t[0] / t[1].clamp(min=1)).to(x.dtype)

    def max_of(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        t = torch.where(mask.bool(), x, float("-inf")).max().double().reshape(1) if x.numel() else \
            torch.full((1,), float("-inf"), dtype=torch.float64, device=x.device)
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t) if torch.isfinite(t).all() else 0.0
