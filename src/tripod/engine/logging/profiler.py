"""`StepProfiler`: traces of chosen PPO steps (`global_profiler.steps`, `global_profiler.tool`).

The trainer calls `begin_step(k)` at the top of every step and `end_step()` after the loop; the step's `Timer` is
built with `Timer(ranges=profiler.range)`, so every timed stage (reshard, gen, reward, old_log_prob, ref, values,
adv, update_critic, update_actor, and the trainer's validation and checkpoint) is also a named range
`tripod/<stage>` inside the trace. A step that is not chosen, or a run with no `global_profiler.steps`, costs one set
lookup per step and a `nullcontext` per stage.

Tools:
- `torch`: `torch.profiler` (CPU, plus CUDA kernels on a GPU) from the start of step k to the start of step k+1 (or
  the end of the run), written as `RUN_DIR/profile/step_<k>/rank_<r>.trace.json.gz` (open in Perfetto or
  chrome://tracing).
- `nsys`: NVTX ranges, and `cudaProfilerStart/Stop` around the chosen steps; launch the ranks under
  `nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat -o RUN_DIR/profile/rank_%q{RANK}`
  so Nsight Systems writes one report per rank per chosen step.
"""
from __future__ import annotations

import contextlib
import os
from typing import ContextManager, Iterable, Optional

import torch

PROFILE_TOOLS = ("torch", "nsys")
RANGE_PREFIX = "tripod/"


def trace_path(run_dir: str, step: int, rank: int) -> str:
    """Where the torch tool writes rank `rank`'s trace of step `step`."""
    return os.path.join(run_dir, "profile", f"step_{step}", f"rank_{rank}.trace.json.gz")


class StepProfiler:
    """Profiles the steps in `steps` (1-based PPO step numbers) with `tool`; see the module docstring."""

    def __init__(self, run_dir: str, steps: Iterable[int] = (), tool: str = "torch", rank: int = 0) -> None:
        if tool not in PROFILE_TOOLS:
            raise ValueError(f"global_profiler.tool={tool!r} is not one of {list(PROFILE_TOOLS)}")
        self.run_dir, self.steps, self.tool, self.rank = run_dir, frozenset(steps), tool, rank
        self.current: Optional[int] = None  # the chosen step being profiled now
        self._profile: Optional[torch.profiler.profile] = None
        self.written: list[str] = []

    def begin_step(self, step: int) -> None:
        """Close the previous step's trace (if any); start profiling when `step` is chosen."""
        self.end_step()
        if step not in self.steps:
            return
        self.current = step
        if self.tool == "torch":
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.__enter__()
        else:
            torch.cuda.profiler.start()

    def end_step(self) -> None:
        """Stop profiling and write the trace of the chosen step in progress; no-op otherwise."""
        if self.current is None:
            return
        step, self.current = self.current, None
        if self.tool == "torch":
            profile, self._profile = self._profile, None
            profile.__exit__(None, None, None)
            path = trace_path(self.run_dir, step, self.rank)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            profile.export_chrome_trace(path)
            self.written.append(path)
        else:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()

    def range(self, name: str) -> ContextManager:
        """A named range `tripod/<name>` in the current trace; a `nullcontext` outside chosen steps."""
        if self.current is None:
            return contextlib.nullcontext()
        if self.tool == "torch":
            return torch.profiler.record_function(RANGE_PREFIX + name)
        return torch.cuda.nvtx.range(RANGE_PREFIX + name)
