"""StepProfiler (global_profiler.steps): a chosen step writes one trace per rank holding a named range per stage and
the ops run inside them; a step that is not chosen writes nothing, and a profiler with no steps opens no ranges.
The trainer wiring (Timer ranges in a real PPO step) is tested in tests/multiprocess/test_operator_view.py."""
import gzip
import json
import os

import torch

from tripod.engine.logging import StepProfiler, Timer
from tripod.engine.logging.profiler import RANGE_PREFIX, trace_path

STAGES = ("reshard", "gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")


def _fake_step(profiler: StepProfiler, gen: torch.Generator) -> None:
    timer = Timer(profiler.range)
    with timer("step"):
        for stage in STAGES:
            with timer(stage):
                a = torch.randn(32, 32, generator=gen)
                (a @ a.T).sum()
    with profiler.range("checkpoint"):
        torch.randn(8, generator=gen).sum()
    assert set(timer.metrics()) == {f"timing_s/{s}" for s in ("step", *STAGES)}  # the timings are unchanged


def _event_names(path: str) -> set[str]:
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    return {e.get("name") for e in trace["traceEvents"]}


def test_chosen_steps_write_one_trace_per_rank_with_every_stage(tmp_path):
    gen = torch.Generator().manual_seed(0)
    run_dir = str(tmp_path)
    # two ranks writing into one run directory (one after the other: torch allows one active profiler per process)
    profilers = [StepProfiler(run_dir, steps=[2, 4], rank=rank) for rank in (0, 1)]
    for profiler in profilers:
        for step in range(1, 5):
            profiler.begin_step(step)
            _fake_step(profiler, gen)
        profiler.end_step()

    assert sorted(os.listdir(os.path.join(run_dir, "profile"))) == ["step_2", "step_4"]
    for step in (2, 4):
        assert sorted(os.listdir(os.path.join(run_dir, "profile", f"step_{step}"))) == [
            "rank_0.trace.json.gz", "rank_1.trace.json.gz"]
        names = _event_names(trace_path(run_dir, step, 0))
        missing = [s for s in (*STAGES, "step", "checkpoint") if RANGE_PREFIX + s not in names]
        assert not missing, f"ranges missing from the step-{step} trace: {missing}"
        assert "aten::mm" in names  # the work inside the ranges is recorded too
    assert profilers[0].written == [trace_path(run_dir, 2, 0), trace_path(run_dir, 4, 0)]


def test_no_steps_chosen_is_free(tmp_path):
    profiler = StepProfiler(str(tmp_path), steps=[])
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        profiler.begin_step(step)
        assert type(profiler.range("gen")).__name__ == "nullcontext"
        assert not torch.autograd.profiler._is_profiler_enabled
        _fake_step(profiler, gen)
    profiler.end_step()
    assert not os.path.exists(os.path.join(str(tmp_path), "profile")) and profiler.written == []


def test_unknown_tool_is_one_line():
    try:
        StepProfiler("unused", steps=[1], tool="perf")
    except ValueError as e:
        assert str(e) == "global_profiler.tool='perf' is not one of ['torch', 'nsys']"
    else:
        raise AssertionError("an unknown profile tool was accepted")
