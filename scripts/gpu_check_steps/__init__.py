"""The GPU check's steps (driver: scripts/gpu_check.py; what each means: docs/gpu_check.md).

Each step is a function `run(ctx) -> dict` in one module here, run by the driver in a subprocess of its own under a
time cap; `summary(result) -> str` gives the step's one printed line; `schema.py` says which fields a passing
result must carry. The same code runs the CPU dry run (`ctx.dry`: tiny sizes, Triton through its interpreter).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Context:
    """What a step knows: dry run or not, a scratch folder shared by the steps, the results written so far."""
    dry: bool
    work: str
    results_path: str

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    def earlier(self, step: str) -> dict:
        """An earlier step's result ({} when it failed or did not run): the PPO step reads the roofline's peak."""
        try:
            with open(self.results_path) as f:
                s = json.load(f)["steps"].get(step, {})
        except (OSError, ValueError):
            return {}
        return s.get("result", {}) if s.get("ok") else {}


def child_env(extra: dict | None = None) -> dict:
    """The environment of a process a step starts: the checkout (the optim step runs a worker of tests/multiprocess/)
    and scripts/ (the steps themselves) on PYTHONPATH."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "scripts"), env.get("PYTHONPATH", "")])
    return env
