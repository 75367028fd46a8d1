"""Tracker (metrics.jsonl + TensorBoard, read back with tensorboard's own reader), resume truncation, the console
progress line, Timer and metric reductions."""
import io
import json
import os
import random
import statistics
import time

import numpy as np
import pytest
import torch
from rich.console import Console
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tripod.engine.logging import ProgressLine, Timer, Tracker, append_to_dict, reduce_metrics
from tripod.engine.logging.progress import format_eta


def _read_jsonl(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _read_tensorboard(run_dir):
    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _random_step_metrics(rng, step):
    return {"actor/pg_loss": torch.tensor(rng.uniform(-1, 1)), "critic/vf_loss": np.float32(rng.uniform(0, 2)),
            "critic/score/mean": rng.random(), "perf/total_num_tokens": np.int64(rng.randint(100, 9999)),
            "timing_s/gen": rng.uniform(0.1, 3.0), "step_note": f"s{step}"}


def test_tracker_writes_jsonl_and_tensorboard_and_resumes(tmp_path):
    rng = random.Random(0)
    logged = {}
    out = io.StringIO()
    with Tracker(tmp_path, total_steps=6, console=Console(file=out, width=200)) as tracker:
        for step in range(1, 5):
            logged[step] = _random_step_metrics(rng, step)
            tracker.log(logged[step], step)
            assert len(_read_jsonl(tmp_path)) == step  # flushed at every step
    entries = _read_jsonl(tmp_path)
    assert [e["step"] for e in entries] == [1, 2, 3, 4]
    for entry in entries:
        expected = logged[entry["step"]]
        assert entry["actor/pg_loss"] == pytest.approx(expected["actor/pg_loss"].item())
        assert entry["critic/vf_loss"] == pytest.approx(float(expected["critic/vf_loss"]))
        assert entry["perf/total_num_tokens"] == int(expected["perf/total_num_tokens"])
        assert entry["step_note"] == expected["step_note"]
    board = _read_tensorboard(tmp_path)
    assert set(board) == {"actor/pg_loss", "critic/vf_loss", "critic/score/mean", "perf/total_num_tokens",
                          "timing_s/gen"}  # strings go to the jsonl only
    for tag, points in board.items():
        assert [s for s, _ in points] == [1, 2, 3, 4]
        assert [v for _, v in points] == pytest.approx([float(logged[s][tag]) for s in range(1, 5)], rel=1e-6)
    assert "step 4/6" in out.getvalue() and "actor/pg_loss=" in out.getvalue()

    # resume from step 2: steps 3 and 4 of the interrupted run disappear, the new step 3 replaces them
    with Tracker(tmp_path, resume_step=2, total_steps=6, backends=["jsonl", "tensorboard"]) as tracker:
        assert [e["step"] for e in _read_jsonl(tmp_path)] == [1, 2]
        tracker.log({"actor/pg_loss": 42.0}, 3)
    assert [e["step"] for e in _read_jsonl(tmp_path)] == [1, 2, 3] and _read_jsonl(tmp_path)[-1]["actor/pg_loss"] == 42
    board = _read_tensorboard(tmp_path)
    assert [s for s, _ in board["actor/pg_loss"]] == [1, 2, 3] and board["actor/pg_loss"][-1][1] == 42.0
    assert [s for s, _ in board["critic/vf_loss"]] == [1, 2]

    with Tracker(tmp_path, backends=["jsonl"]) as tracker:  # a fresh run in the same directory starts over
        tracker.log({"x": 1}, 0)
    assert _read_jsonl(tmp_path) == [{"step": 0, "x": 1}]


def test_tracker_errors(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.logger has unknown backends \['neptune'\]"):
        Tracker(tmp_path, backends=["jsonl", "neptune"])
    with Tracker(tmp_path, backends=["jsonl"]) as tracker:
        with pytest.raises(TypeError, match="metric 'actor/entropy' .* not a scalar"):
            tracker.log({"actor/entropy": torch.randn(3)}, 1)


def test_progress_line_plain_and_live():
    out = io.StringIO()
    line = ProgressLine(10, keys=("actor/pg_loss", "missing/key"), console=Console(file=out, width=200))
    assert not line.live
    time.sleep(0.05)
    line.update(2, {"actor/pg_loss": 0.123456, "other": 1.0})
    text = out.getvalue()
    assert text.startswith("step 2/10  eta 0:00:0") and "actor/pg_loss=0.1235" in text and "other" not in text
    assert line.eta_seconds(2) == pytest.approx((time.monotonic() - line._start) / 2 * 8, rel=0.5)
    assert format_eta(3725) == "1:02:05" and format_eta(float("inf")) == "?"
    term = io.StringIO()
    with ProgressLine(10, keys=("actor/pg_loss",), initial_step=3,
                      console=Console(file=term, force_terminal=True, width=200)) as live:
        assert live.live
        live.update(5, {"actor/pg_loss": 0.5})
    assert "5/10" in term.getvalue() and "actor/pg_loss=0.5" in term.getvalue()


def test_timer_and_reductions():
    timer = Timer()
    for _ in range(2):
        with timer("gen"):
            time.sleep(0.02)
    with timer("update_actor"):
        pass
    timings = timer.metrics()
    assert set(timings) == {"timing_s/gen", "timing_s/update_actor"} and timings["timing_s/gen"] >= 0.04
    assert timer.metrics() == {}  # reset for the next step

    rng = random.Random(3)
    per_micro = [{"actor/pg_loss": rng.uniform(-1, 1), "actor/pg_clipfrac": torch.tensor(rng.random())}
                 for _ in range(7)]
    accumulated = {}
    for m in per_micro:
        append_to_dict(accumulated, m)
    expected = {"actor/pg_loss": statistics.fmean(m["actor/pg_loss"] for m in per_micro),
                "actor/pg_clipfrac": statistics.fmean(m["actor/pg_clipfrac"].item() for m in per_micro)}
    assert reduce_metrics(accumulated) == pytest.approx(expected)
    assert reduce_metrics(per_micro) == pytest.approx(expected)
    with pytest.raises(ValueError, match="'empty' has no values"):
        reduce_metrics({"empty": []})
