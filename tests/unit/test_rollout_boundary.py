"""The rollout boundary's pure parts (engine/rollout/weight_sync.py): how a batch's prompts split over the rollout DP
replicas (how the rows come back in prompt order: tests/unit/test_rollout_exchange.py)."""
from __future__ import annotations

import random

import pytest

from tripod.engine.rollout.generators import replica_bounds


@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 7])
def test_replica_shares_cover_the_batch_in_order(replicas):
    rng = random.Random(replicas)
    for num_prompts in [0, 1, replicas - 1, replicas, rng.randint(replicas + 1, 97)]:
        bounds = replica_bounds(num_prompts, replicas)
        sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
        assert bounds[0] == 0 and bounds[-1] == num_prompts and len(sizes) == replicas
        assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1, sizes
