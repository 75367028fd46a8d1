"""Divergence guard (`trainer.divergence_guard`): reject a diverged PPO step, roll back, apply remedies.

After every step the guard looks at the step's metrics (rank 0 decides, every rank follows):

    non-finite   any actor/* or critic/* metric is NaN/inf (losses, grad norms, KL, values), or the optimizer
                 refused a non-finite step
    kl           actor/ppo_kl > max_kl (default kl_multiple x the KL target)
    grad spike   actor/ or critic/grad_norm > grad_norm_spike x the median of the last grad_norm_window accepted steps
    val collapse val/reward_mean < val_collapse_ratio x the best validation reward so far

The guard only judges: `judge(step, metrics)` returns a `GuardDecision` and the trainer applies it. On a trip
the decision names the newest checkpoint marked GOOD; the trainer marks newer ones REJECTED (resume=auto skips
them), loads it (weights, optimizer, RNG, data position, KL controller: PPOTrainer.load_state_dict) and applies the
decision's remedies (clip_ratio -> remedy_clip_ratio, kl_coef + remedy_kl_coef_add, lr x remedy_lr_scale per
rollback, as in verl's PPO tuning practice), prints one console line and reports `guard/*` metrics with the next
accepted step. After max_rollbacks trips `judge` raises DivergenceError. A checkpoint is marked GOOD when it is
saved after an accepted step; the guard's state (rollback count, best validation reward, grad-norm history) is part
of the trainer's state in it, so a crash-resume keeps the remedies.
"""
from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch.distributed as dist

from tripod.engine.checkpoints.manager import GOOD, REJECTED, checkpoint_steps
from tripod.engine.config import DivergenceGuardConfig
from tripod.engine.launch import TrainingStopped

GRAD_NORMS = ("actor/grad_norm", "critic/grad_norm")


class DivergenceError(TrainingStopped):
    """The run kept diverging after max_rollbacks rollbacks (or had no good checkpoint to go back to)."""


@dataclass(frozen=True)
class Remedies:
    """The settings after `rollbacks` rollbacks, for the trainer to apply (idempotent: a function of the count)."""
    rollbacks: int
    clip_ratios: tuple[float, float, float]  # actor.clip_ratio, clip_ratio_low, clip_ratio_high
    kl_loss_coef: float                     # actor.kl_loss_coef
    lr_scale: float                         # of the actor's and critic's whole LR schedules


