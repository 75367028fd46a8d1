"""Running a trajectory's tool calls: per-row tool instances, concurrency, time-outs, truncation, and never raising.

Per row (verl's per-trajectory semantics): `start` creates one instance of every tool with that row's
`extra_info.tools_kwargs[name].create_kwargs`, `call` executes a turn's calls concurrently (at most
`max_parallel_calls`; verl drops the rest) with `execute_kwargs`, and `finish` sums `calc_reward`
(`calc_reward_kwargs`) and `release`s (`release_kwargs`). `create` gets the kwargs both ways verl's two rollouts
pass them, `create(instance_id, **create_kwargs, create_kwargs=create_kwargs)`, so a tool written for either runs.

A tool that raises, exceeds `timeout_s`, or returns something that is not `(response, reward, metrics)` gives the
model the text "Error when executing tool: ..." (verl's wording) and a ToolResult with `error` / `timed_out` set.
A tool whose `execute` blocks the event loop (a synchronous sleep or I/O inside `async def`) cannot be preempted by
the time-out: such tools should use `asyncio.to_thread`; the built-in Python tool runs its code in another process.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)
TRUNCATE_SIDES = ("left", "right", "middle")


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ToolResult:
    name: str
    text: str
    reward: float
    error: str | None
    timed_out: bool
    seconds: float
    metrics: dict = field(default_factory=dict)


def truncate(text: str, limit: int, side: str) -> str:
    """verl's rule, in characters: `left` keeps the first `limit`, `right` the last, `middle` both halves."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else "")


def response_text(response: Any) -> str:
    """A tool response's text: a string, or an object with `.text` (str or None); TypeError otherwise."""
    if isinstance(response, str):
        return response
    text = getattr(response, "text", TypeError)
    if text is None:
        return ""
    if isinstance(text, str):
        return text
    raise TypeError(f"the response is {type(response).__name__}, not a string or an object with a string .text")


def _reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"the step reward is {value!r}, not a finite number")
    return float(value)


async def _no_exit(awaitable: Any) -> Any:
    """A SystemExit inside a task would stop the event loop itself: make it an ordinary error."""
    try:
        return await awaitable
    except SystemExit as e:
        raise RuntimeError(f"the tool called sys.exit({e.code!r})") from None


async def run_guarded(what: str, timeout_s: float, coro_fn, /, *args, **kwargs) -> tuple[Any, str | None, bool]:
    """(value, error, timed_out) of awaiting `coro_fn(*args, **kwargs)` under the time-out. A call past its
    time-out is cancelled and left behind, not awaited: a tool that ignores cancellation cannot stall the run."""
    try:
        task = asyncio.ensure_future(_no_exit(coro_fn(*args, **kwargs)))
    except (Exception, SystemExit) as e:  # noqa: BLE001  (e.g. a bad keyword argument, or not a coroutine)
        return None, f"{what}: {type(e).__name__}: {e}", False
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody awaits it: consume the error
        return None, f"{what} timed out after {timeout_s:g} s", True
    try:
        return task.result(), None, False
    except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001  (a failure is the tool turn)
        return None, f"{what}: {type(e).__name__}: {e}", False


