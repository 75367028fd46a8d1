"""`Tracker`: where a run's metrics go (metrics.jsonl, TensorBoard, the console), plus `Timer` and metric reductions.

Metric names are passed through as given; use verl's (actor/pg_loss, critic/vf_loss, critic/score/mean,
timing_s/gen, perf/throughput, ...). One `log(metrics, step)` call per training step writes:

- `run_dir/metrics.jsonl`: one JSON object per call, {"step": step, **metrics}, appended and flushed,
- `run_dir/tensorboard/`: one scalar per numeric metric (tensorboard --logdir run_dir/tensorboard),
- the console: a `ProgressLine` with step/total, ETA and a few key metrics,
- wandb / mlflow (logging/experiment_trackers.py): a run named project_name / experiment_name with `config` as its
  config, the same scalars per step.

`log_samples(samples, step)` writes validation samples (trainer.log_val_generations) as one JSON line each to
`run_dir/val_generations.jsonl`, a markdown table in TensorBoard's text tab (`val/generations`) and a
`val/generations` table in wandb / MLflow.

Resuming: `Tracker(run_dir, resume_step=k)` drops every metrics.jsonl entry with step > k and tells TensorBoard to
purge events after k, so the resumed run's history has no duplicated or orphaned steps. `resume_step=None` is a
fresh run and clears both (and val_generations.jsonl likewise).
"""
from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping, Optional, Sequence

from tripod.engine.logging.progress import DEFAULT_KEYS, ProgressLine

BACKENDS = ("console", "tensorboard", "jsonl", "wandb", "mlflow")
SAMPLE_COLUMNS = ("prompt", "response", "score", "reference")


def to_scalar(value: Any, key: str = "?") -> float | int | str | bool:
    """A JSON-able scalar from a python number, numpy scalar or one-element tensor/array (strings pass through)."""
    if isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    numel = value.numel() if hasattr(value, "numel") else getattr(value, "size", None)  # torch / numpy
    if numel == 1 and hasattr(value, "item"):
        return to_scalar(value.item(), key)
    raise TypeError(f"metric {key!r} has a value of type {type(value).__name__} that is not a scalar; "
                    "log numbers (reduce lists with engine.logging.reduce_metrics first)")


