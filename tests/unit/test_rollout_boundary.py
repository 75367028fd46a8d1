"""The rollout boundary's pure parts (engine/rollout/weight_sync.py): how a batch's prompts split over the rollout DP
replicas, and how the gathered responses join back in prompt order."""
from __future__ import annotations

import random

import pytest

from tripod.engine.rollout.weight_sync import join_replicas, replica_bounds


@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 7])
def test_replica_shares_cover_the_batch_in_order(replicas):
    rng = random.Random(replicas)
    for num_prompts in [0, 1, replicas - 1, replicas, rng.randint(replicas + 1, 97)]:
        bounds = replica_bounds(num_prompts, replicas)
        sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
        assert bounds[0] == 0 and bounds[-1] == num_prompts and len(sizes) == replicas
        assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1, sizes


def test_join_puts_every_replica_back_in_prompt_order():
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 5))] for _ in range(11)]
    replicas, ranks_per_replica, n = 3, 2, 2
    bounds = replica_bounds(len(prompts), replicas)
    # a stand-in rollout: the responses of a prompt are a function of the prompt (n per prompt, prompt-major)
    respond = lambda share: [p[::-1] + [k] for p in share for k in range(n)]  # noqa: E731
    gathered = [(rank // ranks_per_replica, respond(prompts[bounds[rank // ranks_per_replica]:
                                                           bounds[rank // ranks_per_replica + 1]]))
                for rank in range(replicas * ranks_per_replica)]
    rng.shuffle(gathered)  # all_gather_object's order is the ranks', not the replicas'
    assert join_replicas(gathered, replicas) == respond(prompts)
    with pytest.raises(RuntimeError, match=r"replica\(s\) \[1\]"):
        join_replicas([g for g in gathered if g[0] != 1], replicas)
