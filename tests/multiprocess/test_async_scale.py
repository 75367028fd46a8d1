"""The rollout on ranks of its own at more than one rank a side (issue 46).

- Each trainer DP rank receives exactly the rows it trains, straight from a rollout rank (engine/async_rollout/
  rows.py), and the run is the synchronous one bit for bit; the weight push's buckets are shared by the trainer's
  ranks. A planted whole-batch broadcast (every rank asks for every row) trains the same and is caught by its bytes.
- Rollout TP 2, two replicas, several buckets (engine/async_rollout/weights.py: one broadcast per bucket to every
  replica): every weight version every rollout rank loads is, tensor for tensor and bit for bit, what the trainer
  ranks of its slice gathered. Planted: every received bucket shifted by one element; replica 1 skipped.
"""
from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch

from tests.helpers.ppo_setup import make_ppo_setup
from tests.helpers.trainer_runs import metrics, train_together
from tests.multiprocess.test_async import _dumps, _overrides, _same_run

pytestmark = pytest.mark.timeout(1200)
TWO_TRAINERS = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]
TWO_REPLICAS = ["rollout.nnodes=1", "rollout.n_gpus_per_node=2"]
STEPS = 2
TOKEN_BYTES = 8  # a response token's int32 id + float32 rollout log-prob


def _bytes_follow_the_plan(run_dir: str) -> bool:
    """Every step: trainer rank r received the head plus the body of its plan's rows and nothing else. The plan,
    derived here independently: 4 prompts x 2 samples = 8 rows, one mini-batch, split over 2 DP ranks in contiguous
    halves (verl's DP split; no dynamic batch size), so rank 0 trains rows 0-3 (those it dumps), rank 1 rows 4-7."""
    rows = metrics(run_dir)
    dumps = _dumps(run_dir, range(1, STEPS + 1))
    ok = len(rows) == STEPS
    for r, dump in zip(rows, dumps):
        head = r["async/batch_head_bytes"]
        total_tokens = round(r["response_length/mean"] * 8)
        rank0_tokens = sum(len(d["response_ids"]) for d in dump)
        expect = [head + TOKEN_BYTES * rank0_tokens, head + TOKEN_BYTES * (total_tokens - rank0_tokens)]
        ok &= [d["row"] for d in dump] == [0, 1, 2, 3]
        ok &= [r["async/batch_bytes/rank0"], r["async/batch_bytes/rank1"]] == expect
        ok &= r["async/batch_bytes_total"] == sum(expect)
    return bool(ok)


def _push_bytes(run_dir: str, overrides: list[str], model: str) -> tuple[list[float], list[float]]:
    """(what each trainer rank sent in every push, what the plan says: rollout TP 1, one slice held by both trainer
    ranks, bucket b of the 16 KiB layout sent by rank b mod 2)."""
    from tripod.engine.async_rollout.weights import bucket_layout
    from tripod.engine.config import load_config
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.hybrid_engine import reshard_plan_from_config

    plan = reshard_plan_from_config(load_config("recipes/defaults.yaml", overrides), 2, arch_from_hf(model))
    shapes, dtypes = plan.generation_shapes(), plan.generation_dtypes()
    layout = bucket_layout(shapes, dtypes, 16 << 10)
    size = lambda n: math.prod(shapes[n]) * torch.empty((), dtype=dtypes[n]).element_size()  # noqa: E731
    want = [float(sum(size(n) for b, names in enumerate(layout) if b % 2 == s for n in names)) for s in (0, 1)]
    pushes = [r for r in metrics(run_dir) if "async/weight_push_bytes/rank0" in r]
    return [x for r in pushes for x in (r["async/weight_push_bytes/rank0"], r["async/weight_push_bytes/rank1"])], \
        want * len(pushes)


