"""A rule reward a randomly initialised model can learn by RL: the share of the response's characters that equal a
target character (the sample's ground truth, e.g. "7"). A random character-level policy starts near 1/vocab and
the reward rises as the policy concentrates on the target; used by the tiny CPU MoE recipe
(recipes/deepseek/tiny-v3-cpu.yaml, scripts/make_tiny_moe.py)."""
from __future__ import annotations

from tripod.engine.rewards.registry import register_reward


@register_reward("target_char")
def target_char_reward(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Fraction of `solution_str`'s characters equal to `ground_truth` (one character); 0 for an empty response."""
    if len(ground_truth) != 1:
        raise ValueError(f"target_char ground truth {ground_truth!r} must be one character")
    return solution_str.count(ground_truth) / len(solution_str) if solution_str else 0.0
