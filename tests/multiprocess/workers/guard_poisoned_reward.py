"""torchrun worker: `tripod train` in-process with a reward function that scores NaN during one chosen step
(calls POISON_FROM < k <= POISON_TO of the scorer on rank 0), for the divergence-guard tests.

usage: torchrun ... guard_poisoned_reward.py key=value ...   (env POISON_FROM / POISON_TO)
"""
import os
import sys

from tripod.engine.cli import main
from tripod.engine.rewards import register_reward
from tripod.engine.rewards.arithmetic import arithmetic_reward

CALLS = [0]
LO, HI = int(os.environ["POISON_FROM"]), int(os.environ["POISON_TO"])


@register_reward("poisoned_arithmetic")
def poisoned_reward(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    CALLS[0] += 1
    if LO < CALLS[0] <= HI:
        return float("nan")
    return arithmetic_reward(solution_str, ground_truth, extra_info=extra_info)


if __name__ == "__main__":
    sys.exit(main(["train", "recipes/defaults.yaml", *sys.argv[1:]]))
