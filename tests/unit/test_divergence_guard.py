"""DivergenceGuard.judge returns a GuardDecision (keep with guard/* metrics, or roll back to the newest GOOD checkpoint
with the remedies for the rollback count) and never touches the trainer; its state round-trips."""
from __future__ import annotations

import math
import os
import random

import pytest
from omegaconf import OmegaConf

from tripod.engine.checkpoints.manager import COMPLETE, REJECTED
from tripod.engine.config import TripodConfig
from tripod.engine.divergence_guard import GOOD, DivergenceError, DivergenceGuard


def _checkpoint(root: str, step: int, *markers: str) -> str:
    path = os.path.join(root, f"global_step_{step}")
    os.makedirs(path)
    for name in (COMPLETE, *markers):
        open(os.path.join(path, name), "w").close()
    return path


def _guard(root: str, **overrides) -> tuple[DivergenceGuard, object]:
    cfg = OmegaConf.to_object(OmegaConf.structured(TripodConfig))
    g = cfg.trainer.divergence_guard
    g.enabled = True
    for k, v in overrides.items():
        setattr(g, k, v)
    actor = cfg.actor_rollout_ref.actor
    actor.clip_ratio_high = 0.28  # above the remedy: capped; clip_ratio_low 0.2 -> 0.1 as well
    return DivergenceGuard(g, actor, cfg.algorithm.kl_ctrl.target_kl, root), actor


def _step_metrics(rng: random.Random) -> dict[str, float]:
    return {"actor/pg_loss": rng.uniform(-1, 1), "actor/ppo_kl": rng.uniform(0, 0.01),
            "actor/grad_norm": rng.uniform(0.5, 1.5), "critic/grad_norm": rng.uniform(0.5, 1.5)}


def test_keep_then_roll_back_with_remedies(tmp_path, world_of_one):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    root = str(tmp_path)
    guard, actor = _guard(root, max_rollbacks=2)
    base_kl_loss = actor.kl_loss_coef
    _checkpoint(root, 1, GOOD)
    good = _checkpoint(root, 2, GOOD)
    _checkpoint(root, 3)  # saved but never marked GOOD (the step after it diverged before mark_good)

    keep = guard.judge(3, _step_metrics(rng))
    assert keep.keep and keep.checkpoint is None and keep.remedies is None
    assert keep.metrics == {"guard/rollbacks": 0.0, "guard/tripped": 0.0, "guard/lr_scale": 1.0,
                            "guard/clip_ratio": 0.2}
    val = guard.judge(3, {"val/reward_mean": rng.uniform(0.4, 0.8)})
    assert val.keep and val.metrics == {}  # a validation adds no guard/* metrics

    bad = dict(_step_metrics(rng), **{"critic/vf_loss": float("nan")})
    first = guard.judge(4, bad)
    assert not first.keep and first.checkpoint == good and first.checkpoint_step == 2
    assert first.reasons == ("non-finite critic/vf_loss=nan",)
    assert first.kl_coef_add == 0.002
    r = first.remedies
    assert (r.rollbacks, r.clip_ratios, r.lr_scale) == (1, (0.1, 0.1, 0.1), 0.5)
    assert r.kl_loss_coef == pytest.approx(base_kl_loss + 0.002)
    assert guard.history == {}

    after = guard.judge(3, _step_metrics(rng))  # the replayed step: tripped reported once
    assert after.keep and after.metrics["guard/tripped"] == 1.0 and after.metrics["guard/rollbacks"] == 1.0
    assert after.metrics["guard/lr_scale"] == 0.5 and after.metrics["guard/clip_ratio"] == 0.1
    assert guard.judge(4, _step_metrics(rng)).metrics["guard/tripped"] == 0.0

    open(os.path.join(good, REJECTED), "w").close()  # rejected checkpoints are never a target
    spike = _step_metrics(rng)
    spike["actor/grad_norm"] = 100.0
    guard.history["actor/grad_norm"] = [1.0, 1.1, 0.9]
    second = guard.judge(5, spike)
    assert not second.keep and second.checkpoint_step == 1 and "running median" in second.reasons[0]
    assert (second.remedies.rollbacks, second.remedies.lr_scale) == (2, 0.25)
    assert second.remedies.kl_loss_coef == pytest.approx(base_kl_loss + 2 * 0.002)

    with pytest.raises(DivergenceError, match="after 2 rollback"):
        guard.judge(6, {"actor/ppo_kl": math.inf})


def test_no_good_checkpoint_and_disabled_guard(tmp_path, world_of_one):
    guard, _ = _guard(str(tmp_path))
    _checkpoint(str(tmp_path), 1)  # complete but not GOOD
    with pytest.raises(DivergenceError, match="no GOOD checkpoint"):
        guard.judge(2, {"actor/pg_loss": float("nan")})
    off, _ = _guard(str(tmp_path), enabled=False)
    decision = off.judge(2, {"actor/pg_loss": float("nan")})
    assert decision.keep and decision.metrics == {} and off.remedies() is None


def test_state_round_trip_restores_the_remedies(tmp_path, world_of_one):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    guard, _ = _guard(str(tmp_path))
    guard.rollbacks, guard.best_val = 2, rng.uniform(0.1, 0.9)
    guard.history = {"critic/grad_norm": [rng.uniform(0, 2) for _ in range(5)]}
    fresh, _ = _guard(str(tmp_path))
    assert fresh.remedies() is None
    fresh.load_state_dict(guard.state_dict())
    assert fresh.state_dict() == guard.state_dict() and fresh.remedies() == guard.remedies()
    off, _ = _guard(str(tmp_path), enabled=False)
    off.load_state_dict(guard.state_dict())  # a disabled guard keeps nothing
    assert off.rollbacks == 0 and off.remedies() is None
