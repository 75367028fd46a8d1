"""`RewardPool`: score a batch of responses with the registered rule rewards, in parallel, with a per-sample time-out.

Backends (same scores, chosen by `backend` or automatically):
- "ray": chunks of samples as Ray tasks (starts a local Ray if none is running); used when `use_ray=True` and ray
  imports,
- "process": a `multiprocessing` pool of `num_workers` processes (fork by default: workers run pure-Python scorers),
- "inline": in the calling process, one sample after another (`num_workers <= 1` and not Ray).

Time-outs: every sample runs under a SIGALRM timer of `timeout_s` inside whichever process scores it (this interrupts
Python loops, sleeps and long regex matches). A sample that times out scores 0 and is counted in
`reward/num_timeouts`; a scorer that raises scores 0 and is counted in `reward/num_errors` (the first error of a batch
is logged). As a last resort against a scorer stuck in C code, the driver gives each chunk a hard deadline and then
kills the pool (process: terminate + restart; Ray: force-cancel). Inline scoring can only use the timer when called
from the main thread. Call `score` on one rank (e.g. rank 0) and broadcast the scores.
"""
from __future__ import annotations

import logging
import math
import multiprocessing
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Optional, Sequence

from tripod.engine.rewards.registry import check_data_sources, get_reward_fn

log = logging.getLogger(__name__)
_Task = tuple[Any, str, str, Optional[dict]]  # (reward fn, solution, ground truth, extra_info)


class _SampleTimeout(Exception):
    pass


