"""The LR schedule (megatron-core's OptimizerParamScheduler as tripod builds it) against the closed-form formulas:
linear warm-up from 0 (Goyal et al. 2017), then constant, linear, or cosine (Loshchilov & Hutter 2017) decay to
min_lr_ratio * lr; and its state surviving a JSON round trip (how checkpoints store it) exactly."""
import json
import math

import pytest
import torch

from tripod.engine.config import OptimConfig
from tripod.engine.workers.lr_schedule import build_lr_scheduler, warmup_steps


def closed_form(style: str, k: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """The LR of the k-th optimizer step (k = 0, 1, ...)."""
    if warmup > 0 and k <= warmup:
        return lr * k / warmup
    if style == "constant":
        return lr
    if k >= total:
        return min_lr
    progress = (k - warmup) / (total - warmup)
    shape = 1 - progress if style == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_lr + (lr - min_lr) * shape


def _optimizer():
    return torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], lr=123.0)  # the scheduler overrides the lr


def _lrs(scheduler, optimizer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        scheduler.step(1)
    return out


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup, ratio", [(-1, 0.0), (3, 0.0), (-1, 0.25)])
def test_schedule_matches_the_closed_form(style, warmup, ratio):
    total, lr, min_ratio = 20, 3e-4, 0.1
    optim = OptimConfig(lr=lr, lr_warmup_steps=warmup, lr_warmup_steps_ratio=ratio, lr_decay_style=style,
                        min_lr_ratio=min_ratio, weight_decay=0.05)
    w = warmup_steps(optim, total)
    assert w == (warmup if warmup >= 0 else int(ratio * total))
    opt = _optimizer()
    got = _lrs(build_lr_scheduler(opt, optim, total), opt, total + 3)  # past the end: min_lr (or lr if constant)
    want = [closed_form(style, k, lr, min_ratio * lr, w, total) for k in range(total + 3)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-18)
    assert opt.param_groups[0]["weight_decay"] == 0.05
    if style != "constant":
        assert got[total] == pytest.approx(min_ratio * lr) and max(got) == pytest.approx(lr)


def test_a_wrong_formula_would_be_caught():
    """The comparison has teeth: linear and cosine differ mid-way, and off-by-one warm-up differs at step 1."""
    assert closed_form("linear", 10, 1.0, 0.0, 0, 20) != pytest.approx(closed_form("cosine", 11, 1.0, 0.0, 0, 20))
    opt = _optimizer()
    got = _lrs(build_lr_scheduler(opt, OptimConfig(lr=1.0, lr_warmup_steps=4), 10), opt, 3)
    assert got != pytest.approx([closed_form("constant", k, 1.0, 0.0, 3, 10) for k in range(3)])


def test_state_round_trips_exactly_through_json():
    optim = OptimConfig(lr=1e-3, lr_warmup_steps=2, lr_decay_style="cosine", min_lr_ratio=0.05)
    opt = _optimizer()
    sched = build_lr_scheduler(opt, optim, 12)
    _lrs(sched, opt, 5)
    state = json.loads(json.dumps(sched.state_dict()))  # as in trainer_state.json
    rest = _lrs(sched, opt, 9)

    fresh_opt = _optimizer()
    fresh = build_lr_scheduler(fresh_opt, optim, 12)
    fresh.load_state_dict(state)
    assert _lrs(fresh, fresh_opt, 9) == rest  # bit-exact, every remaining step
    not_restored = _optimizer()
    assert _lrs(build_lr_scheduler(not_restored, optim, 12), not_restored, 9) != rest


def test_warmup_as_long_as_the_run_still_builds():
    opt = _optimizer()
    got = _lrs(build_lr_scheduler(opt, OptimConfig(lr=1.0, lr_warmup_steps=5, lr_decay_style="linear"), 5), opt, 7)
    assert got[:6] == pytest.approx([0, 0.2, 0.4, 0.6, 0.8, 1.0])
