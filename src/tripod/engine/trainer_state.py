"""The PPO trainer's state across steps, a mixin of engine/trainer.py's `PPOTrainer`: what a checkpoint holds besides
the models' weights and optimizer states (`state_dict` / `load_state_dict`), the resume, and the divergence guard's
verdict applied (engine/divergence_guard.py): `judged` keeps a step or rolls back to the last GOOD checkpoint
(`roll_back`) with the guard's remedies (`apply_remedies`: clip ratios, KL-loss coefficient, LR scale).

It reads the trainer's cfg, rank, world, step, kl_ctrl, loader, actor, critic, guard, ckpt and offload.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from tripod.engine.checkpoints.manager import latest_complete
from tripod.engine.divergence_guard import GuardDecision, Remedies

if TYPE_CHECKING:
    from tripod.engine.workers.ppo_workers import CriticWorker, PolicyWorker


class TrainerState:
    """`PPOTrainer`'s checkpoint state, resume and divergence-guard rollback (see the module docstring)."""

    def trainable_workers(self) -> dict[str, PolicyWorker | CriticWorker]:
        """{checkpoint name: worker} of the models a checkpoint holds weights and optimizer states of."""
        return {name: w for name, w in (("actor", self.actor), ("critic", self.critic)) if w is not None}

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs besides the models' weights and optimizer states (which the checkpoint manager
        takes from `trainable_workers()`): step, data position, KL controller, LR schedules, divergence-guard state
        and this rank's RNG ("rng", the only per-rank entry)."""
        return {"step": self.step, "kl_ctrl": self.kl_ctrl.state_dict(), "data": self.loader.state_dict(),
                "world_size": self.world,
                "lr_scheduler": {name: w.lr_scheduler.state_dict() for name, w in self.trainable_workers().items()},
                "guard": self.guard.state_dict(), "rng": {"torch": torch.get_rng_state()},
                # the rollout ranks' queue and loader position (engine/async_rollout/source.py) override "data"
                **self.source.state_dict(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; without "guard" the divergence guard keeps its own state (a rollback)."""
        for name, worker in self.trainable_workers().items():
            worker.lr_scheduler.num_steps = 0  # megatron's load_state_dict adds the saved count to the live one
            worker.lr_scheduler.load_state_dict(state["lr_scheduler"][name])
        torch.set_rng_state(state["rng"]["torch"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.loader.load_state_dict(state["data"])
        self.source.load_state_dict(state)
        self.step = int(state["step"])
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])
            self.apply_remedies(self.guard.remedies())

    def resume(self, mode: str | None) -> None:
        """Continue from the checkpoint `mode` names (trainer.resume: auto, disable or a path), if there is one."""
        if mode not in ("disable", "", None) and (mode != "auto" or latest_complete(self.ckpt.root)):
            self.offload.enter("checkpoint")  # loads in place: params and optimizer states on the device
        state = self.ckpt.load(mode, self.trainable_workers())
        if state is not None:
            self.load_state_dict(state)

    def apply_remedies(self, remedies: Remedies | None) -> None:
        """Set the actor's clip ratios and KL-loss coefficient and scale the LR schedules (divergence guard)."""
        if remedies is None:
            return
        cfg, a = self.cfg, self.cfg.actor_rollout_ref.actor
        a.clip_ratio, a.clip_ratio_low, a.clip_ratio_high = remedies.clip_ratios
        a.kl_loss_coef = remedies.kl_loss_coef
        scale = remedies.lr_scale
        for worker, optim in ((self.actor, a.optim), (self.critic, cfg.critic.optim)):
            if worker is None:
                continue
            # the LR scheduler sets every group's lr from the group's max_lr / min_lr at each optimizer step:
            # scale the schedule, not just this step's lr
            sched = worker.lr_scheduler
            sched.max_lr, sched.min_lr = optim.lr * scale, optim.min_lr_ratio * optim.lr * scale
            for group in worker.optimizer.param_groups:
                group["max_lr"], group["min_lr"] = sched.max_lr, sched.min_lr
                group["lr"] = sched.get_lr(group)

    def roll_back(self, step: int, decision: GuardDecision) -> None:
        """Apply the guard's rollback: reject newer checkpoints, reload the GOOD one, raise the KL coefficient,
        apply the remedies."""
        a = self.cfg.actor_rollout_ref.actor
        actor_lr = lambda: float(self.actor.optimizer.param_groups[0]["lr"])  # noqa: E731
        self.ckpt.reject_after(decision.checkpoint_step)
        before = (a.clip_ratio, self.kl_ctrl.value, actor_lr())
        self.offload.enter("checkpoint")
        state = self.ckpt.load(decision.checkpoint, self.trainable_workers())
        state.pop("guard", None)  # the guard's own count and best validation reward go on across a rollback
        self.load_state_dict(state)
        self.source.restart(self.step)  # the rollout's own ranks start again from here (engine/async_rollout/)
        self.kl_ctrl.kl_coef += decision.kl_coef_add
        self.apply_remedies(decision.remedies)
        if self.rank == 0:
            print(f"guard: step {step} tripped ({'; '.join(decision.reasons)}); rolled back to "
                  f"{os.path.basename(decision.checkpoint)} (rollback {decision.remedies.rollbacks}/"
                  f"{self.cfg.trainer.divergence_guard.max_rollbacks}); clip_ratio {before[0]:g}->{a.clip_ratio:g}, "
                  f"kl_coef {before[1]:g}->{self.kl_ctrl.value:g}, actor lr {before[2]:g}->{actor_lr():g}", flush=True)

    def judged(self, metrics: dict[str, float]) -> bool:
        """The guard's decision on `metrics` applied: True to keep the step (guard/* metrics added to a training
        step's), False when rolled back (self.step is then the GOOD checkpoint's)."""
        decision = self.guard.judge(self.step, metrics)
        if not decision.keep:
            self.roll_back(self.step, decision)
            return False
        if decision.metrics:
            metrics.update(decision.metrics)
            metrics["guard/kl_coef"] = float(self.kl_ctrl.value)
        return True

