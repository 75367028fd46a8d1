"""Token-budget micro-batches (use_dynamic_bsz) of engine/workers/ppo_workers.py, on a stand-in worker: a prompt's
rows stay together when packing shares the prompt, a group over the budget runs as single rows, every row lands in
exactly one micro-batch and per-row results go back to their rows, the DP ranks split prompt groups evenly."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from tripod.engine.workers import ppo_workers
from tripod.engine.workers.batch import build_ppo_batch


def _worker(pack: bool, pp: int = 1, chunks: int = 1, dp: int = 1, dp_rank: int = 0,
            remove_padding: bool = False) -> SimpleNamespace:
    return SimpleNamespace(share_prompt_prefix=pack, can_pack=True, model=[None] * chunks, remove_padding=remove_padding,
                           layout=SimpleNamespace(pp=pp, dp=dp, dp_rank=dp_rank), device=torch.device("cpu"),
                           module=SimpleNamespace(config=SimpleNamespace(num_moe_experts=None)))  # dense: no token exchange


def _batch(seed: int, prompts: int, n: int):
    rng = random.Random(seed)
    ps = [[rng.randrange(1, 50) for _ in range(rng.randint(5, 40))] for _ in range(prompts)]
    rs = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 12))] for _ in range(prompts * n)]
    batch = build_ppo_batch([p for p in ps for _ in range(n)], rs, 12, 0, [i for i in range(prompts) for _ in range(n)])
    batch["row"] = torch.arange(batch.size)
    return batch


def _packed_cost(mb) -> int:
    """Tokens the model runs for a micro-batch whose prompt groups are packed: each prompt once + k x its longest
    response (engine/workers/packing.py's block layout, before padding the groups to one length)."""
    index, prompt = mb["index"].tolist(), mb["prompt_lens"].tolist()
    resp = mb["response_mask"].sum(-1).tolist()
    total = 0
    for p in dict.fromkeys(index):
        rows = [i for i, q in enumerate(index) if q == p]
        total += prompt[rows[0]] + len(rows) * int(max(resp[i] for i in rows))
    return total


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_micro_batches_partition_the_rows_within_the_budget(pack, seed):
    batch, budget = _batch(seed, prompts=6, n=3), 90
    micro, order = ppo_workers._token_budget_microbatches(_worker(pack), batch, budget)
    held = [mb["row"].tolist() for mb in micro]
    assert sorted(i for rows in held for i in rows) == list(range(batch.size))  # a partition of the rows
    assert order.tolist() == [i for rows in held for i in rows]
    for mb in micro:
        cost = _packed_cost(mb) if pack else int(mb["attention_mask"].sum())
        assert cost <= budget or mb.size == 1
        assert mb["input_ids"].shape[1] == int(mb["attention_mask"].sum(-1).max())  # trimmed to its longest row
    if pack:  # whole prompt groups, unless a group alone is over the budget
        for p in range(6):
            rows = [3 * p + j for j in range(3)]
            if _packed_cost(batch.select(rows)) <= budget:
                assert any(set(rows) <= set(h) for h in held), (p, held)
    # per-row results in micro-batch order go back to the batch's row order
    restored = ppo_workers._in_row_order(torch.cat([mb["row"] * 10 + 1 for mb in micro]), order)
    assert torch.equal(restored, torch.arange(batch.size) * 10 + 1)


def test_a_group_over_the_budget_runs_as_single_rows():
    batch = _batch(7, prompts=4, n=4)
    units, costs = ppo_workers._budget_units(_worker(True), batch)
    assert units == [[4 * p + j for j in range(4)] for p in range(4)]
    lens = batch["attention_mask"].sum(-1).tolist()
    assert all(c < sum(lens[i] for i in u) for u, c in zip(units, costs))  # the prompt counted once
    budget = max(lens)  # one full row always fits
    over = [u for u, c in zip(units, costs) if c > budget]
    assert over  # at least one group of 4 is over it: its rows run alone or beside others, never as one unit
    micro, order = ppo_workers._token_budget_microbatches(_worker(True), batch, budget)
    assert sorted(order.tolist()) == list(range(batch.size))
    assert all(_packed_cost(mb) <= budget for mb in micro)


def test_virtual_pipeline_rounds_the_count_to_a_multiple_of_pp():
    batch = _batch(3, prompts=5, n=1)
    micro, _ = ppo_workers._token_budget_microbatches(_worker(False, pp=2, chunks=2), batch, 10 ** 6)
    assert len(micro) == 2  # one micro-batch would fit; interleaved 1F1B needs a multiple of PP


def test_dp_ranks_get_whole_prompt_groups_of_balanced_cost():
    batch = _batch(5, prompts=8, n=2)
    cfg = SimpleNamespace(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=200, loss_agg_mode="token-mean")
    per_rank = []
    for rank in range(2):
        micro, _, tokens, scale = ppo_workers._split_mini_batch(_worker(True, dp=2, dp_rank=rank), batch, cfg)
        per_rank.append(sorted(i for mb in micro for i in mb["row"].tolist()))
        assert tokens == batch["response_mask"].sum() and scale == len(micro) * 2  # global normaliser, own count
    assert sorted(per_rank[0] + per_rank[1]) == list(range(batch.size))
    assert len(per_rank[0]) == len(per_rank[1]) == 8
    for rows in per_rank:  # whole groups: both samples of a prompt on the same rank
        assert all((i ^ 1) in rows for i in rows)
    costs = [_packed_cost(batch.select(rows)) for rows in per_rank]
    biggest_group = max(_packed_cost(batch.select([2 * p, 2 * p + 1])) for p in range(8))
    assert abs(costs[0] - costs[1]) <= biggest_group


def test_padding_free_groups_cost_their_tokens():
    """use_remove_padding: a prompt group costs its prompt once plus each response at its own length (not k x the
    longest), so a budget that holds the padding-free groups keeps them whole."""
    batch = _batch(5, prompts=4, n=3)
    units, costs = ppo_workers._budget_units(_worker(True, remove_padding=True), batch)
    resp = batch["response_mask"].sum(-1).tolist()
    assert units == [[3 * p + j for j in range(3)] for p in range(4)]
    assert costs == [int(batch["prompt_lens"][u[0]]) + sum(int(resp[i]) for i in u) for u in units]
    assert costs != ppo_workers._budget_units(_worker(True), batch)[1]  # the padded cost differs on this batch
