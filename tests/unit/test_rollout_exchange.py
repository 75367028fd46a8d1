"""The rollout exchange's pure parts (engine/rollout/exchange.py) and where rows are scored
(engine/rewards/replica_scoring.py): the transfer plan delivers each needed row exactly once from a rank that holds
it, the wire format round-trips, and the rows assembled from a simulated exchange are the whole rollout in order."""
from __future__ import annotations

import random

import pytest
import torch

from tripod.engine.rewards.replica_scoring import pool_workers, rows_of_replica
from tripod.engine.rollout.exchange import (
    Transfer,
    assemble,
    check_plan,
    message_bytes,
    pack_rows,
    plan_transfers,
    replica_offsets,
    token_dtype,
    unpack_rows,
)
from tripod.engine.rollout.generators import replica_bounds

LAYOUTS = [  # (world, rollout TP): replicas are consecutive TP groups, as parallel/hybrid_engine/plan.py makes them
    (1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (8, 2), (8, 4), (6, 3)]


def _replicas(world: int, tp: int) -> list[list[int]]:
    return [list(range(i, i + tp)) for i in range(0, world, tp)]


def _rollout(rows: int, seed: int, vocab: int = 200):
    rng = random.Random(seed)
    responses = [[rng.randrange(vocab) for _ in range(rng.randint(0, 9))] for _ in range(rows)]
    log_probs = [-torch.rand(len(r)) for r in responses]
    finish = [rng.choice(["stop", "length"]) for _ in range(rows)]
    return responses, log_probs, finish


@pytest.mark.parametrize("world,tp", LAYOUTS)
def test_every_rank_gets_every_row_exactly_once(world, tp):
    replicas = _replicas(world, tp)
    rng = random.Random(world * 10 + tp)
    rows = [rng.randint(0, 6) for _ in replicas]
    needs_all = [range(sum(rows))] * world
    plan = plan_transfers(replicas, rows, needs_all)
    check_plan(plan, replicas, rows, needs_all)
    # a rank never hears from its own replica; a replica's ranks share the sending
    for t in plan:
        assert t.dst not in replicas[t.replica] and t.src in replicas[t.replica]
    if tp > 1 and world > tp:
        assert len({t.src for t in plan if t.replica == 0}) == tp
    # any per-rank subset (what a batch sharded by DP rank needs) is planned as exactly that
    total = sum(rows)
    subsets = [sorted(rng.sample(range(total), rng.randint(0, total))) for _ in range(world)]
    check_plan(plan_transfers(replicas, rows, subsets), replicas, rows, subsets)


def test_a_planted_wrong_plan_fails_the_check():
    replicas, rows = _replicas(4, 2), [3, 2]
    needs = [range(5)] * 4
    plan = plan_transfers(replicas, rows, needs)
    check_plan(plan, replicas, rows, needs)
    t = plan[0]
    wrong_dst = [Transfer(t.src, (t.dst + 1) % 4, t.replica, t.rows), *plan[1:]]
    wrong_src = [Transfer(replicas[1 - t.replica][0], t.dst, t.replica, t.rows), *plan[1:]]
    dropped_row = [Transfer(t.src, t.dst, t.replica, t.rows[1:]), *plan[1:]]
    for bad in (wrong_dst, wrong_src, dropped_row, plan + [plan[-1]]):
        with pytest.raises(ValueError, match="bad transfer plan|not held"):
            check_plan(bad, replicas, rows, needs)


@pytest.mark.parametrize("vocab", [200, 40_000, 151_000])
def test_wire_format_round_trips(vocab):
    responses, log_probs, finish = _rollout(7, vocab, vocab)
    dtype = token_dtype(max(t for r in responses for t in r))
    assert dtype == (torch.int16 if vocab <= 2 ** 15 else torch.int32)
    buf = pack_rows(responses, log_probs, finish, dtype)
    lengths = [len(r) for r in responses]
    assert buf.dtype == torch.uint8 and buf.numel() == message_bytes(lengths, dtype)
    got = unpack_rows(buf, lengths, dtype)
    assert got[0] == responses and got[2] == finish
    assert all(torch.equal(a, b) for a, b in zip(got[1], log_probs))
    with pytest.raises(ValueError, match="bytes"):
        unpack_rows(buf[:-1], lengths, dtype)


@pytest.mark.parametrize("world,tp", LAYOUTS)
def test_a_simulated_exchange_assembles_the_rollout_in_order(world, tp):
    """Every rank's view after the plan's messages (packed by the sender, unpacked by the receiver) is the whole
    rollout, row for row: the transport of exchange_rollout without the process group."""
    replicas = _replicas(world, tp)
    rng = random.Random(world + tp)
    rows = [rng.randint(0, 5) for _ in replicas]
    off = replica_offsets(rows)
    whole = _rollout(off[-1], world * tp)
    held = [tuple([field[g] for g in range(off[i], off[i + 1])] for field in whole) for i in range(len(replicas))]
    home = {r: i for i, ranks in enumerate(replicas) for r in ranks}
    plan = plan_transfers(replicas, rows, [range(off[-1])] * world)
    for me in range(world):
        mine = home[me]
        inbox = []
        for t in (t for t in plan if t.dst == me):
            src_rows = held[home[t.src]]
            local = [g - off[t.replica] for g in t.rows]
            buf = pack_rows([src_rows[0][k] for k in local], [src_rows[1][k] for k in local],
                            [src_rows[2][k] for k in local], torch.int16)
            inbox.append((t.rows, unpack_rows(buf, [len(whole[0][g]) for g in t.rows], torch.int16)))
        got = assemble(off[-1], range(off[mine], off[mine + 1]), held[mine], inbox)
        assert got[0] == whole[0] and got[2] == whole[2]
        assert all(torch.equal(a, b) for a, b in zip(got[1], whole[1]))
        if inbox:
            with pytest.raises(ValueError, match="never arrived"):
                assemble(off[-1], range(off[mine], off[mine + 1]), held[mine], inbox[1:])
            with pytest.raises(ValueError, match="twice"):
                assemble(off[-1], range(off[mine], off[mine + 1]), held[mine], inbox + inbox[:1])


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_each_replica_scores_the_rows_it_generated(replicas):
    """The rows a replica's first rank scores are the rows the rollout gave that replica (weight_sync.replica_bounds),
    and the replicas' rows cover the batch once."""
    for prompts, n in [(0, 2), (1, 4), (5, 2), (8, 3)]:
        bounds = replica_bounds(prompts, replicas)
        got = [rows_of_replica(prompts, n, replicas, i) for i in range(replicas)]
        assert [g for r in got for g in r] == list(range(prompts * n))
        assert [len(r) for r in got] == [(bounds[i + 1] - bounds[i]) * n for i in range(replicas)]


def test_pool_workers_share_a_node():
    assert pool_workers(8, 8, 1) == 1 and pool_workers(8, 8, 2) == 2 and pool_workers(4, 1, 1) == 4
    assert pool_workers(1, 8, 1) == 1
