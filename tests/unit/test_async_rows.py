"""A scored batch's head and per-row body (engine/async_rollout/messages.py): any subset of rows packed on the
rollout side unpacks on a trainer rank to exactly those rows (tokens, log-probs, token codes, routing records in their
dtype), the others None, and its size is what the head alone predicts (`body_bytes`)."""
from __future__ import annotations

import math

import torch

from tripod.engine.async_rollout.messages import ScoredBatch, body_bytes, parse_head, unpack


def _random_batch(seed: int, coded: bool, routed_dtype) -> ScoredBatch:
    g = torch.Generator().manual_seed(seed)
    rows = 6
    lengths = torch.randint(0, 9, (rows,), generator=g).tolist()
    responses = [torch.randint(0, 50000, (k,), generator=g).tolist() for k in lengths]
    logp = [-torch.rand(k, generator=g) * 5 for k in lengths]
    codes = [torch.randint(0, 3, (k,), generator=g).to(torch.uint8) for k in lengths] if coded else None
    routed = None if routed_dtype is None else \
        [torch.randint(0, 200, (3 + k, 2, 4), generator=g).to(routed_dtype) for k in lengths]
    return ScoredBatch(5, [[[0, 4]]] * rows, [11, 12, 13], responses, logp, ["stop"] * rows,
                       torch.rand(rows, generator=g).tolist(), [0.5] * rows, [0.0] * rows, {"m": 1.0},
                       {"epoch": 0, "offset": 3}, {"gen": 0.25}, 2, routed, codes)


def test_any_rows_travel_exactly():
    for seed, coded, dtype in ((0, False, None), (1, True, None), (2, False, torch.int16), (3, True, torch.uint8)):
        batch = _random_batch(seed, coded, dtype)
        head_buf, body = batch.to_wire()
        head, offset = parse_head(head_buf)
        assert offset == head_buf.numel() and not head["attached"]
        for rows in ([], [0], [1, 4], [0, 2, 3, 5], list(range(6))):
            buf = body.pack(rows)
            per_token = 8 + (1 if coded else 0)
            routed = 0 if dtype is None else sum((3 + len(batch.responses[g])) * 8 *
                                                 torch.empty((), dtype=dtype).element_size() for g in rows)
            assert buf.numel() == body_bytes(head, rows) == \
                sum(len(batch.responses[g]) for g in rows) * per_token + routed
            back = unpack(head, buf, rows)
            for g in range(6):
                if g not in rows:
                    assert back.responses[g] is None and back.log_probs[g] is None
                    continue
                assert back.responses[g] == batch.responses[g]
                assert torch.equal(back.log_probs[g], batch.log_probs[g].float())
                if coded:
                    assert torch.equal(back.token_codes[g], batch.token_codes[g])
                if dtype is not None:
                    assert back.routed_experts[g].dtype == dtype
                    assert torch.equal(back.routed_experts[g], batch.routed_experts[g])
            assert back.lengths == [len(r) for r in batch.responses] and back.scores == batch.scores
        whole = ScoredBatch.from_bytes(batch.to_bytes())  # a checkpoint's queued batch: every row attached
        assert whole.responses == batch.responses and whole.run == 2 and whole.loader_state == batch.loader_state


def test_a_short_body_is_one_clear_error():
    batch = _random_batch(4, False, None)
    head_buf, body = batch.to_wire()
    head, _ = parse_head(head_buf)
    rows = [g for g in range(6) if batch.responses[g]][:2]
    try:
        unpack(head, body.pack(rows)[:-1], rows)
    except RuntimeError as e:
        assert "body bytes" in str(e)
    else:
        raise AssertionError("a truncated body was accepted")


def test_bound_is_reported_in_trainer_and_optimizer_steps():
    from tripod.engine.async_rollout.schedule import StalenessSchedule

    # K = 2: ages 0, 1, 0, 1 trainer steps; 2 epochs x 3 mini-batches = 6 optimizer steps a trainer step
    line = StalenessSchedule(0.0, 2, 8).describe(optimizer_steps_per_step=6)
    assert "at most 1 trainer step(s) old (6 optimizer step(s), 6 a trainer step)" in line


def test_push_bytes_are_spread_over_the_senders_of_each_slice(tmp_path):
    """4 trainer ranks, rollout TP 2: each slice is held by 2 trainer ranks, which send alternate buckets; the
    senders' bytes add up to the slices' and none sends more than half a slice plus one bucket, at any replica
    count (the function does not take one)."""
    from tests.helpers.ppo_setup import make_ppo_setup
    from tripod.engine.async_rollout.weights import bucket_layout, push_bytes_per_sender
    from tripod.engine.config import load_config
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.hybrid_engine import reshard_plan_from_config

    setup = make_ppo_setup(tmp_path)
    cfg = load_config(None, [f"data.train_files={setup['train']}", f"actor_rollout_ref.model.path={setup['model']}",
                             "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    plan = reshard_plan_from_config(cfg, 4, arch_from_hf(setup["model"]))
    bucket = 8 << 10
    per = push_bytes_per_sender(plan, bucket)
    assert sorted(per) == [0, 1, 2, 3]
    shard = plan.generation_shard_bytes()  # one slice's bytes (the slices are equal at TP 2 here)
    largest = max(sum(math.prod(plan.generation_shapes()[n]) * 4 for n in names)
                  for names in bucket_layout(plan.generation_shapes(), plan.generation_dtypes(), bucket))
    assert sum(per.values()) == 2 * shard
    assert all(0 < v <= shard / 2 + largest for v in per.values()), (per, shard, largest)
