"""KL coefficient controllers for KL reward shaping (beta in r - beta * kl).

`FixedKLController` keeps beta constant; `AdaptiveKLController` is Ziegler et al. (2019):
    e = clip(current_kl / target_kl - 1, -0.2, 0.2),  beta <- beta * (1 + e * n_steps / horizon)
with n_steps the number of samples behind `current_kl` and horizon in samples (as in verl).
Both take `warmup_steps`: beta ramps linearly over the first `warmup_steps` calls of `update`
(value = beta * min(1, (updates + 1) / warmup_steps)); adaptation always acts on the un-ramped beta.
`state_dict()` / `load_state_dict()` round-trip everything the trainer checkpoints.
"""
from __future__ import annotations

from typing import Any

ADAPTIVE_ERROR_CLIP = 0.2
KL_CONTROLLERS = ("fixed", "adaptive")  # the kinds build_kl_controller accepts


class FixedKLController:
    """Constant KL coefficient (optionally warmed up)."""

    def __init__(self, kl_coef: float, warmup_steps: int = 0):
        if not kl_coef >= 0:
            raise ValueError(f"kl_coef={kl_coef} must be >= 0")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        self.kl_coef = float(kl_coef)
        self.warmup_steps = int(warmup_steps)
        self.num_updates = 0

    @property
    def value(self) -> float:
        if self.warmup_steps and self.num_updates < self.warmup_steps:
            return self.kl_coef * (self.num_updates + 1) / self.warmup_steps
        return self.kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        self.num_updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, "kl_coef": self.kl_coef, "num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != type(self).__name__:
            raise ValueError(f"state kind={state.get('kind')!r} cannot be loaded into a {type(self).__name__}")
        self.kl_coef = float(state["kl_coef"])
        self.num_updates = int(state["num_updates"])


class AdaptiveKLController(FixedKLController):
    """Proportional controller steering the observed KL towards `target_kl`."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int, warmup_steps: int = 0):
        super().__init__(kl_coef, warmup_steps)
        if not target_kl > 0:
            raise ValueError(f"target_kl={target_kl} must be > 0")
        if not horizon > 0:
            raise ValueError(f"horizon={horizon} must be > 0")
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target_kl - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.kl_coef *= 1.0 + error * n_steps / self.horizon
        super().update(current_kl, n_steps)


def build_kl_controller(kind: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None,
                        warmup_steps: int = 0) -> FixedKLController:
    """`kind` "fixed" or "adaptive" (the latter needs target_kl and horizon)."""
    if kind == "fixed":
        return FixedKLController(kl_coef, warmup_steps)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("an adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon, warmup_steps)
    raise ValueError(f"kind={kind!r} is not a KL controller; choose 'fixed' or 'adaptive'")
