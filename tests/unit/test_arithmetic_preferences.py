"""The arithmetic preference pairs of `make demo-rm` (engine/data/arithmetic_preferences.py): the rule reward scores
every chosen response 1 and every rejected one 0, every rejection kind occurs, and the pairs of held-out problems
share no problem with the training pairs."""
import collections

import pytest

from tripod.engine.data import make_arithmetic_splits
from tripod.engine.data.arithmetic_preferences import KINDS, preference_rows
from tripod.engine.rewards.arithmetic import arithmetic_reward

PROBLEM = dict(min_digits=1, max_digits=1, ops=("+", "-"), allow_negative=False, instruction="")


@pytest.fixture(scope="module")
def pairs():
    train, held_out = make_arithmetic_splits(512, 48, seed=0, **PROBLEM)
    return preference_rows(train, 4, seed=1), preference_rows(held_out, 2, seed=2)


def test_chosen_is_correct_and_rejected_wrong_by_the_rule(pairs):
    for row in pairs[0] + pairs[1]:
        assert arithmetic_reward(row["chosen"], row["answer"]) == 1.0, row
        assert arithmetic_reward(row["rejected"], row["answer"]) == 0.0, row
        assert row["chosen"] != row["rejected"]
        a, op, b = row["expression"].split()
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_every_kind_is_equally_common_and_a_problem_has_one_pair_of_each(pairs):
    train = pairs[0]
    assert collections.Counter(r["kind"] for r in train) == {k: len(train) // 4 for k in KINDS}
    by_problem = collections.defaultdict(set)
    for r in train:
        by_problem[r["expression"]].add(r["kind"])
    assert all(kinds == set(KINDS) for kinds in by_problem.values())
    wrong = [r for r in train if r["kind"] == "wrong_number"]  # the rejected keeps the chosen's form
    assert all(r["rejected"].startswith(r["expression"]) == r["chosen"].startswith(r["expression"]) for r in wrong)


def test_held_out_pairs_share_no_problem_with_the_training_pairs(pairs):
    train, held_out = pairs
    train_problems, held_problems = {r["expression"] for r in train}, {r["expression"] for r in held_out}
    assert len(held_problems) == 48 and len(held_out) == 96
    assert not train_problems & held_problems
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


def test_a_problem_repeated_in_the_prompts_gives_its_pairs_once_and_the_prompt_is_rendered():
    train, _ = make_arithmetic_splits(64, 4, seed=3, **PROBLEM)
    rows = preference_rows(train + train, 1, prompt=lambda q: f"<user>{q}<assistant>")
    assert len(rows) == len({r["extra_info"]["expression"] for r in train})
    assert all(r["prompt"].startswith("<user>What is ") for r in rows)
    with pytest.raises(ValueError, match="kinds"):
        preference_rows(train, 1, kinds=("typo",))
