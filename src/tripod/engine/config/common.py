"""Shared pieces of the config schema: the choices the sections offer and the check helpers."""
from __future__ import annotations

from typing import Any

OPTIMIZERS = ("adam", "sgd")  # megatron-core OptimizerConfig.optimizer
DEVICES = ("cpu", "cuda")
LR_DECAY_STYLES = ("constant", "linear", "cosine")  # of megatron's OptimizerParamScheduler styles, those offered
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
MOE_LOAD_BALANCING_TYPES = ("none", "aux_loss", "seq_aux_loss")  # megatron's moe_router_load_balancing_type
CRITIC_ESTIMATORS = ("gae",)  # the advantage estimators that read values: only these runs build a critic


def _choice(key: str, value: Any, allowed) -> list[str]:
    allowed = list(allowed)
    return [] if value in allowed else [f"{key}={value!r} is not one of {allowed}"]


def _positive(values: dict[str, int]) -> list[str]:
    """`values` maps full keys to values that must be positive integers."""
    return [f"{k}={v} must be a positive integer" for k, v in values.items() if v < 1]
