"""Divergence guard (`trainer.divergence_guard`): reject a diverged PPO step, roll back, apply remedies.

After every step the guard looks at the step's metrics (rank 0 decides, every rank follows):

    non-finite   any actor/* or critic/* metric is NaN/inf (losses, grad norms, KL, values), or the optimizer
                 refused a non-finite step
    kl           actor/ppo_kl > max_kl (default kl_multiple x the KL target)
    grad spike   actor/ or critic/grad_norm > grad_norm_spike x the median of the last grad_norm_window accepted steps
    val collapse val/reward_mean < val_collapse_ratio x the best validation reward so far

On a trip it loads the newest checkpoint marked GOOD (the trainer's own CheckpointManager.resume: weights,
optimizer, RNG, data position, KL controller), marks newer ones REJECTED (resume=auto skips them), applies the
remedies (clip_ratio -> remedy_clip_ratio, kl_coef + remedy_kl_coef_add, lr x remedy_lr_scale per rollback, as in
verl's PPO tuning practice), prints one console line and reports `guard/*` metrics with the next accepted step.
After max_rollbacks trips it raises DivergenceError. A checkpoint is marked GOOD when it is saved after an
accepted step (its guard_state.json carries the rollback count, so a crash-resume keeps the remedies).
"""
from __future__ import annotations

import json
import math
import os
import statistics
from typing import Callable

import torch.distributed as dist

from tripod.engine.checkpoints.manager import COMPLETE, REJECTED, checkpoint_steps
from tripod.engine.launch import TrainingStopped

GOOD = "GOOD"
STATE_FILE = "guard_state.json"
GRAD_NORMS = ("actor/grad_norm", "critic/grad_norm")


class DivergenceError(TrainingStopped):
    """The run kept diverging after max_rollbacks rollbacks (or had no good checkpoint to go back to)."""


def find_reasons(metrics: dict[str, float], *, max_kl: float | None, spike: float, history: dict[str, list[float]],
                 min_history: int, best_val: float | None, val_ratio: float) -> list[str]:
    """What tripped in one step's metrics (empty list: the step is accepted). Pure; unit-tested."""
    reasons = [f"non-finite {k}={v}" for k, v in sorted(metrics.items())
               if k.startswith(("actor/", "critic/")) and isinstance(v, float) and not math.isfinite(v)]
    if reasons:
        return reasons
    kl = metrics.get("actor/ppo_kl")
    if max_kl is not None and kl is not None and kl > max_kl:
        reasons.append(f"actor/ppo_kl={kl:.4g} > max_kl={max_kl:.4g}")
    for key in GRAD_NORMS:
        past = history.get(key, [])
        if key in metrics and len(past) >= min_history and spike > 0:
            median = statistics.median(past)
            if metrics[key] > spike * median:
                reasons.append(f"{key}={metrics[key]:.4g} > {spike:g} x running median {median:.4g}")
    val = metrics.get("val/reward_mean")
    if val is not None and best_val is not None and best_val > 0 and val_ratio > 0 and val < val_ratio * best_val:
        reasons.append(f"val/reward_mean={val:.4g} < {val_ratio:g} x best {best_val:.4g}")
    return reasons


