"""engine/workers/ppo_workers.run_ppo_epochs: the one epoch / mini-batch loop of the actor and critic updates."""
from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from tripod.engine.workers.batch import PPOBatch
from tripod.engine.workers.ppo_workers import run_ppo_epochs


class _Worker:
    """What the loop needs of a worker: an optimizer step that returns the grad norm, and the last LR."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.grad_norms, self.last_lr = rng, [], rng.uniform(1e-4, 1e-3)

    def step(self) -> float:
        self.grad_norms.append(self.rng.uniform(0.1, 3.0))
        return self.grad_norms[-1]


def _batch(rows: int, seed: int) -> PPOBatch:
    g = torch.Generator().manual_seed(seed)
    return PPOBatch({"input_ids": torch.randint(0, 100, (rows, 5), generator=g),
                     "index": torch.arange(rows) // 2})


def _cfg(epochs: int, mini: int, shuffle: bool) -> SimpleNamespace:
    return SimpleNamespace(ppo_epochs=epochs, ppo_mini_batch_size=mini, shuffle=shuffle)


def test_every_epoch_visits_every_row_once_per_optimizer_step():
    rng = random.Random(1)
    batch, worker, seen, losses = _batch(12, 3), _Worker(rng), [], []

    def update(mini: PPOBatch) -> dict[str, float]:
        seen.append(mini["input_ids"])
        losses.append({"critic/vf_loss": rng.uniform(0, 1)})
        return losses[-1]

    out, stopped, steps = run_ppo_epochs(worker, batch, _cfg(3, 2, True), 2, update, "critic")
    assert (stopped, steps, len(seen)) == (False, 9, 9)  # 3 epochs x (12 rows / (2 x n=2) rows)
    for epoch in range(3):
        rows = torch.cat(seen[3 * epoch:3 * epoch + 3])
        assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, batch["input_ids"].tolist()))
    assert not torch.equal(torch.cat(seen[0:3]), torch.cat(seen[3:6]))  # shuffled anew each epoch
    assert out["critic/vf_loss"] == sum(m["critic/vf_loss"] for m in losses) / 9
    assert out["critic/grad_norm"] == sum(worker.grad_norms) / 9 and out["critic/lr"] == worker.last_lr


def test_stop_ends_the_update_after_the_mini_batch_that_tripped_it():
    rng = random.Random(2)
    worker = _Worker(rng)
    kls = iter([0.001, 0.002, 0.5] + [rng.uniform(0, 0.01) for _ in range(5)])  # 2 epochs x 4 mini-batches
    out, stopped, steps = run_ppo_epochs(worker, _batch(8, 4), _cfg(2, 1, False), 2,
                                         lambda mb: {"actor/ppo_kl": next(kls)}, "actor",
                                         stop=lambda m: m["actor/ppo_kl"] > 0.1)
    # stopped at the first epoch's third mini-batch, after its optimizer step
    assert (stopped, steps, len(worker.grad_norms)) == (True, 3, 3)
    assert out["actor/ppo_kl"] == (0.001 + 0.002 + 0.5) / 3