@dataclass(frozen=True)
class GuardDecision:
    """The guard's verdict on one step's metrics. `keep`: log `metrics` (guard/*, training steps only) and go on.
    Otherwise roll back: load `checkpoint` (step `checkpoint_step`), mark newer checkpoints rejected, add
    `kl_coef_add` to the KL controller's coefficient and apply `remedies`."""
    keep: bool
    reasons: tuple[str, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: str | None = None
    checkpoint_step: int | None = None
    kl_coef_add: float = 0.0
    remedies: Remedies | None = None


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
    """Judges steps from their metrics and the checkpoints on disk; never touches the trainer. Its own state (rollback
    count, best validation reward, grad-norm history) travels in the trainer's state_dict()."""

    def __init__(self, cfg: DivergenceGuardConfig, actor_cfg, kl_ctrl_target: float | None, ckpt_root: str) -> None:
        self.cfg, self.ckpt_root = cfg, ckpt_root
        target = actor_cfg.target_kl if actor_cfg.target_kl is not None else kl_ctrl_target
        self.max_kl = cfg.max_kl if cfg.max_kl is not None else cfg.kl_multiple * target
        self.rollbacks, self.best_val, self.tripped = 0, None, 0.0
        self.history: dict[str, list[float]] = {}
        self.base_clip = (actor_cfg.clip_ratio, actor_cfg.clip_ratio_low, actor_cfg.clip_ratio_high)
        self.base_kl_loss_coef = actor_cfg.kl_loss_coef

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
    def judge(self, step: int, metrics: dict[str, float]) -> GuardDecision:
        """Keep or roll back the step that produced `metrics` (rank 0 decides, every rank gets the same decision).
        Called with the training metrics, then with the validation metrics (so a diverged model is never
        validated). Raises DivergenceError after max_rollbacks or without a GOOD checkpoint."""
        if not self.enabled:
            return GuardDecision(keep=True)
        verdict: list = [None]
        if dist.get_rank() == 0:
            verdict[0] = find_reasons(metrics, max_kl=self.max_kl, spike=self.cfg.grad_norm_spike,
                                      history=self.history, min_history=self.cfg.grad_norm_min_history,
                                      best_val=self.best_val, val_ratio=self.cfg.val_collapse_ratio)
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            return self._roll_back(step, verdict[0])
        for key in GRAD_NORMS:
            if key in metrics:
                self.history.setdefault(key, []).append(metrics[key])
                del self.history[key][:-self.cfg.grad_norm_window]
        if "val/reward_mean" in metrics:
            self.best_val = max(self.best_val or 0.0, metrics["val/reward_mean"])
        out: dict[str, float] = {}
        if any(k.startswith(("actor/", "critic/")) for k in metrics):  # a training step (not a validation)
            remedies = self.remedies()
            out = {"guard/rollbacks": float(self.rollbacks), "guard/tripped": self.tripped,
                   "guard/lr_scale": self.cfg.remedy_lr_scale ** self.rollbacks,
                   "guard/clip_ratio": remedies.clip_ratios[0] if remedies else self.base_clip[0]}
            self.tripped = 0.0
        return GuardDecision(keep=True, metrics=out)

    def _good_checkpoints(self, before: int) -> list[tuple[int, str]]:
        return [(s, p) for s, p in checkpoint_steps(self.ckpt_root)
                if s < before and os.path.exists(os.path.join(p, GOOD))
                and not os.path.exists(os.path.join(p, REJECTED))]

    def _roll_back(self, step: int, reasons: list[str]) -> GuardDecision:
        what = "; ".join(reasons)
        if self.rollbacks >= self.cfg.max_rollbacks:
            raise DivergenceError(f"step {step} diverged ({what}) after {self.rollbacks} rollback(s) = "
                                  f"trainer.divergence_guard.max_rollbacks; lower the learning rate or inspect the "
                                  f"data, then resume from the last GOOD checkpoint in {self.ckpt_root}")
        good = self._good_checkpoints(step)
        if not good:
            raise DivergenceError(f"step {step} diverged ({what}) and there is no GOOD checkpoint to roll back to; "
                                  "set trainer.save_freq so that checkpoints exist")
        target_step, target = good[-1]
        self.rollbacks += 1
        self.history = {}
        self.tripped = 1.0
        return GuardDecision(keep=False, reasons=tuple(reasons), checkpoint=target, checkpoint_step=target_step,
                             kl_coef_add=self.cfg.remedy_kl_coef_add, remedies=self.remedies())

    def remedies(self) -> Remedies | None:
        """The remedies for the rollbacks so far (None before the first)."""
        if self.rollbacks == 0:
            return None
        clip = tuple(min(c, self.cfg.remedy_clip_ratio) for c in self.base_clip)
        return Remedies(self.rollbacks, clip, self.base_kl_loss_coef + self.cfg.remedy_kl_coef_add * self.rollbacks,
                        self.cfg.remedy_lr_scale ** self.rollbacks)

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"rollbacks": self.rollbacks, "best_val": self.best_val, "history": self.history}

    def load_state_dict(self, state: dict) -> None:
        """After a resume: the rollback count (and so the remedies) of the checkpoint the run continues from."""
        if self.enabled:
            self.rollbacks, self.best_val, self.history = state["rollbacks"], state["best_val"], state["history"]

    def mark_good(self, ckpt_dir: str) -> None:
        """Called on rank 0 after a checkpoint of an accepted step is complete."""
        if self.enabled:
            open(os.path.join(ckpt_dir, GOOD), "w").close()
