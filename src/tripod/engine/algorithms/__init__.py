"""RL algorithms: advantage estimators, KL penalties and controllers, policy losses (verl's registry) and aggregation.

Pure tensor code (needs only torch); the elementwise work runs on the fused ops in `kernels`. DAPO's dynamic sampling
(the group filter and the loop that refills the batch) is in `dynamic_sampling`, imported from there.
"""
from tripod.engine.algorithms.advantages import compute_advantage, list_adv_estimators, register_adv_est
from tripod.engine.algorithms.controllers import AdaptiveKLController, FixedKLController, build_kl_controller
from tripod.engine.algorithms.kl import apply_kl_penalty, kl_loss, kl_penalty, list_kl_kinds
from tripod.engine.algorithms.losses import AGG_MODES, agg_loss, agg_norm, entropy_loss, policy_loss, value_loss
from tripod.engine.algorithms.masked import masked_mean, masked_whiten
from tripod.engine.algorithms.policy_losses import (
    get_policy_loss_fn,
    global_batch_info,
    list_policy_losses,
    register_policy_loss,
    verl_actor_config,
    weighted_policy_metrics,
)
from tripod.engine.algorithms.verl_estimators import (  # registers verl's other estimators
    OUTCOME_GROUP_ESTIMATORS,
    REFUSED_ESTIMATORS,
    estimator_options,
)

__all__ = [
    "compute_advantage", "list_adv_estimators", "register_adv_est",
    "OUTCOME_GROUP_ESTIMATORS", "REFUSED_ESTIMATORS", "estimator_options",
    "FixedKLController", "AdaptiveKLController", "build_kl_controller",
    "kl_penalty", "apply_kl_penalty", "kl_loss", "list_kl_kinds",
    "AGG_MODES", "agg_loss", "agg_norm", "policy_loss", "value_loss", "entropy_loss",
    "masked_mean", "masked_whiten",
    "register_policy_loss", "get_policy_loss_fn", "list_policy_losses", "verl_actor_config",
    "global_batch_info", "weighted_policy_metrics",
]
