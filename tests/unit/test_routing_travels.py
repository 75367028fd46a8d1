"""The rollout's routed experts (R3) travel with the rows: through the rollout ranks' ScoredBatch bytes
(engine/async_rollout/messages.py) exactly, in their dtype, and through dynamic sampling's group selection and
concatenation (engine/algorithms/dynamic_sampling.py) with the rows they belong to."""
import torch

from tripod.engine.async_rollout.messages import ScoredBatch
from tripod.engine.data.dataset import PromptBatch
from tripod.engine.rollout.rows import Rollout, concat


def _batch(routed):
    return ScoredBatch(3, [[[0, 2]], [[0, 2]]], [7], [[5, 6, 7], [8]], [torch.tensor([-0.5, -1.0, -2.0]),
                       torch.tensor([-0.25])], ["stop", "length"], [1.0, 0.0], [1.0, -0.5], [0.0, -0.5],
                       {"reward/num_errors": 0.0}, {"offset": 4}, {"gen": 0.1}, 1, routed)


def test_scored_batch_carries_the_record_exactly():
    g = torch.Generator().manual_seed(0)
    for dtype, experts in ((torch.uint8, 254), (torch.int16, 300)):
        routed = [torch.randint(0, experts + 1, (n, 3, 2), generator=g).to(dtype) for n in (7, 4)]
        back = ScoredBatch.from_bytes(_batch(routed).to_bytes())
        assert [r.dtype for r in back.routed_experts] == [dtype, dtype]
        assert all(torch.equal(a, b) for a, b in zip(back.routed_experts, routed))
        assert back.responses == [[5, 6, 7], [8]] and back.run == 1 and back.loader_state == {"offset": 4}
        assert all(torch.equal(a, b) for a, b in zip(back.log_probs, _batch(None).log_probs))
    assert ScoredBatch.from_bytes(_batch(None).to_bytes()).routed_experts is None


def _rollout(tag: int, groups: int, n: int = 2) -> Rollout:
    rows = groups * n
    prompts = PromptBatch(input_ids=[[tag, g] for g in range(groups)], ground_truths=["1"] * groups,
                          data_sources=["d"] * groups, indices=list(range(groups)), extra_infos=[])
    return Rollout(prompts, [[tag, r] for r in range(rows)], [0.0] * rows, [0.0] * rows, [0.0] * rows, {},
                   [torch.zeros(2)] * rows, ["stop"] * rows, routed_experts=[torch.full((3, 1, 2), 10 * tag + r)
                                                                             for r in range(rows)])


def test_kept_groups_keep_their_own_record():
    kept = concat([_rollout(1, 3).groups([2], 2), _rollout(2, 2).groups([0, 1], 2)]).groups([0, 2], 2)
    assert kept.responses == [[1, 4], [1, 5], [2, 2], [2, 3]]
    assert [int(r[0, 0, 0]) for r in kept.routed_experts] == [14, 15, 22, 23]