def test_each_trainer_rank_receives_its_rows_and_the_run_is_the_synchronous_one(tmp_path):
    setup = make_ppo_setup(tmp_path, max_digits=2)
    runs = {name: _overrides(setup, str(tmp_path / name), STEPS, *TWO_TRAINERS, *extra)
            for name, extra in (("colocated", []), ("two_replicas", TWO_REPLICAS), ("planted", TWO_REPLICAS))}
    digests = str(tmp_path / "digests")  # 16 KiB buckets; every version loaded recorded
    train_together(runs, str(tmp_path), run_envs={
        "planted": {"TRIPOD_TEST_PLANT": "async_rows_to_every_rank"},
        "two_replicas": {"TRIPOD_TEST_PLANT": "weight_digests", "TRIPOD_TEST_DIGESTS": digests}})
    assert _bytes_follow_the_plan(str(tmp_path / "two_replicas"))
    sent, planned = _push_bytes(str(tmp_path / "two_replicas"), runs["two_replicas"], setup["model"])
    assert sent == planned and len(sent) >= 2 and min(planned) > 0, (sent, planned)  # both ranks send, once
    assert _loaded_weights_match(os.path.join(digests, "clean"), range(STEPS), replicas=2, tp=1)
    assert not _bytes_follow_the_plan(str(tmp_path / "planted"))
    # rollout TP 1 either way: the colocated run's two trainer ranks are its two replicas, with the same seeds
    assert _same_run(str(tmp_path / "colocated"), str(tmp_path / "two_replicas"), STEPS)


def _loaded_weights_match(digests: str, versions: range, replicas: int, tp: int) -> bool:
    """Every (version, replica, slice) loaded, each equal to what every trainer rank of that slice gathered."""
    def read(pattern: str) -> dict[tuple[int, ...], dict]:
        out = {}
        for path in glob.glob(os.path.join(digests, pattern)):
            key = tuple(int(p[1:] if p[0] == "v" else p.removeprefix("slice").removeprefix("replica")
                            .removeprefix("rank")) for p in os.path.basename(path)[:-5].split("_")[1:])
            with open(path) as f:
                out[key] = json.load(f)
        return out
    trainer, loaded = read("trainer_*.json"), read("rollout_*.json")
    gathered: dict[tuple[int, int], dict] = {}
    for (v, j, _), d in trainer.items():
        if gathered.setdefault((v, j), d) != d:  # the senders of one slice gathered the same shard
            return False
    want = {(v, j, r) for v in versions for j in range(tp) for r in range(replicas)}
    return set(loaded) == want and all(gathered.get((v, j)) == d for (v, j, _), d in loaded.items())


def test_rollout_tp2_two_replicas_load_the_trainers_weights_after_every_sync(tmp_path, monkeypatch):
    """2 trainer ranks + 4 rollout ranks: rollout TP 2, two replicas, 16 KiB buckets (several a slice)."""
    from tripod.engine.async_rollout.weights import bucket_layout
    from tripod.engine.config import load_config
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.hybrid_engine import reshard_plan_from_config

    setup = make_ppo_setup(tmp_path, max_digits=2)
    digests = tmp_path / "digests"
    monkeypatch.setenv("TRIPOD_TEST_DIGESTS", str(digests))
    extra = [*TWO_TRAINERS, "rollout.nnodes=1", "rollout.n_gpus_per_node=4",
             "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    runs = {bug: _overrides(setup, str(tmp_path / bug), STEPS, *extra)
            for bug in ("weight_digests", "weight_digests_bucket_offset", "weight_digests_replica_skipped")}
    cfg = load_config("recipes/defaults.yaml", runs["weight_digests"])
    plan = reshard_plan_from_config(cfg, 2, arch_from_hf(setup["model"]))
    buckets = bucket_layout(plan.generation_shapes(), plan.generation_dtypes(), 16 << 10)
    assert len(buckets) > 2, "the shard fits one bucket: the test would not see a bucket boundary"
    # a world each (two own-ranks runs at rollout TP 2 in one world trip over a process group the first one left)
    train_together(runs, str(tmp_path), run_envs={bug: {"TRIPOD_TEST_PLANT": bug} for bug in runs})
    versions = range(STEPS)  # staleness 0: versions 0 .. STEPS - 1 generate the batches
    assert _loaded_weights_match(str(digests / "clean"), versions, replicas=2, tp=2)
    assert not _loaded_weights_match(str(digests / "offset"), versions, replicas=2, tp=2)
    assert not _loaded_weights_match(str(digests / "skip"), versions, replicas=2, tp=2)
