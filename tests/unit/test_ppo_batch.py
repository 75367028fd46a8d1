"""The PPO step's batch layout: right padding, response positions, and mini-batch row sets."""
import pytest
import torch

from tripod.engine.workers.batch import build_ppo_batch, split_rows
from tripod.engine.workers.ppo_workers import _mini_batch_rows


def test_layout_and_response_positions():
    prompts, responses = [[5, 6, 7], [8]], [[1, 2], [3, 4, 9]]
    b = build_ppo_batch(prompts, responses, response_length=4, pad_token_id=0, index=[10, 11])
    assert b["input_ids"].tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert b["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    pos = b.response_positions()  # the position whose output predicts each response token
    for i, (p, r) in enumerate(zip(prompts, responses)):
        for t in range(len(r)):
            assert b["input_ids"][i, pos[i, t] + 1] == r[t]
    assert b.trimmed()["input_ids"].shape[1] == 5
    with pytest.raises(ValueError, match="response_length"):
        build_ppo_batch([[1]], [[1, 2, 3]], 2, 0, [0])


def test_mini_batches_partition_rows_and_shuffle_deterministically():
    b = build_ppo_batch([[1]] * 8, [[2]] * 8, 1, 0, list(range(8)))
    plain = _mini_batch_rows(b, 4, False, 0)
    assert plain == split_rows(8, 2)
    for epoch in (0, 1):
        rows = _mini_batch_rows(b, 4, True, epoch)
        assert sorted(torch.cat(rows).tolist()) == list(range(8))
        assert all(torch.equal(x, y) for x, y in zip(rows, _mini_batch_rows(b, 4, True, epoch)))
    assert not all(torch.equal(x, y) for x, y in zip(_mini_batch_rows(b, 4, True, 0), _mini_batch_rows(b, 4, True, 1)))