class Tracker:
    """Metrics sink of one run; `log(metrics, step)` per step, `close()` at the end (or a `with` block)."""

    def __init__(self, run_dir: str | os.PathLike, backends: Sequence[str] = BACKENDS,
                 resume_step: Optional[int] = None, total_steps: Optional[int] = None,
                 console_keys: Sequence[str] = DEFAULT_KEYS, console: Any = None, project_name: str = "tripod",
                 experiment_name: str = "run", config: Optional[Mapping[str, Any]] = None) -> None:
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise ValueError(f"trainer.logger has unknown backends {unknown}; use any of {list(BACKENDS)}")
        self.run_dir = os.fspath(run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        self.backends = tuple(backends)
        self.jsonl_path = os.path.join(self.run_dir, "metrics.jsonl")
        self.samples_path = os.path.join(self.run_dir, "val_generations.jsonl")
        self._jsonl = self._writer = self._progress = None
        if "jsonl" in self.backends:
            _truncate_jsonl(self.jsonl_path, resume_step)
            _truncate_jsonl(self.samples_path, resume_step)
            self._jsonl = open(self.jsonl_path, "a")
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=os.path.join(self.run_dir, "tensorboard"),
                                         purge_step=0 if resume_step is None else resume_step + 1)
        if "console" in self.backends:
            self._progress = ProgressLine(total_steps or 0, console_keys, initial_step=resume_step or 0,
                                          console=console)
        from tripod.engine.logging.experiment_trackers import SINKS

        self._sinks = [SINKS[b](self.run_dir, project_name, experiment_name, config)
                       for b in self.backends if b in SINKS]

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        scalars = {str(k): to_scalar(v, str(k)) for k, v in metrics.items()}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": int(step), **scalars}) + "\n")
            self._jsonl.flush()
        if self._writer is not None:
            for key, value in scalars.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(key, value, global_step=int(step))
            self._writer.flush()
        if self._progress is not None:
            self._progress.update(int(step), scalars)
        numeric = {k: v for k, v in scalars.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for sink in self._sinks:
            sink.log(numeric, int(step))

    def log_samples(self, samples: Sequence[Mapping[str, Any]], step: int, name: str = "val/generations") -> None:
        """Validation samples: dicts with prompt, response, score and (when the data has one) reference."""
        if not samples:
            return
        columns = [c for c in SAMPLE_COLUMNS if any(c in s for s in samples)]
        rows = [[s.get(c) for c in columns] for s in samples]
        if "jsonl" in self.backends:
            with open(self.samples_path, "a") as f:
                f.writelines(json.dumps({"step": int(step), **dict(zip(columns, row))}) + "\n" for row in rows)
        if self._writer is not None:
            cell = lambda v: str(v).replace("|", "\\|").replace("\n", "\\n")  # noqa: E731  one table row per sample
            table = "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
                              + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])
            self._writer.add_text(name, table, global_step=int(step))
            self._writer.flush()
        for sink in self._sinks:
            sink.log_table(name, columns, rows, int(step))

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._progress is not None:
            self._progress.close()
            self._progress = None

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def validation_samples(tokenizer: Any, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                       scores: Sequence[float], n: int, references: Optional[Sequence[Any]] = None,
                       limit: int = 0) -> list[dict[str, Any]]:
    """Up to `limit` sample dicts for `Tracker.log_samples` from one validation batch: `responses` and `scores` are
    prompt-major (`n` per prompt); the reference answer is included where `references` has one."""
    out = []
    for i, (response, score) in enumerate(zip(responses[:max(limit, 0)], scores)):
        sample = {"prompt": tokenizer.decode(prompts[i // n], skip_special_tokens=True),
                  "response": tokenizer.decode(response, skip_special_tokens=True), "score": float(score)}
        reference = references[i // n] if references else None
        if reference not in (None, ""):
            sample["reference"] = str(reference)
        out.append(sample)
    return out


def _truncate_jsonl(path: str, resume_step: Optional[int]) -> None:
    """Keep the entries with step <= resume_step (none when None): a resumed run rewrites the steps after it."""
    if not os.path.exists(path):
        return
    kept = []
    if resume_step is not None:
        with open(path) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if entry.get("step", math.inf) <= resume_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


class Timer:
    """Wall-clock sections of a step: `with timer("gen"): ...` then `timer.metrics()` -> {"timing_s/gen": s}.

    A name timed more than once in a step is summed; `metrics()` returns the step's timings and starts a new step.
    `ranges(name)`, when given, is entered around each section too (a profiler's named range: logging/profiler.py).
    """

    def __init__(self, ranges: Optional[Callable[[str], ContextManager]] = None) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.ranges = ranges

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with self.ranges(name) if self.ranges is not None else nullcontext():
                yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def metrics(self, reset: bool = True) -> dict[str, float]:
        out = {f"timing_s/{name}": value for name, value in self.seconds.items()}
        if reset:
            self.seconds = defaultdict(float)
        return out


def append_to_dict(accumulator: dict[str, list], metrics: Mapping[str, Any]) -> None:
    """Collect one micro-batch's metrics: accumulator[key].append(value)."""
    for key, value in metrics.items():
        accumulator.setdefault(key, []).append(value)


def reduce_metrics(metrics: Mapping[str, Iterable[Any]] | Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Mean of each metric over micro-batches; takes {key: [values]} or [{key: value}, ...]."""
    if not isinstance(metrics, Mapping):
        accumulator: dict[str, list] = {}
        for entry in metrics:
            append_to_dict(accumulator, entry)
        metrics = accumulator
    out = {}
    for key, values in metrics.items():
        numbers_ = [float(to_scalar(v, key)) for v in values]
        if not numbers_:
            raise ValueError(f"metric {key!r} has no values to reduce")
        out[key] = sum(numbers_) / len(numbers_)
    return out
