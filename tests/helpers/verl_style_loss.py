"""A policy loss written for verl 0.9.1 (its call, its config attributes, its `agg_loss(..., **config.global_batch_info)`)
registered with tripod's `register_policy_loss`: verl's own REINFORCE loss body (core_algos.compute_policy_loss_reinforce),
only the two imports changed. tests/multiprocess/test_custom_policy_loss.py trains with it by name. It also logs
actor/verl_style_calls (1 per micro-batch, which the actor weights into 1 per mini-batch) to show that it ran."""
import torch

from tripod.engine.algorithms import agg_loss, register_policy_loss
from tripod.engine.algorithms import masked_mean as verl_F_masked_mean


@register_policy_loss("verl_style_reinforce")
def compute_policy_loss_verl_style(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
):
    assert config is not None, "ActorConfig must be provided for REINFORCE loss"
    assert config.clip_ratio_low is not None and config.policy_loss.loss_mode == "verl_style_reinforce"
    if rollout_is_weights is not None:
        pg_losses = -advantages * log_prob * rollout_is_weights
    else:
        pg_losses = -advantages * log_prob
    pg_loss = agg_loss(
        loss_mat=pg_losses,
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        **config.global_batch_info,
    )
    negative_approx_kl = log_prob - old_log_prob
    kl_divergence = verl_F_masked_mean(-negative_approx_kl, response_mask)
    return pg_loss, {"actor/ppo_kl": kl_divergence.detach().item(), "actor/verl_style_calls": 1.0}
