"""Arithmetic rule reward: the GSM8K strict extraction (last `#### N` in the last 300 characters, commas removed),
then a numeric comparison with the ground truth (so "#### 12.0" matches 12 and "#### -0" matches 0)."""
from __future__ import annotations

from decimal import Decimal, InvalidOperation

from tripod.engine.rewards.gsm8k import extract_solution
from tripod.engine.rewards.registry import register_reward


def _number(text: str) -> Decimal | None:
    try:
        value = Decimal(text.replace(",", "").strip())
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def compute_score(solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    answer = extract_solution(solution_str, "strict")
    if answer is None:
        return 0.0
    predicted, expected = _number(answer), _number(str(ground_truth))
    if expected is None:
        raise ValueError(f"arithmetic ground truth {ground_truth!r} is not a number")
    return float(score) if predicted is not None and predicted == expected else float(format_score)


@register_reward("arithmetic")
def arithmetic_reward(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Exact-match score; a sample's `extra_info.format_score` (default 0) credits a well-formed wrong answer."""
    return compute_score(solution_str, ground_truth, format_score=float((extra_info or {}).get("format_score", 0.0)))