class DivergenceGuard:
    def __init__(self, trainer) -> None:
        self.t, self.cfg = trainer, trainer.cfg.trainer.divergence_guard
        actor = trainer.cfg.actor_rollout_ref.actor
        target = actor.target_kl if actor.target_kl is not None else trainer.cfg.algorithm.kl_ctrl.target_kl
        self.max_kl = self.cfg.max_kl if self.cfg.max_kl is not None else self.cfg.kl_multiple * target
        self.rollbacks, self.best_val, self.tripped = 0, None, 0.0
        self.history: dict[str, list[float]] = {}
        self.base = dict(clip=(actor.clip_ratio, actor.clip_ratio_low, actor.clip_ratio_high),
                         kl_loss=actor.kl_loss_coef)

    @property
    def enabled(self) -> bool:
        return bool(self.cfg.enabled)

    def run_step(self, step_fn: Callable, *args) -> dict[str, float]:
        """`step_fn(*args)`; an optimizer that refuses a non-finite step becomes a non-finite metric."""
        try:
            return step_fn(*args)
        except RuntimeError as e:
            if not self.enabled or "non-finite" not in str(e):
                raise
            return {"actor/grad_norm": float("nan")}

    # ---- the verdict --------------------------------------------------------------------------
    def accept(self, step: int, metrics: dict[str, float]) -> bool:
        """True: keep the step (guard/* metrics added to a training step's). False: rolled back; trainer.step is
        the good checkpoint's step. Called with the training metrics, then with the validation metrics (so a
        diverged model is never validated)."""
        if not self.enabled:
            return True
        verdict = [None]
        if dist.get_rank() == 0:
            verdict[0] = find_reasons(metrics, max_kl=self.max_kl, spike=self.cfg.grad_norm_spike,
                                      history=self.history, min_history=self.cfg.grad_norm_min_history,
                                      best_val=self.best_val, val_ratio=self.cfg.val_collapse_ratio)
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            self._roll_back(step, verdict[0])
            return False
        for key in GRAD_NORMS:
            if key in metrics:
                self.history.setdefault(key, []).append(metrics[key])
                del self.history[key][:-self.cfg.grad_norm_window]
        if "val/reward_mean" in metrics:
            self.best_val = max(self.best_val or 0.0, metrics["val/reward_mean"])
        if any(k.startswith(("actor/", "critic/")) for k in metrics):  # a training step (not a validation)
            metrics.update(self.metrics())
            self.tripped = 0.0
        return True

    def metrics(self) -> dict[str, float]:
        a = self.t.cfg.actor_rollout_ref.actor
        return {"guard/rollbacks": float(self.rollbacks), "guard/tripped": self.tripped,
                "guard/lr_scale": self.cfg.remedy_lr_scale ** self.rollbacks, "guard/clip_ratio": a.clip_ratio,
                "guard/kl_coef": float(self.t.kl_ctrl.value)}

    def _good_checkpoints(self, before: int) -> list[tuple[int, str]]:
        return [(s, p) for s, p in checkpoint_steps(self.t.ckpt.root)
                if s < before and os.path.exists(os.path.join(p, GOOD))
                and not os.path.exists(os.path.join(p, REJECTED))]

    def _roll_back(self, step: int, reasons: list[str]) -> None:
        what = "; ".join(reasons)
        if self.rollbacks >= self.cfg.max_rollbacks:
            raise DivergenceError(f"step {step} diverged ({what}) after {self.rollbacks} rollback(s) = "
                                  f"trainer.divergence_guard.max_rollbacks; lower the learning rate or inspect the "
                                  f"data, then resume from the last GOOD checkpoint in {self.t.ckpt.root}")
        good = self._good_checkpoints(step)
        if not good:
            raise DivergenceError(f"step {step} diverged ({what}) and there is no GOOD checkpoint to roll back to; "
                                  "set trainer.save_freq so that checkpoints exist")
        target_step, target = good[-1]
        if dist.get_rank() == 0:
            for s, p in checkpoint_steps(self.t.ckpt.root):
                if s > target_step:
                    open(os.path.join(p, REJECTED), "w").close()
        dist.barrier()
        a = self.t.cfg.actor_rollout_ref.actor
        before = (a.clip_ratio, self.t.kl_ctrl.value, self.lr_of(self.t.actor))
        self.t.step = self.t.ckpt.resume(target)
        self.rollbacks += 1
        self.history = {}
        self.t.kl_ctrl.kl_coef += self.cfg.remedy_kl_coef_add
        self.apply_remedies()
        self.tripped = 1.0
        if dist.get_rank() == 0:
            print(f"guard: step {step} tripped ({what}); rolled back to {os.path.basename(target)} "
                  f"(rollback {self.rollbacks}/{self.cfg.max_rollbacks}); clip_ratio {before[0]:g}->{a.clip_ratio:g}, "
                  f"kl_coef {before[1]:g}->{self.t.kl_ctrl.value:g}, actor lr {before[2]:g}->"
                  f"{self.lr_of(self.t.actor):g}", flush=True)

    # ---- remedies --------------------------------------------------------------------------------
    @staticmethod
    def lr_of(worker) -> float:
        return float(worker.optimizer.param_groups[0]["lr"]) if worker is not None else float("nan")

    def apply_remedies(self) -> None:
        """Set clip ratio, KL-loss coefficient and learning rates for `self.rollbacks` rollbacks (idempotent)."""
        if self.rollbacks == 0:
            return
        cfg, a = self.t.cfg, self.t.cfg.actor_rollout_ref.actor
        a.clip_ratio, a.clip_ratio_low, a.clip_ratio_high = (min(c, self.cfg.remedy_clip_ratio)
                                                             for c in self.base["clip"])
        a.kl_loss_coef = self.base["kl_loss"] + self.cfg.remedy_kl_coef_add * self.rollbacks
        scale = self.cfg.remedy_lr_scale ** self.rollbacks
        for worker, optim in ((self.t.actor, a.optim), (self.t.critic, cfg.critic.optim)):
            if worker is None:
                continue
            # the LR scheduler sets every group's lr from the group's max_lr / min_lr at each optimizer step:
            # scale the schedule, not just this step's lr
            sched = worker.lr_scheduler
            sched.max_lr, sched.min_lr = optim.lr * scale, optim.min_lr_ratio * optim.lr * scale
            for group in worker.optimizer.param_groups:
                group["max_lr"], group["min_lr"] = sched.max_lr, sched.min_lr
                group["lr"] = sched.get_lr(group)

    # ---- checkpoints -------------------------------------------------------------------------------
    def mark_good(self, ckpt_dir: str) -> None:
        """Called on rank 0 after a checkpoint of an accepted step is complete."""
        if not self.enabled:
            return
        with open(os.path.join(ckpt_dir, STATE_FILE), "w") as f:
            json.dump({"rollbacks": self.rollbacks, "best_val": self.best_val, "history": self.history}, f)
        open(os.path.join(ckpt_dir, GOOD), "w").close()

    def restore(self, ckpt_dir: str | None) -> None:
        """After a resume: the rollback count (and so the remedies) of the checkpoint the run continues from."""
        path = os.path.join(ckpt_dir or "", STATE_FILE)
        if not self.enabled or not ckpt_dir or not os.path.exists(path) or not os.path.exists(
                os.path.join(ckpt_dir, COMPLETE)):
            return
        with open(path) as f:
            state = json.load(f)
        self.rollbacks, self.best_val, self.history = state["rollbacks"], state["best_val"], state["history"]
        self.apply_remedies()
