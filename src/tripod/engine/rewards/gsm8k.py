"""GSM8K rule reward, following verl's published rules (verl/utils/reward_score/gsm8k.py, after ReFT, Trung et al.
2024).

Only the last 300 characters of the response are searched (both methods).
- strict: the last `#### N` (N = optional minus, then digits / '.' / ','); commas (and '$') are removed from N, which
  must then equal the ground truth exactly as a string. A '$' right after `#### ` therefore does not match
  ("#### $18" has no strict answer), exactly as in verl.
- flexible: the last number-like token in the text (ignoring bare '.' and ''), compared as a string as-is.
No answer found -> 0.0; an answer that differs -> `format_score`; a match -> `score`.
"""
from __future__ import annotations

import re
from typing import Optional

from tripod.engine.rewards.registry import register_reward

SOLUTION_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> Optional[str]:
    if method not in ("strict", "flexible"):
        raise ValueError(f"method={method!r} must be 'strict' or 'flexible'")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_FLEXIBLE.findall(tail)):
        if candidate not in ("", "."):
            return candidate
    return None


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == ground_truth else float(format_score)


@register_reward("openai/gsm8k", "gsm8k")
def gsm8k_reward(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Registry entry: the strict rule with score 1 / format score 0."""
    return compute_score(solution_str, ground_truth)
