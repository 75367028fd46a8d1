"""On-policy distillation's loss, as verl 0.9.1 computes it (verl/trainer/distillation/losses.py), on tripod's
split-invariant aggregation (`agg_loss` with the mini-batch's global normaliser, engine/algorithms/losses.py).

Per response token (the student's samples, the teacher's scores on them):
  estimator modes   kl_penalty(student log p, teacher log q, mode): k1 / kl = log p - log q, abs, k2 / mse, k3 /
                    low_var_kl (verl's kl_penalty, tripod's KL op)
  forward_kl_topk   sum over the teacher's top-k ids of q (log q - log p), log q and log p clamped from below at
                    log_prob_min_clamp when set, then clamped at 0 (the top-k masses do not sum to 1, so the sum can
                    be negative)
then distillation/loss_min|max over the counted tokens, then the clamp to [-loss_max_clamp, loss_max_clamp], then
either agg_loss (a supervised loss, backpropagated) or, with use_policy_gradient, a clipped PPO loss with advantages
-loss (detached). The actor's loss is policy_loss + coef * that with use_task_rewards, else that alone
(`combine`): verl then drops the whole PPO loss, its entropy and KL-loss terms included.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tripod.engine.algorithms.kl import kl_penalty
from tripod.engine.algorithms.losses import agg_loss, policy_loss
from tripod.engine.algorithms.masked import masked_mean


@dataclass
class TopkTerms:
    """forward_kl_topk's per-token pieces [B, T] (and the top-k overlap diagnostics, when the student's own top-k
    ids were given)."""
    loss: torch.Tensor
    student_mass: torch.Tensor
    teacher_mass: torch.Tensor
    overlap_count: torch.Tensor | None = None
    overlap_token_advantage: torch.Tensor | None = None


def forward_kl_topk(student_logp_at_ids: torch.Tensor, teacher_topk_logp: torch.Tensor,
                    teacher_topk_ids: torch.Tensor, log_prob_min_clamp: float | None = None,
                    student_topk_ids: torch.Tensor | None = None) -> TopkTerms:
    """Forward KL of the teacher's top-k (q) against the student (p) per token, from [B, T, k] log-probs at the
    teacher's ids, as verl's `_VocabParallelKLDivergence` (its gradient, m_A p - q on active entries, is what
    autograd gives through the clamps here). Before verl's clamp at 0."""
    q_log = teacher_topk_logp.detach().to(student_logp_at_ids.dtype)
    p_log = student_logp_at_ids
    if log_prob_min_clamp is not None:
        q_log = q_log.clamp_min(log_prob_min_clamp)
        p_log = p_log.clamp_min(log_prob_min_clamp)
    q = q_log.exp()
    per_id = q * (q_log - p_log)
    out = TopkTerms(per_id.sum(-1), p_log.detach().exp().sum(-1), q.sum(-1))
    if student_topk_ids is not None:
        overlap = (teacher_topk_ids.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(-1)
        count = overlap.sum(-1)
        adv = (-per_id.detach() * overlap).sum(-1) / count.clamp_min(1)
        out.overlap_count, out.overlap_token_advantage = count, torch.where(count > 0, adv, torch.zeros_like(adv))
    return out


def per_token_loss(mode: str, student_logp: torch.Tensor, teacher_logp: torch.Tensor | None = None,
                   topk: TopkTerms | None = None) -> torch.Tensor:
    """The per-token distillation loss [B, T] of `mode` (before verl's loss_max_clamp)."""
    if mode == "forward_kl_topk":
        assert topk is not None
        return topk.loss.clamp_min(0.0)
    assert teacher_logp is not None
    return kl_penalty(student_logp, teacher_logp.detach().to(student_logp.dtype), mode)


def distillation_loss(losses: torch.Tensor, mask: torch.Tensor, loss_cfg, agg: str, global_norm,
                      student_logp: torch.Tensor, old_logp: torch.Tensor,
                      rollout_is_weights: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(aggregated distillation loss, metrics) from per-token `losses` [B, T] (`per_token_loss`): the clamp, then a
    supervised agg_loss or, with use_policy_gradient, the clipped policy loss on advantages -losses (its metrics
    as distillation/pg_clipfrac, ...: token means over this batch's mask, to be weighted as the actor's are).
    Also distillation/loss_min|max (before the clamp, as verl) over the counted tokens."""
    counted = mask.bool()
    metrics: dict[str, torch.Tensor] = {}
    if counted.any():
        metrics["distillation/loss_min"] = losses.detach()[counted].min()
        metrics["distillation/loss_max"] = losses.detach()[counted].max()
    if loss_cfg.loss_max_clamp is not None:  # the min side for k1, which can be negative
        losses = losses.clamp(min=-loss_cfg.loss_max_clamp, max=loss_cfg.loss_max_clamp)
    if loss_cfg.use_policy_gradient:
        low, high = loss_cfg.clip_range()
        loss, m = policy_loss(old_logp, student_logp, -losses.detach(), mask, low, high, 3.0, agg,
                              global_norm=global_norm, weights=rollout_is_weights)
        metrics.update({f"distillation/{k}": v for k, v in m.items()})
        return loss, metrics
    return agg_loss(losses, mask, agg, global_norm), metrics


def combine(task_loss: torch.Tensor, distill: torch.Tensor, loss_cfg) -> torch.Tensor:
    """The actor's loss: the task's (policy + entropy + KL-loss terms) plus coef x distillation with
    use_task_rewards, else the distillation loss alone at coefficient 1 (verl's distillation_ppo_loss)."""
    if loss_cfg.use_task_rewards:
        return task_loss + loss_cfg.distillation_loss_coef * distill
    return distill


def topk_metrics(terms: TopkTerms, mask: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """verl's forward_kl_topk diagnostics over this batch's counted tokens (token means, weighted by the caller):
    the student's and teacher's mass on the teacher's top-k, and with the student's top-k ids the overlap ratio
    (|teacher top-k & student top-k| / k) and the mean per-id advantage -q (log q - log p) on overlapping ids."""
    out = {"distillation/student_mass": masked_mean(terms.student_mass.detach(), mask),
           "distillation/teacher_mass": masked_mean(terms.teacher_mass.detach(), mask)}
    if terms.overlap_count is not None and terms.overlap_token_advantage is not None:
        out["distillation/overlap_ratio"] = masked_mean(terms.overlap_count.float(), mask) / k
        has = mask.bool() & (terms.overlap_count > 0)
        out["distillation/overlap_token_advantage"] = masked_mean(terms.overlap_token_advantage, has) \
            if has.any() else torch.zeros((), device=mask.device)
    return out
