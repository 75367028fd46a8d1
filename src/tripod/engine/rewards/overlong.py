"""DAPO's overlong reward shaping ("soft overlong punishment", Yu et al. 2025, eq. 13; verl's DAPO reward manager).

With the longest allowed response L_max (actor_rollout_ref.rollout.response_length) and a buffer of L_cache tokens
(reward_model.overlong_buffer.len), a response of |y| tokens (its EOS counted, as verl's valid response length)
gets

    penalty(|y|) = min(0, -(|y| - (L_max - L_cache)) / L_cache * penalty_factor)

added to its sequence reward: 0 up to L_max - L_cache tokens, then linearly down to -penalty_factor at L_max. Only
training rollouts are shaped; validation reports the rule reward alone.
"""
from __future__ import annotations

from typing import Any, Sequence


def overlong_penalty(length: int, max_response_length: int, buffer_len: int, penalty_factor: float) -> float:
    """The penalty (<= 0) of a response of `length` tokens; see the module docstring."""
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"reward_model.overlong_buffer.len={buffer_len} must be in (0, {max_response_length}] "
                         "(actor_rollout_ref.rollout.response_length)")
    exceed = length - (max_response_length - buffer_len)
    return min(0.0, -exceed / buffer_len * penalty_factor)


class OverlongShaper:
    """`overlong_penalty` of each response of a rollout when `cfg.enable` (reward_model.overlong_buffer), else 0."""

    def __init__(self, cfg: Any, max_response_length: int) -> None:
        self.enable = bool(cfg.enable)
        self.buffer_len, self.penalty_factor = (int(cfg.len), float(cfg.penalty_factor)) if self.enable else (0, 0.0)
        self.max_response_length = int(max_response_length)

    def penalties(self, lengths: Sequence[int]) -> list[float]:
        """One penalty (<= 0) per response length; all 0 when shaping is off."""
        if not self.enable:
            return [0.0] * len(lengths)
        return [overlong_penalty(n, self.max_response_length, self.buffer_len, self.penalty_factor) for n in lengths]

    def metrics(self, penalties: Sequence[float]) -> dict[str, float]:
        """reward/overlong_penalty_mean (mean penalty, <= 0) and reward/overlong_frac (share of responses
        penalised) of a training batch; none when shaping is off."""
        if not self.enable:
            return {}
        count = max(len(penalties), 1)
        return {"reward/overlong_penalty_mean": sum(penalties) / count,
                "reward/overlong_frac": sum(p < 0 for p in penalties) / count}
