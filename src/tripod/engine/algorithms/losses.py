"""PPO actor / critic losses and the loss aggregation that makes them split-invariant.

`agg_loss(loss_mat, loss_mask, loss_agg_mode, global_norm)` reduces a per-token loss [B, T] (verl 0.9.1's five modes
and argument names):
  token-mean              sum over all counted tokens            / number of counted tokens
  token-sum               sum over all counted tokens              (no normaliser)
  seq-mean-token-sum      sum over sequences of (token sum)      / number of sequences
  seq-mean-token-mean     sum over sequences of (token mean)     / number of sequences
  seq-mean-token-sum-norm seq-mean-token-sum                     / loss_scale_factor (default: the horizon T)
(a "sequence" is a row with at least one counted token; all-masked rows contribute nothing).

Split invariance. Without `global_norm` the normaliser is local, so a micro-batch returns its own
mean and means of means depend on how the batch was split. With `global_norm` = the normaliser of
the whole global batch (sum of `agg_norm(mask, agg)` over every micro-batch on every DP rank),
each micro-batch returns sum / global_norm; these are parts of one sum, so the global loss is the
SUM of the micro-batch losses over micro-batches and DP ranks, and so is its gradient, whatever the
split. seq-mean-token-sum-norm's horizon must be the global batch's too: a trimmed micro-batch (use_dynamic_bsz) is
narrower than the batch, so callers pass `loss_scale_factor` (the actor passes actor.loss_scale_factor, else the
batch's response width). verl's keywords do the same job: `batch_num_tokens` (token-mean) or `global_batch_size`
(seq-mean-*) replace the local normaliser and the result is multiplied by `dp_size` (verl's compensation for DDP's
gradient averaging; tripod's actor passes dp_size 1 because its loss scale undoes that averaging itself, below).
A trainer therefore needs gradients summed, not averaged:
  * Megatron (calculate_per_token_loss=False): the pipeline schedule scales a 2-tuple loss by
    cp_size / num_microbatches and DDP scales gradients by 1 / (dp_size * cp_size), so the loss
    function returns loss * num_microbatches * dp_size to get the plain sum (the cp factors
    cancel; with CP each rank's global_norm still counts the whole global batch);
  * plain torch DDP averages over ranks: scale by dp_size; plain accumulation sums already.
"""
from __future__ import annotations

import torch

from tripod.engine.algorithms.masked import masked_mean
from tripod.kernels._triton_dispatch import check_mask
from tripod.kernels.ppo_losses import policy_loss_per_token as policy_loss_op
from tripod.kernels.ppo_losses import value_loss_per_token as value_loss_op

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # normalised by sequences


def _check_agg(agg: str) -> None:
    if agg not in AGG_MODES:
        raise ValueError(f"agg={agg!r} is not a loss aggregation mode; choose one of {AGG_MODES}")


def agg_norm(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """This batch's share of the normaliser: counted tokens (token-mean; token-sum too, which divides by nothing and
    ignores it) or non-empty rows (seq-mean-*).

    Sum it over micro-batches and all_reduce(SUM) it over DP ranks to get `global_norm`.
    """
    _check_agg(agg)
    counted = mask.to(torch.float32)
    if agg not in SEQ_MODES:
        return counted.sum()
    return (counted.sum(-1) > 0).to(torch.float32).sum()


def horizon(loss_mask: torch.Tensor, loss_scale_factor: float | None) -> float:
    """seq-mean-token-sum-norm's constant divisor: `loss_scale_factor`, else the mask's width (verl's default)."""
    return float(loss_mask.shape[-1]) if loss_scale_factor is None else float(loss_scale_factor)


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str,
             global_norm: float | torch.Tensor | None = None, *, dp_size: int = 1,
             batch_num_tokens: float | torch.Tensor | None = None,
             global_batch_size: float | torch.Tensor | None = None,
             loss_scale_factor: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] over `loss_mask` by `loss_agg_mode`; see the module docstring for global_norm
    and verl's keywords (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: verl's
    `config.global_batch_info`, so a verl loss's `agg_loss(..., **config.global_batch_info)` runs here unchanged)."""
    agg = loss_agg_mode
    _check_agg(agg)
    check_mask(loss_mask, loss_mat.shape)
    m = loss_mask.to(loss_mat.dtype)
    token_sums = (loss_mat * m).sum(-1)
    if agg == "seq-mean-token-mean":
        total = (token_sums / m.sum(-1).clamp(min=1)).sum()
    else:  # the other modes share the numerator; their normalisers differ
        total = token_sums.sum()
    if agg == "token-sum":
        return total * dp_size
    verl_norm = global_batch_size if agg in SEQ_MODES else batch_num_tokens
    if verl_norm is not None:
        global_norm = verl_norm
    elif global_norm is None:
        global_norm = agg_norm(loss_mask, agg)
    global_norm = torch.as_tensor(global_norm, dtype=loss_mat.dtype, device=loss_mat.device)
    loss = total / global_norm.clamp(min=1) * dp_size
    if agg == "seq-mean-token-sum-norm":
        loss = loss / horizon(loss_mask, loss_scale_factor)
    return loss


def policy_loss(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    agg: str = "token-mean",
    *,
    global_norm: float | torch.Tensor | None = None,
    backend: str = "auto",
    weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO policy loss (dual clip for A < 0) -> (loss, metrics).

    `weights` [B, T] (rollout correction's truncated IS weights, engine/algorithms/rollout_correction.py) multiply
    the per-token loss before aggregation, detached.
    metrics (detached, token means over this batch's mask): pg_clipfrac (ratio clipped),
    pg_clipfrac_lower (dual clip active), ppo_kl (mean of old_logp - logp, log-ratio clamped to 20).
    """
    _check_agg(agg)
    loss_mat, clipped, clipped_lower = policy_loss_op(old_logp, logp, advantages, clip_low, clip_high, clip_c,
                                                      backend=backend)
    check_mask(mask, loss_mat.shape)
    if weights is not None:
        loss_mat = loss_mat * weights.detach().to(loss_mat.dtype)
    loss = agg_loss(loss_mat, mask, agg, global_norm, loss_scale_factor=loss_scale_factor)
    with torch.no_grad():
        neg_log_ratio = (old_logp.float() - logp.float()).clamp(-20.0, 20.0)
        metrics = {
            "pg_clipfrac": masked_mean(clipped.float(), mask),
            "pg_clipfrac_lower": masked_mean(clipped_lower.float(), mask),
            "ppo_kl": masked_mean(neg_log_ratio, mask),
        }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.5,
    agg: str = "token-mean",
    *,
    global_norm: float | torch.Tensor | None = None,
    backend: str = "auto",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss 0.5 max((v-R)^2, (clip(v, V_old +- clip) - R)^2) -> (loss, {vf_clipfrac})."""
    _check_agg(agg)
    loss_mat, clipped = value_loss_op(values, returns, old_values, clip, backend=backend)
    check_mask(mask, loss_mat.shape)
    loss = agg_loss(loss_mat, mask, agg, global_norm, loss_scale_factor=loss_scale_factor)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean(clipped.float(), mask)}
    return loss, metrics


def entropy_loss(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    *,
    global_norm: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregated entropy; the actor subtracts entropy_coef * this (an entropy bonus)."""
    return agg_loss(entropy, mask, agg, global_norm, loss_scale_factor=loss_scale_factor)