@contextmanager
def _alarm(timeout_s: float) -> Iterator[None]:
    """Raise _SampleTimeout in this thread after timeout_s (no-op outside the main thread)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise _SampleTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _score_chunk(tasks: Sequence[_Task], timeout_s: float) -> list[tuple[float, str]]:
    """Score tasks one by one; each result is (score, status) with status "ok", "timeout" or "error: ..."."""
    results = []
    for fn, solution, ground_truth, extra_info in tasks:
        try:
            with _alarm(timeout_s):
                value = float(fn(solution, ground_truth, extra_info=extra_info))
            results.append((value, "ok"))
        except _SampleTimeout:
            results.append((0.0, "timeout"))
        except Exception as e:  # a broken scorer must not take the training run down
            results.append((0.0, f"error: {type(e).__name__}: {e}"))
    return results


def _ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


class RewardPool:
    """Scores responses by data source. `score(...)` -> (scores, metrics). Use as a context manager or `close()`."""

    def __init__(self, num_workers: int = 1, timeout_s: float = 10.0, use_ray: bool = False,
                 data_sources: Optional[Iterable[str]] = None, backend: Optional[str] = None,
                 mp_context: str = "fork", chunks_per_worker: int = 4, hard_deadline_grace_s: float = 5.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reward_model.timeout_s={timeout_s} must be > 0 seconds")
        if data_sources is not None:
            check_data_sources(data_sources)
        if backend is None:
            if use_ray and not _ray_available():
                log.warning("reward_model.use_ray=true but ray is not importable; scoring with a process pool")
            backend = "ray" if use_ray and _ray_available() else ("process" if num_workers > 1 else "inline")
        if backend not in ("inline", "process", "ray"):
            raise ValueError(f"backend={backend!r} must be 'inline', 'process' or 'ray'")
        if backend == "ray" and not _ray_available():
            raise ImportError("backend='ray' needs the ray package (pip install ray) or reward_model.use_ray=false")
        self.backend, self.num_workers, self.timeout_s = backend, max(1, num_workers), float(timeout_s)
        self.mp_context, self.chunks_per_worker = mp_context, max(1, chunks_per_worker)
        self.hard_deadline_grace_s = hard_deadline_grace_s
        self._pool: Any = None

    # ------------------------------------------------------------------ public
    def score(self, solutions: Sequence[str], ground_truths: Sequence[str], data_sources: Sequence[str],
              extra_infos: Optional[Sequence[Optional[dict]]] = None) -> tuple[list[float], dict[str, float]]:
        """One score per response; metrics: reward/num_timeouts, reward/num_errors."""
        n = len(solutions)
        if not (len(ground_truths) == len(data_sources) == n) or (extra_infos is not None and len(extra_infos) != n):
            raise ValueError(f"score() got {n} solutions, {len(ground_truths)} ground truths, {len(data_sources)} "
                             f"data sources{'' if extra_infos is None else f', {len(extra_infos)} extra_infos'}; "
                             "they must be the same length")
        check_data_sources(data_sources)
        infos = list(extra_infos) if extra_infos is not None else [None] * n
        tasks = [(get_reward_fn(ds), s, str(gt), info)
                 for s, gt, ds, info in zip(solutions, ground_truths, data_sources, infos)]
        if not tasks:
            return [], {"reward/num_timeouts": 0.0, "reward/num_errors": 0.0}
        if self.backend == "inline":
            results = _score_chunk(tasks, self.timeout_s)
        else:
            size = math.ceil(n / (self.num_workers * self.chunks_per_worker))
            chunks = [tasks[i:i + size] for i in range(0, n, size)]
            run = self._run_ray if self.backend == "ray" else self._run_processes
            results = [r for chunk_results in run(chunks) for r in chunk_results]
        errors = [status for _, status in results if status.startswith("error")]
        if errors:
            log.warning("%d reward function call(s) raised and scored 0; first: %s", len(errors), errors[0])
        return [s for s, _ in results], {
            "reward/num_timeouts": float(sum(status == "timeout" for _, status in results)),
            "reward/num_errors": float(len(errors)),
        }

    def close(self) -> None:
        if self._pool is not None and self.backend == "process":
            self._pool.terminate()
            self._pool.join()
        self._pool = None

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ backends
    def _deadline(self, chunk: Sequence[_Task]) -> float:
        return self.timeout_s * len(chunk) + self.hard_deadline_grace_s

    def _run_processes(self, chunks: list[list[_Task]]) -> list[list[tuple[float, str]]]:
        if self._pool is None:
            self._pool = multiprocessing.get_context(self.mp_context).Pool(self.num_workers)
        pending = [self._pool.apply_async(_score_chunk, (chunk, self.timeout_s)) for chunk in chunks]
        # Chunks queue behind each other: the last one may wait for every chunk ahead of it on its worker.
        waves = math.ceil(len(chunks) / self.num_workers)
        deadline = time.monotonic() + waves * max(self._deadline(c) for c in chunks)
        out, broken = [], False
        for chunk, result in zip(chunks, pending):
            try:
                out.append(result.get(timeout=max(0.0, deadline - time.monotonic())))
            except multiprocessing.TimeoutError:
                out.append([(0.0, "timeout")] * len(chunk))
                broken = True
        if broken:  # a worker is stuck where SIGALRM cannot reach it: replace the pool
            log.warning("reward pool: a chunk passed its hard deadline; restarting the worker processes")
            self.close()
        return out

    def _run_ray(self, chunks: list[list[_Task]]) -> list[list[tuple[float, str]]]:
        import ray

        if not ray.is_initialized():
            ray.init(num_cpus=self.num_workers, include_dashboard=False, log_to_driver=False,
                     ignore_reinit_error=True)
        if self._pool is None:  # the remote function, exported to the cluster once
            self._pool = ray.remote(num_cpus=1, max_retries=0)(_score_chunk)
        refs = [self._pool.remote(chunk, self.timeout_s) for chunk in chunks]
        waves = math.ceil(len(chunks) / self.num_workers)
        ready, not_ready = ray.wait(refs, num_returns=len(refs),
                                    timeout=waves * max(self._deadline(c) for c in chunks))
        for ref in not_ready:
            ray.cancel(ref, force=True)
        done = set(ready)
        return [ray.get(ref) if ref in done else [(0.0, "timeout")] * len(chunk) for ref, chunk in zip(refs, chunks)]
