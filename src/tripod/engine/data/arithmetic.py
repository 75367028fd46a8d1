"""Random arithmetic word-free problems ("What is 37 + 5?") in verl's prompt parquet layout.

A small, fully controllable task for fast PPO experiments: the base policy can be made to fail or succeed by the
number of digits / operands / operators, and the answer is checked exactly by the `#### N` rule reward
(engine.rewards.arithmetic). Division is only generated where it is exact, so every answer is an integer.
"""
from __future__ import annotations

import random
from typing import Any, Collection, Sequence

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
                         instruction: str = INSTRUCTION, split: str = "train", format_score: float = 0.0,
                         exclude: Collection[str] = (), unique: bool = False) -> list[dict[str, Any]]:
    """`count` problems as parquet rows (prompt, data_source, ability, reward_model, extra_info).

    No row's expression is in `exclude` (e.g. a validation set's, so that validation measures held-out problems);
    with `unique`, no expression repeats. ValueError when the problem space is too small for that.
    """
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
    rows, banned, attempts = [], set(exclude), 0
    for index in range(count):
        while True:
            expression, value = make_problem(rng, min_digits, max_digits, ops, num_operands, allow_negative)
            if expression not in banned:
                break
            attempts += 1
            if attempts > 1000 * count:
                raise ValueError(f"cannot draw {count} problems ({'distinct, ' if unique else ''}outside the "
                                 f"{len(exclude)} excluded) with max_digits={max_digits}, ops={list(ops)}: the "
                                 "problem space is too small; ask for fewer or allow more digits")
        if unique:
            banned.add(expression)
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


def make_arithmetic_splits(train_count: int, test_count: int, seed: int = 0, train_format_score: float = 0.0,
                           **problem: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, test rows): `test_count` distinct test problems, none of which occurs in the training rows."""
    test = make_arithmetic_rows(test_count, seed=seed + 1, split="test", unique=True, **problem)
    held_out = {r["extra_info"]["expression"] for r in test}
    train = make_arithmetic_rows(train_count, seed=seed, split="train", format_score=train_format_score,
                                 exclude=held_out, **problem)
    return train, test
