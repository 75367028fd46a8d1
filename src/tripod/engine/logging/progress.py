"""`ProgressLine`: the one-line console view of a training run (step/total, ETA and a few key metrics).

On a terminal it is a live rich progress bar redrawn in place; when stdout is a file or a pipe (CI, `tee`, torchrun
logs) it prints one plain line per step instead, so logs stay readable.
"""
from __future__ import annotations

import math
import time
from typing import Any, Mapping, Optional, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

DEFAULT_KEYS = ("critic/score/mean", "val/reward_mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
                "critic/vf_loss", "actor/lr", "timing_s/step")
HELD_PREFIX = "val/"  # validation runs every trainer.test_freq steps: its last values stay on the line until the next


def format_metrics(metrics: Mapping[str, Any], keys: Sequence[str]) -> str:
    """`name=value` for those `keys` present in `metrics`, numbers with 4 significant digits."""
    parts = []
    for key in keys:
        if key in metrics:
            value = metrics[key]
            parts.append(f"{key}={value:.4g}" if isinstance(value, (int, float)) else f"{key}={value}")
    return "  ".join(parts)


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class ProgressLine:
    """`update(step, metrics)` after each training step; `close()` at the end (or use as a context manager)."""

    def __init__(self, total_steps: int, keys: Sequence[str] = DEFAULT_KEYS, initial_step: int = 0,
                 console: Optional[Console] = None, description: str = "train") -> None:
        self.total_steps, self.keys, self.initial_step = total_steps, tuple(keys), initial_step
        self.console = console or Console()
        self.live = self.console.is_terminal
        self._start = time.monotonic()
        self._progress: Optional[Progress] = None
        self._held: dict[str, Any] = {}
        if self.live:
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                      TextColumn("{task.fields[metrics]}"), console=self.console)
            self._task = self._progress.add_task(description, total=total_steps, completed=initial_step,
                                                 metrics="")
            self._progress.start()

    def eta_seconds(self, step: int) -> float:
        """Remaining time extrapolated from the steps done in this process (resumed steps do not count)."""
        done = step - self.initial_step
        if done <= 0:
            return math.inf
        return (time.monotonic() - self._start) / done * max(self.total_steps - step, 0)

    def line(self, step: int, metrics: Mapping[str, Any]) -> str:
        return (f"step {step}/{self.total_steps}  eta {format_eta(self.eta_seconds(step))}  "
                f"{format_metrics(metrics, self.keys)}").rstrip()

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._held.update({k: v for k, v in metrics.items() if k.startswith(HELD_PREFIX)})
        metrics = {**self._held, **metrics}
        if self._progress is not None:
            self._progress.update(self._task, completed=step, metrics=format_metrics(metrics, self.keys))
        else:
            self.console.print(self.line(step, metrics), highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> "ProgressLine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
