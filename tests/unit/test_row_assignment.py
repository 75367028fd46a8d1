"""The step's row assignment (engine/workers/ppo_workers.py `update_rows`, which the forward passes follow so that
their outputs stay on their DP rank): on a stand-in worker, each DP rank's rows are exactly the rows the update's
mini-batches give that rank (`_split_mini_batch`, mini-batch by mini-batch, as `run_ppo_epochs` walks them), the
ranks' rows partition the batch, and a shuffle that changes the mini-batches per epoch has no fixed assignment. A rank
whose batch holds only its rows (`PPOBatch.shard`) cuts each mini-batch into the same micro-batches, with the same loss
normaliser, token count and scale, as the rank holding the whole batch."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.unit.test_token_budget import _batch
from tripod.engine.workers import ppo_workers
from tripod.engine.workers.batch import BatchShard, RowLengths, split_rows

DENSE = SimpleNamespace(config=SimpleNamespace(num_moe_experts=None))  # a dense model: no token exchange


def _worker(dp: int, dp_rank: int, pack: bool) -> SimpleNamespace:
    return SimpleNamespace(share_prompt_prefix=pack, can_pack=True, model=[None], remove_padding=False,
                           layout=SimpleNamespace(pp=1, dp=dp, dp_rank=dp_rank), module=DENSE, device=torch.device("cpu"),
                           dp_rows=lambda n: split_rows(n, dp)[dp_rank])


def _cfg(dynamic: bool, shuffle: bool, epochs: int = 1) -> SimpleNamespace:
    return SimpleNamespace(use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=120, ppo_micro_batch_size_per_gpu=2,
                           loss_agg_mode="token-mean", shuffle=shuffle, ppo_epochs=epochs, ppo_mini_batch_size=2)


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("pack", [False, True])
def test_each_rank_forwards_the_rows_its_update_gets(dp, dynamic, shuffle, pack):
    n = 2
    batch = _batch(11, prompts=8, n=n)
    cfg = _cfg(dynamic, shuffle)
    held = []
    for rank in range(dp):
        worker = _worker(dp, rank, pack)
        updated = []
        for rows in ppo_workers._mini_batch_rows(batch, cfg.ppo_mini_batch_size * n, cfg.shuffle, 0):
            micro, *_ = ppo_workers._split_mini_batch(worker, batch.select(rows), cfg)
            updated += [i for mb in micro for i in mb["row"].tolist()]
        assert ppo_workers.update_rows(worker, batch, cfg, n) == sorted(updated)
        held += updated
    assert sorted(held) == list(range(batch.size))  # every row on exactly one DP rank


def test_a_shuffle_over_several_epochs_has_no_fixed_assignment():
    batch = _batch(3, prompts=8, n=2)
    assert ppo_workers.update_rows(_worker(2, 0, False), batch, _cfg(False, True, epochs=2), 2) is None
    assert ppo_workers.update_rows(_worker(2, 0, False), batch, _cfg(False, False, epochs=2), 2) is not None


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_a_rank_holding_only_its_rows_updates_like_one_holding_all(dp, dynamic, shuffle, agg):
    n = 2
    batch = _batch(5, prompts=8, n=n)
    batch.tensors["response_mask"][3] = 0.0  # an empty response: it counts in no normaliser
    cfg = _cfg(dynamic, shuffle)
    cfg.loss_agg_mode = agg
    every = RowLengths.of(batch)
    for rank in range(dp):
        worker = _worker(dp, rank, pack=True)
        rows = ppo_workers.update_rows(worker, every, cfg, n)
        assert rows == ppo_workers.update_rows(worker, batch, cfg, n)  # from the lengths alone
        mine = batch.select(rows)
        mine.shard = BatchShard(rows, every)
        assert mine.size == len(rows) < batch.size
        for ids in ppo_workers._mini_batch_rows(every, cfg.ppo_mini_batch_size * n, cfg.shuffle, 0):
            want = ppo_workers._split_mini_batch(worker, batch.select(ids), cfg)
            got = ppo_workers._split_mini_batch(worker, ppo_workers._sharded_mini_batch(mine, ids), cfg)
            assert [mb["row"].tolist() for mb in got[0]] == [mb["row"].tolist() for mb in want[0]]
            for mb_got, mb_want in zip(got[0], want[0]):
                assert all(torch.equal(mb_got[k], mb_want[k]) for k in mb_want.tensors)
            assert [float(x) for x in got[1:3]] == [float(x) for x in want[1:3]] and got[3] == want[3]
            assert got[1].dtype == want[1].dtype and got[2].dtype == want[2].dtype


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("pack", [False, True])
def test_a_rejection_moves_the_assignment_only_where_the_split_reads_counted_tokens(dp, dynamic, pack):
    """Rollout correction's rejection zeroes rows' counted tokens after the rows have moved (`RowShards.recount`), so
    the batch stays sharded under it only where the update's DP split does not read them
    (`assignment_reads_counted_tokens`, which plan_row_shards asks): there every rank's rows stay as they were; where
    it does read them, some rejection moves rows to another rank (the rule is needed)."""
    n = 2
    cfg = _cfg(dynamic, shuffle=False)
    cfg.ppo_mini_batch_size = 4  # 4 prompt groups a mini-batch: whole groups per rank at DP4 too
    reads = ppo_workers.assignment_reads_counted_tokens(_worker(dp, 0, pack), cfg)
    moved = False
    for seed in range(6):
        every = RowLengths.of(_batch(seed, prompts=8, n=n))
        for k in (2, 3):
            kept = (torch.arange(every.size) + seed) % k != 0
            rejected = RowLengths(every.prompt_lens, every.response_lens * kept, every.seq_lens, every.index)
            moved |= any(ppo_workers.update_rows(_worker(dp, r, pack), every, cfg, n)
                         != ppo_workers.update_rows(_worker(dp, r, pack), rejected, cfg, n) for r in range(dp))
    assert moved == reads, (moved, reads)
