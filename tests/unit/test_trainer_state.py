"""PPOTrainer.state_dict / load_state_dict through the CheckpointManager's files: a fresh trainer that loads a
saved state continues with the same step, data batches, KL coefficient, LR schedule, guard remedies and RNG draws."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
from omegaconf import OmegaConf

from tripod.engine.algorithms import build_kl_controller
from tripod.engine.async_rollout.source import ColocatedRollout
from tripod.engine.checkpoints import CheckpointManager
from tripod.engine.config import TripodConfig
from tripod.engine.data import PromptDataLoader
from tripod.engine.divergence_guard import DivergenceGuard
from tripod.engine.trainer import PPOTrainer
from tripod.runtime.offload import OffloadManager


class _Prompts:
    """The slice of PromptDataset the loader uses; a batch is its prompt indices."""
    files = ["prompts.parquet"]

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def batch(self, indices: list[int]) -> list[int]:
        return indices


class _Worker:
    """A trainable model as the trainer's state sees it: a torch optimizer under megatron's LR scheduler."""

    def __init__(self, lr: float, total_steps: int) -> None:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.randn(3))], lr=lr)
        self.lr_scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=lr, min_lr=0.1 * lr, lr_warmup_steps=2, lr_decay_steps=total_steps,
            lr_decay_style="cosine", start_wd=0.0, end_wd=0.0, wd_incr_steps=total_steps, wd_incr_style="constant")


def _trainer(root: str, guard_enabled: bool = True) -> PPOTrainer:
    """A PPOTrainer with exactly the parts its state covers (no models, data files or rollout engine)."""
    cfg = OmegaConf.to_object(OmegaConf.structured(TripodConfig))  # interpolations (clip_ratio_low, ...) resolved
    cfg.trainer.divergence_guard.enabled = guard_enabled
    a = cfg.actor_rollout_ref.actor
    a.optim.lr, cfg.critic.optim.lr = 1e-3, 2e-3
    a.optim.min_lr_ratio = cfg.critic.optim.min_lr_ratio = 0.1
    t = PPOTrainer.__new__(PPOTrainer)
    t.cfg, t.rank, t.world, t.step = cfg, 0, 1, 0
    t.kl_ctrl = build_kl_controller("adaptive", 0.001, target_kl=0.05, horizon=100)
    t.loader = PromptDataLoader(_Prompts(23), 4, shuffle=True, seed=7)
    t.actor, t.critic = _Worker(a.optim.lr, 40), _Worker(cfg.critic.optim.lr, 40)
    t.guard = DivergenceGuard(cfg.trainer.divergence_guard, a, cfg.algorithm.kl_ctrl.target_kl, root)
    t.ckpt = CheckpointManager(root, arch=None, tokenizer_dir="")
    t.offload = OffloadManager({}, {}, execute=False)  # nothing offloaded: resume's phase change moves nothing
    t.source = ColocatedRollout(t)  # the synchronous schedule: nothing of its own in the state
    return t


def _advance(t: PPOTrainer, rng: random.Random, rolled_back: bool = True) -> None:
    """Move every part of the state somewhere no fresh trainer starts from (with `rolled_back`, the guard's too)."""
    for _ in range(rng.randint(7, 11)):  # crosses an epoch of the 5-batch loader
        next(iter(t.loader))
        t.kl_ctrl.update(rng.uniform(0.0, 0.2), n_steps=4)
        t.step += 1
    for w in (t.actor, t.critic):
        for _ in range(rng.randint(3, 9)):
            w.lr_scheduler.step(1)
    t.guard.best_val = rng.uniform(0.2, 0.9)
    t.guard.history = {"actor/grad_norm": [rng.uniform(0.5, 2.0) for _ in range(3)]}
    if rolled_back:
        t.guard.rollbacks = 1
        t.apply_remedies(t.guard.remedies())
    torch.rand(rng.randint(1, 50))


def _public(state: dict) -> dict:
    return json.loads(json.dumps({k: v for k, v in state.items() if k != "rng"}))


def test_state_dict_round_trip_through_a_checkpoint(tmp_path, world_of_one):
    root = str(tmp_path / "checkpoints")
    before = _trainer(root)
    _advance(before, random.Random(int.from_bytes(os.urandom(4), "little")))
    saved = before.state_dict()
    path = before.ckpt.save(before.step, saved, {})
    assert sorted(os.listdir(path)) == ["COMPLETE", "rng", "trainer_state.json"]

    after = _trainer(root)
    after.load_state_dict(after.ckpt.load("auto", {}))  # PPOTrainer.resume, without model weights to load
    draw = torch.rand(5)
    torch.set_rng_state(saved["rng"]["torch"])
    assert torch.equal(draw, torch.rand(5))
    assert after.step == before.step > 0
    assert _public(after.state_dict()) == _public(saved)
    assert next(iter(after.loader)) == next(iter(before.loader))  # the same next batch
    assert after.kl_ctrl.value == before.kl_ctrl.value != 0.001
    for b, a in ((before.actor, after.actor), (before.critic, after.critic)):
        b.lr_scheduler.step(1)
        a.lr_scheduler.step(1)
        assert a.optimizer.param_groups[0]["lr"] == b.optimizer.param_groups[0]["lr"] > 0
    # the guard's rollback count came back, and with it the remedies (clip ratio, KL-loss coefficient, LR x 0.5)
    actor = after.cfg.actor_rollout_ref.actor
    assert after.guard.rollbacks == 1 and after.guard.best_val == before.guard.best_val
    assert (actor.clip_ratio, actor.kl_loss_coef) == (0.1, pytest.approx(before.guard.base_kl_loss_coef + 0.002))
    assert after.actor.lr_scheduler.max_lr == pytest.approx(0.5e-3) and after.critic.lr_scheduler.max_lr == 1e-3


def test_resume_disable_and_empty_root_leave_a_fresh_state(tmp_path, world_of_one):
    t = _trainer(str(tmp_path / "none"))
    fresh = _public(t.state_dict())
    t.resume("auto")
    t.resume("disable")
    assert _public(t.state_dict()) == fresh and t.step == 0


def test_load_refuses_a_world_size_mismatch_before_loading(tmp_path, world_of_one):
    t = _trainer(str(tmp_path / "checkpoints"))
    path = t.ckpt.save(3, t.state_dict(), {})
    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    state["world_size"] = 4
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump(state, f)
    with pytest.raises(ValueError, match="saved by 4 ranks"):
        t.resume(path)


def test_trainer_applies_a_guard_rollback(tmp_path, world_of_one, capsys):
    """judged(): a non-finite step rolls back to the newest GOOD checkpoint (state as saved there, newer checkpoints
    REJECTED), adds remedy_kl_coef_add to the KL coefficient, halves the LR schedules and caps the clip ratios."""
    from tripod.engine.divergence_guard import GOOD

    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    root = str(tmp_path / "checkpoints")
    t = _trainer(root)
    t.ckpt.load = lambda mode, models: CheckpointManager.load(t.ckpt, mode, {})  # the fakes have no weights
    saved = {}
    for step in (1, 2, 3):
        _advance(t, rng, rolled_back=False)
        t.step = step
        saved[step] = t.state_dict()
        path = t.ckpt.save(step, saved[step], {})
        if step < 3:  # global_step_3 is complete but was never marked GOOD
            t.guard.mark_good(path)
    _advance(t, rng, rolled_back=False)
    t.guard.history = {}
    t.step = 3
    lr_before, kl_before = t.actor.optimizer.param_groups[0]["lr"], t.kl_ctrl.value

    assert not t.judged({"actor/pg_loss": float("nan"), "actor/grad_norm": rng.uniform(0.5, 2)})
    line = capsys.readouterr().out.splitlines()[-1]
    assert t.step == 2 and os.path.exists(os.path.join(root, "global_step_3", "REJECTED"))
    assert not os.path.exists(os.path.join(root, "global_step_2", "REJECTED"))
    assert t.loader.state_dict() == saved[2]["data"]
    assert t.kl_ctrl.kl_coef == pytest.approx(saved[2]["kl_ctrl"]["kl_coef"] + 0.002)
    # the schedule is back at global_step_2's optimizer step (megatron's loader adds to the live count)
    assert t.actor.lr_scheduler.num_steps == saved[2]["lr_scheduler"]["actor"]["num_steps"]
    assert t.actor.lr_scheduler.max_lr == pytest.approx(0.5e-3)
    lr_after = t.actor.optimizer.param_groups[0]["lr"]
    assert line == (f"guard: step 3 tripped (non-finite actor/pg_loss=nan); rolled back to global_step_2 (rollback "
                    f"1/3); clip_ratio 0.2->0.1, kl_coef {kl_before:g}->{t.kl_ctrl.value:g}, actor lr {lr_before:g}->"
                    f"{lr_after:g}")
    assert os.path.exists(os.path.join(root, "global_step_2", GOOD))

    metrics = {"actor/pg_loss": rng.uniform(-1, 1), "actor/grad_norm": rng.uniform(0.5, 2)}
    assert t.judged(metrics)
    assert metrics["guard/tripped"] == 1.0 and metrics["guard/rollbacks"] == 1.0
    assert metrics["guard/clip_ratio"] == t.cfg.actor_rollout_ref.actor.clip_ratio == 0.1
    assert metrics["guard/kl_coef"] == t.kl_ctrl.value