class ToolRunner:
    """Tool instances per row key, and the calls of one turn run concurrently; no method raises."""

    def __init__(self, tools: dict[str, object], *, max_parallel_calls: int, max_tool_response_length: int,
                 tool_response_truncate_side: str, timeout_s: float):
        if tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"tool_response_truncate_side={tool_response_truncate_side!r} must be one of "
                             f"{', '.join(TRUNCATE_SIDES)}")
        if max_parallel_calls < 1 or max_tool_response_length < 1 or not timeout_s > 0:
            raise ValueError("max_parallel_calls and max_tool_response_length must be >= 1 and timeout_s > 0")
        self.tools = tools
        self.max_parallel_calls = max_parallel_calls
        self.max_tool_response_length = max_tool_response_length
        self.truncate_side = tool_response_truncate_side
        self.timeout_s = timeout_s
        self._rows: dict[str, dict[str, tuple[str | None, dict]]] = {}  # row -> tool -> (instance id, its kwargs)
        self._start_errors: dict[str, dict[str, str]] = {}
        self.lifecycle_errors: list[str] = []  # create / calc_reward / release failures, for the loop's metrics

    async def start(self, row_key: str, tools_kwargs: dict) -> None:
        """Create every tool's instance for this row (`tools_kwargs` is the row's extra_info.tools_kwargs)."""
        tools_kwargs = tools_kwargs or {}
        self._rows[row_key], self._start_errors[row_key] = {}, {}

        async def create(name: str, tool: Any) -> None:
            kwargs = tools_kwargs.get(name) or {}
            create_kwargs = dict(kwargs.get("create_kwargs") or {})
            value, error, _ = await run_guarded(f"{name}.create", self.timeout_s, tool.create, row_key, **create_kwargs,
                                                  create_kwargs=create_kwargs)
            if error is None and not (isinstance(value, (tuple, list)) and len(value) == 2 and value[0] is not None):
                error = f"{name}.create returned {type(value).__name__}, not (instance_id, response)"
            if error is not None:
                self._start_errors[row_key][name] = error
                self.lifecycle_errors.append(error)
                logger.warning("row %s: %s", row_key, error)
                return
            self._rows[row_key][name] = (value[0], kwargs)

        await asyncio.gather(*(create(n, t) for n, t in self.tools.items()))

    async def _call_one(self, row_key: str, call: ToolCall) -> ToolResult:
        began = time.monotonic()
        name, tool = call.name, self.tools.get(call.name)
        error, timed_out, text, reward, metrics = None, False, "", 0.0, {}
        instance = self._rows.get(row_key, {}).get(name)
        if tool is None:
            error = f"unknown tool {name!r} (available: {', '.join(self.tools) or 'none'})"
        elif instance is None:
            error = self._start_errors.get(row_key, {}).get(name, f"no instance of {name!r} for this row (start "
                                                                   "was not called)")
        elif not isinstance(call.arguments, dict):
            error = f"arguments must be a JSON object, got {type(call.arguments).__name__}"
        else:
            instance_id, kwargs = instance
            value, error, timed_out = await run_guarded(f"{name}.execute", self.timeout_s, tool.execute, instance_id,
                                                          call.arguments, **(kwargs.get("execute_kwargs") or {}))
            if error is None:
                try:
                    if not (isinstance(value, (tuple, list)) and len(value) == 3):
                        raise TypeError(f"returned {type(value).__name__}, not (response, reward, metrics)")
                    text, reward = response_text(value[0]), _reward(value[1])
                    metrics = dict(value[2] or {})
                except (TypeError, ValueError) as e:
                    error = f"{name}.execute {e}"
                    text, reward, metrics = "", 0.0, {}
            if error is None and metrics.get("error"):  # the tool reported its own failure
                error, timed_out = str(metrics["error"]), bool(metrics.get("timed_out", False))
        if error is not None and not text:
            text = f"Error when executing tool: {error}"
        return ToolResult(name=name, text=truncate(text, self.max_tool_response_length, self.truncate_side),
                          reward=reward, error=error, timed_out=timed_out, seconds=time.monotonic() - began,
                          metrics=metrics)

    async def call(self, row_key: str, calls: list[ToolCall]) -> list[ToolResult]:
        """Run the first `max_parallel_calls` calls concurrently; one ToolResult each, in order."""
        return list(await asyncio.gather(*(self._call_one(row_key, c) for c in calls[: self.max_parallel_calls])))

    async def finish(self, row_key: str) -> float:
        """Sum of the row's `calc_reward`s (`finish_scores`)."""
        return float(sum((await self.finish_scores(row_key)).values()))

    async def finish_scores(self, row_key: str) -> dict[str, float]:
        """Each tool's `calc_reward` for the row, then `release` every instance; failures score 0 and are recorded."""
        instances = self._rows.pop(row_key, {})
        self._start_errors.pop(row_key, None)

        async def one(name: str, instance_id: str, kwargs: dict) -> float:
            tool = self.tools[name]
            value, error, _ = await run_guarded(f"{name}.calc_reward", self.timeout_s, tool.calc_reward, instance_id,
                                                  **(kwargs.get("calc_reward_kwargs") or {}))
            if error is None:
                try:
                    reward = _reward(value)
                except TypeError as e:
                    error, reward = f"{name}.calc_reward: {e}", 0.0
            else:
                reward = 0.0
            _, release_error, _ = await run_guarded(f"{name}.release", self.timeout_s, tool.release, instance_id,
                                                      **(kwargs.get("release_kwargs") or {}))
            for e in (error, release_error):
                if e is not None:
                    self.lifecycle_errors.append(e)
                    logger.warning("row %s: %s", row_key, e)
            return reward

        rewards = await asyncio.gather(*(one(n, iid, kw) for n, (iid, kw) in instances.items()))
        return dict(zip(instances, rewards))
