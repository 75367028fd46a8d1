"""RL algorithms: advantage estimators, KL penalties and controllers, PPO losses and aggregation.

Pure tensor code (needs only torch); the elementwise work runs on the fused ops in `kernels`. DAPO's dynamic sampling
(the group filter and the loop that refills the batch) is in `dynamic_sampling`, imported from there.
"""
from tripod.engine.algorithms.advantages import compute_advantage, list_adv_estimators, register_adv_est
from tripod.engine.algorithms.controllers import AdaptiveKLController, FixedKLController, build_kl_controller
from tripod.engine.algorithms.kl import apply_kl_penalty, kl_loss, kl_penalty, list_kl_kinds
from tripod.engine.algorithms.losses import AGG_MODES, agg_loss, agg_norm, entropy_loss, policy_loss, value_loss
from tripod.engine.algorithms.masked import masked_mean, masked_whiten

__all__ = [
    "compute_advantage", "list_adv_estimators", "register_adv_est",
    "FixedKLController", "AdaptiveKLController", "build_kl_controller",
    "kl_penalty", "apply_kl_penalty", "kl_loss", "list_kl_kinds",
    "AGG_MODES", "agg_loss", "agg_norm", "policy_loss", "value_loss", "entropy_loss",
    "masked_mean", "masked_whiten",
]
