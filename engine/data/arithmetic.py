"""Random arithmetic word-free problems ("What is 37 + 5?") in verl's prompt parquet layout.

A small, fully controllable task for fast PPO experiments: the base policy can be made to fail or succeed by the
number of digits / operands / operators, and the answer is checked exactly by the `#### N` rule reward
(engine.rewards.arithmetic). Division is only generated where it is exact, so every answer is an integer.
"""
from __future__ import annotations

import random
from typing import Any, Sequence

DATA_SOURCE = "arithmetic"
INSTRUCTION = 'Give only the final answer after "####", for example "#### 42".'
OPERATORS = ("+", "-", "*", "/")


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    digits = rng.randint(min_digits, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def make_problem(rng: random.Random, min_digits: int = 1, max_digits: int = 2, ops: Sequence[str] = ("+", "-"),
                 num_operands: int = 2, allow_negative: bool = True) -> tuple[str, int]:
    """One (expression, integer value) pair; * and / bind tighter than + and -, every division is exact."""
    while True:
        values, chosen = [_operand(rng, min_digits, max_digits)], []
        for _ in range(num_operands - 1):
            op, b = rng.choice(list(ops)), _operand(rng, min_digits, max_digits)
            if op == "/":
                b = max(b, 1)
                if not chosen or chosen[-1] in "+-":  # the dividend is a bare number: make it a multiple of b
                    values[-1] = b * rng.randint(0, (10 ** max_digits - 1) // b)
            chosen.append(op)
            values.append(b)
        value = _evaluate(values, chosen)
        if value is not None and (allow_negative or value >= 0):
            expression = " ".join([str(values[0])] + [f"{op} {v}" for op, v in zip(chosen, values[1:])])
            return expression, value


def _evaluate(values: list[int], ops: list[str]) -> int | None:
    """Integer evaluation with * and / binding tighter; None if a division is not exact."""
    terms, signs = [values[0]], []
    for op, v in zip(ops, values[1:]):
        if op in "*/":
            if op == "/" and (v == 0 or terms[-1] % v):
                return None
            terms[-1] = terms[-1] * v if op == "*" else terms[-1] // v
        else:
            terms.append(v)
            signs.append(op)
    total = terms[0]
    for op, t in zip(signs, terms[1:]):
        total = total + t if op == "+" else total - t
    return total


def make_arithmetic_rows(count: int, seed: int = 0, min_digits: int = 1, max_digits: int = 2,
                         ops: Sequence[str] = ("+", "-"), num_operands: int = 2, allow_negative: bool = True,
                         instruction: str = INSTRUCTION, split: str = "train",
                         format_score: float = 0.0) -> list[dict[str, Any]]:
    """`count` problems as parquet rows (prompt, data_source, ability, reward_model, extra_info)."""
    if count < 1:
        raise ValueError(f"count={count} must be >= 1")
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"need 1 <= min_digits <= max_digits, got min_digits={min_digits} max_digits={max_digits}")
    unknown = [op for op in ops if op not in OPERATORS]
    if unknown or not ops:
        raise ValueError(f"ops={list(ops)}: each must be one of {list(OPERATORS)}")
    if num_operands < 2:
        raise ValueError(f"num_operands={num_operands} must be >= 2")
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        expression, value = make_problem(rng, min_digits, max_digits, ops, num_operands, allow_negative)
        question = f"What is {expression}?"
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(value)},
            "extra_info": {"split": split, "index": index, "question": question, "expression": expression,
                           "format_score": float(format_score)},
        })
    return rows
