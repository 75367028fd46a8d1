"""Rollout (generation) for PPO: one interface, two backends (embedded TP decoder, SGLang).

See engine/rollout/base.py for the interface, engine/rollout/factory.py for picking a backend and
docs/rollout.md for the design.
"""
from tripod.engine.rollout.base import (
    FINISH_LENGTH,
                                 FINISH_STOP,
                                 ROLLOUT_NAMES,
                                 RolloutEngine,
                                 RolloutOutput,
                                 SamplingParams,
                                 validate_rollout_tp,
)
from tripod.engine.rollout.factory import make_rollout_engine

__all__ = ["FINISH_LENGTH", "FINISH_STOP", "ROLLOUT_NAMES", "RolloutEngine", "RolloutOutput", "SamplingParams",
           "make_rollout_engine", "validate_rollout_tp"]
