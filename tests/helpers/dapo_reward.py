"""A rule reward that makes dynamic sampling's decisions a closed form of the data (tests/multiprocess/
test_config_keys.py): a prompt whose ground truth is even scores 1.0 for every response (a uniform group: dropped),
one whose ground truth is odd scores 0, 1, 0, 1, ... by call (inline scoring goes prompt-major, so its n = 2
responses always differ: kept). Import this module in the process that scores (rank 0) to register it."""
from __future__ import annotations

from tripod.engine.rewards import register_reward

DATA_SOURCE = "test_odd_alternates"
CALLS = [0]


@register_reward(DATA_SOURCE)
def odd_alternates(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    CALLS[0] += 1
    return 1.0 if int(ground_truth) % 2 == 0 else float(CALLS[0] % 2)


def kept_by_design(ground_truth: str) -> bool:
    """Whether dynamic sampling keeps this prompt's group under this reward."""
    return int(ground_truth) % 2 == 1
