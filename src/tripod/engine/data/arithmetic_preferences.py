"""Preference pairs for reward-model training from the arithmetic problems (engine/data/arithmetic.py).

Each pair's `chosen` response is a correct answer in the form the `#### N` rule rewards (engine/rewards/arithmetic.py
scores it 1); its `rejected` one is wrong in one of several ways, so that only the rule separates the two:

- `wrong_number`: the chosen response's own form with a wrong value everywhere ("3 + 4 = 8 #### 8"): consistent and
  well-formed, so the model has to check the arithmetic, not the agreement of two numbers or the format;
- `wrong_after_marker`: the right equation but a wrong number after the marker ("3 + 4 = 7 #### 8"): the number
  the rule reads is the one after `####`;
- `no_marker`: the right value without the marker ("3 + 4 = 7", "7", "The answer is 7."): what SmolLM2 answers
  by itself, which the rule scores 0;
- `bad_marker`: the right value after a malformed marker ("####7", "### 7", "## 7"): the rule's form is exact.

Chosen responses take one of three forms (equation + marker, the marker alone, a sentence + marker) and a wrong
value is drawn from near misses (off by 1 or 2), an operand, the other operation's result or any small number, so
neither the length, the form nor the distance of the wrong number is a shortcut. The rows carry their problem's
`expression`: pairs made from held-out problems (the PPO validation set's) never share one with the training pairs.
"""
from __future__ import annotations

import random
from typing import Any, Callable, Sequence

KINDS = ("wrong_number", "wrong_after_marker", "no_marker", "bad_marker")


def _chosen_form(expression: str, value: int, rng: random.Random) -> Callable[[int], str]:
    """A response form whose number the caller fills in: the chosen one with the true value."""
    forms = [lambda v: f"{expression} = {v} #### {v}", lambda v: f"#### {v}", lambda v: f"The answer is {v}. #### {v}"]
    return rng.choices(forms, weights=(3, 1, 1))[0]


def _wrong_value(expression: str, value: int, rng: random.Random) -> int:
    """A wrong answer to `expression` (two operands), drawn from the mistakes a model makes."""
    a, op, b = expression.split()
    other = int(a) - int(b) if op == "+" else int(a) + int(b)
    candidates = {value + 1, value - 1, value + 2, value - 2, int(a), int(b), other, rng.randint(0, 18)}
    candidates.discard(value)
    return rng.choice(sorted(candidates))


def _rejected(kind: str, expression: str, value: int, form: Callable[[int], str], rng: random.Random) -> str:
    if kind == "wrong_number":
        return form(_wrong_value(expression, value, rng))
    if kind == "wrong_after_marker":
        return f"{expression} = {value} #### {_wrong_value(expression, value, rng)}"
    if kind == "no_marker":
        return rng.choice([f"{expression} = {value}", f"{value}", f"The answer is {value}."])
    if kind == "bad_marker":
        return rng.choice([f"{expression} = {value} ####{value}", f"{expression} = {value} ### {value}",
                           f"## {value}"])
    raise ValueError(f"unknown rejection kind {kind!r}; one of {list(KINDS)}")


def preference_rows(problems: Sequence[dict[str, Any]], pairs_per_problem: int, seed: int = 0,
                    kinds: Sequence[str] = KINDS,
                    prompt: Callable[[str], str] = lambda question: question) -> list[dict[str, Any]]:
    """`pairs_per_problem` preference rows for every distinct problem of `problems` (rows of
    `make_arithmetic_rows`: two operands, + or -), the rejection kinds taken in turn so that each is equally common.

    A row: prompt (`prompt(question)`, e.g. a rendered chat template), chosen, rejected, kind, expression, answer.
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds={list(kinds)}: each must be one of {list(KINDS)}")
    if pairs_per_problem < 1:
        raise ValueError(f"pairs_per_problem={pairs_per_problem} must be >= 1")
    rng, rows, seen, turn = random.Random(seed), [], set(), 0
    for problem in problems:
        info = problem["extra_info"]
        expression = info["expression"]
        if expression in seen:
            continue
        seen.add(expression)
        if len(expression.split()) != 3 or expression.split()[1] not in "+-":
            raise ValueError(f"problem {expression!r}: preference pairs are made for two-operand + and - problems")
        value = int(problem["reward_model"]["ground_truth"])
        for _ in range(pairs_per_problem):
            kind = kinds[turn % len(kinds)]
            turn += 1
            form = _chosen_form(expression, value, rng)
            rows.append({"prompt": prompt(info["question"]), "chosen": form(value),
                         "rejected": _rejected(kind, expression, value, form, rng), "kind": kind,
                         "expression": expression, "answer": str(value)})
    return rows
