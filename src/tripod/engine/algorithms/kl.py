"""KL between the policy and the reference model, in its two uses.

* reward shaping: `apply_kl_penalty` folds -beta * kl into the token rewards before advantages
  (PPO with a KL controller; beta from engine/algorithms/controllers.py),
* an actor loss term: `kl_loss` aggregates kl like any other loss (GRPO-style `use_kl_loss`).

The estimators themselves (k1/kl, abs, k2/mse, k3/low_var_kl) are the `tripod.kernels.kl` op.
"""
from __future__ import annotations

from typing import Callable

import torch

from tripod.engine.algorithms.losses import agg_loss
from tripod.engine.algorithms.masked import masked_mean
from tripod.kernels._triton_dispatch import check_mask
from tripod.kernels.kl_penalty import KL_KINDS
from tripod.kernels.kl_penalty import kl as kl_op


def list_kl_kinds() -> list[str]:
    return sorted(KL_KINDS)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str, *, backend: str = "auto") -> torch.Tensor:
    """Per-token KL estimate of `kind` (see `list_kl_kinds()`); differentiable w.r.t. logp and ref_logp."""
    return kl_op(logp, ref_logp, kind, backend=backend)


@torch.no_grad()
def apply_kl_penalty(
    token_rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
    mean: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = masked_mean,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_rewards - kl_coef * kl, mean kl over the mask). The mean kl feeds the KL controller; `mean(kl, mask)`
    computes it (a batch sharded over DP ranks passes one that reduces over them).

    When the shaped rewards go straight into GAE, `compute_advantage("gae", ..., logp=, ref_logp=,
    kl_coef=, kl_kind=)` fuses the same shaping into the scan instead.
    """
    kl = kl_penalty(logp, ref_logp, kind)
    check_mask(mask, kl.shape)
    if token_rewards.shape != kl.shape:
        raise ValueError(f"token_rewards has shape {tuple(token_rewards.shape)} but logp has shape "
                         f"{tuple(kl.shape)}; they must match")
    m = mask.to(kl.dtype)
    return token_rewards - kl_coef * kl * m, mean(kl, mask)


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "low_var_kl",
    agg: str = "token-mean",
    *,
    global_norm: float | torch.Tensor | None = None,
    backend: str = "auto",
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregated KL as an actor loss term (gradient flows to logp)."""
    return agg_loss(kl_penalty(logp, ref_logp, kind, backend=backend), mask, agg, global_norm,
                    loss_scale_factor=loss_scale_factor)
