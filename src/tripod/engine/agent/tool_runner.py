"""Running a trajectory's tool calls as verl 0.9.1's tool agent loop runs them, with time-outs and without raising.

    runner = ToolRunner(tools, max_parallel_calls=1, max_tool_response_length=256,
                        tool_response_truncate_side="middle", timeout_s=60)
    await runner.start(row_key, extra_info.get("tools_kwargs") or {}, extra_info.get("tool_selection"))
    results = await runner.call(row_key, [ToolCall("calculator", {"expression": "6*7"})], agent_data=data)
    scores = await runner.finish_scores(row_key)   # {tool: calc_reward} of the per-trajectory tools; frees the row

Lifecycle per tool (`tool_setting(tool, "lifecycle")`, a class attribute or the tool's config key):
- `call` (the default; verl 0.9.1's `_call_tool`): every call is `create(create_kwargs=...)`, `execute(instance_id,
  arguments, agent_data=...)`, then `release(instance_id)` in a finally; `calc_reward` is never called. `create` also
  gets the create_kwargs as keywords of their own (`create(**create_kwargs, create_kwargs=create_kwargs)`, as verl's
  older SGLang rollout passed them), `execute` the row's execute_kwargs, `release` its release_kwargs.
- `trajectory` (tripod's, verl's older per-trajectory semantics): `start` creates one instance per row
  (`create(row_key, ...)`), every call of the row executes on it, and `finish_scores` calls `calc_reward`
  (calc_reward_kwargs) and `release`.
- a function tool (function_tools.py) has none: the function is called with the arguments.

A step reward of None is accepted and skipped (`ToolResult.reward` None; verl appends only non-None rewards). A tool
may declare `max_concurrency`: the runner then runs at most that many of its executes at once over all rows (a
semaphore of the running event loop; waiting for it is not part of the time-out). Each step (create, execute, release)
has `timeout_s`; a call past it is cancelled and left behind, so a tool that ignores cancellation cannot stall the
run (run the event loop with `run_abandoning`, not asyncio.run, which waits for such calls at exit), while a tool that
blocks the event loop itself (synchronous sleep or I/O inside `async def`) cannot be preempted and should use
`asyncio.to_thread`.

`ToolResult.text` is the tool message's content exactly as the model sees it: the tool's text, or for a failure
verl's wording, "Error executing tool '<name>': <reason>" ("Unknown function '<name>'. Available tools: [...]" for an
unknown name), truncated to `max_tool_response_length` characters (verl truncates successful texts only). A tool that
reports its own failure through its metrics' `error` keeps its own text. Failures the model never sees (a
per-trajectory create at start, calc_reward, release) are counted in `error_count`; the last few are kept in
`recent_errors`.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from tripod.engine.agent.function_tools import FunctionTool, normalize_return
from tripod.engine.agent.tools import AgentData, tool_setting

logger = logging.getLogger(__name__)
TRUNCATE_SIDES = ("left", "right", "middle")
LIFECYCLES = ("call", "trajectory")
RECENT_ERRORS = 20


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ToolResult:
    name: str
    text: str  # the tool message's content, verbatim
    reward: float | None  # the step reward (0.0 for a failed call, as verl); None: the tool gave none (skipped)
    error: str | None  # what failed, for logs and metrics (the model sees `text`)
    timed_out: bool
    seconds: float
    metrics: dict = field(default_factory=dict)


def truncate(text: str, limit: int, side: str) -> str:
    """verl 0.9.1's rule, in characters: `left` cuts the start (keeps the last `limit`), `right` cuts the end (keeps
    the first `limit`), `middle` keeps both halves."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else "")


def response_text(response: Any) -> str:
    """A tool response's text: a string, or an object with `.text` (str or None) and no image / video (tripod's
    loop is text-only, where verl refuses them for text models too); TypeError otherwise."""
    if isinstance(response, str):
        return response
    text = getattr(response, "text", TypeError)
    if getattr(response, "image", None) or getattr(response, "video", None):
        raise TypeError("returned an image or video; tripod's agent loop is text-only")
    if text is None:
        return ""
    if isinstance(text, str):
        return text
    raise TypeError(f"returned {type(response).__name__}, not a string or an object with a string .text")


def _reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"the step reward is {value!r}, not a finite number or None")
    return float(value)


class Guarded(NamedTuple):
    value: Any
    error: str | None  # "<what>: <Type>: <message>" / "<what> timed out after N s"
    timed_out: bool
    reason: str | None  # the bare message (str(exception)), what verl shows the model


async def _no_exit(awaitable: Any) -> Any:
    """A SystemExit inside a task would stop the event loop itself: make it an ordinary error."""
    try:
        return await awaitable
    except SystemExit as e:
        raise RuntimeError(f"the tool called sys.exit({e.code!r})") from None


async def run_guarded(what: str, timeout_s: float, coro_fn, /, *args, **kwargs) -> Guarded:
    """Await `coro_fn(*args, **kwargs)` under the time-out. A call past its time-out is cancelled and left behind,
    not awaited: a tool that ignores cancellation cannot stall the run."""
    try:
        task = asyncio.ensure_future(_no_exit(coro_fn(*args, **kwargs)))
    except (Exception, SystemExit) as e:  # noqa: BLE001  (e.g. a bad keyword argument, or not a coroutine)
        return Guarded(None, f"{what}: {type(e).__name__}: {e}", False, str(e))
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # nobody awaits it: consume the error
        return Guarded(None, f"{what} timed out after {timeout_s:g} s", True, f"timed out after {timeout_s:g} s")
    try:
        return Guarded(task.result(), None, False, None)
    except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001  (a failure is the tool turn)
        return Guarded(None, f"{what}: {type(e).__name__}: {e}", False, str(e) or type(e).__name__)


def run_abandoning(main: Any, grace_s: float = 1.0) -> Any:
    """`asyncio.run(main)` without its wait at exit: asyncio.run awaits every task still running (and the default
    executor's threads), so one call a time-out abandoned whose tool ignores cancellation would hang it. Here the
    tasks left when `main` returns get `grace_s` to end, then the loop closes without them."""
    loop = asyncio.new_event_loop()
    try:
        result = loop.run_until_complete(main)
        left = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.wait(left, timeout=grace_s))
        loop.run_until_complete(loop.shutdown_asyncgens())
        return result
    finally:
        loop.close()


async def call_function(tool: FunctionTool, arguments: dict) -> Any:
    """A function tool's return value: awaited, or computed in a daemon thread (asyncio.to_thread's pool would make
    asyncio.run wait at exit for a function that never returns)."""
    if tool.is_async:
        return await tool.fn(**arguments)
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (tool.fn(**arguments), None)
        except BaseException as e:  # noqa: BLE001  (handed to the awaiting task)
            outcome = (None, e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: the call was abandoned
            pass

    threading.Thread(target=run, name=f"function-tool-{tool.name}", daemon=True).start()
    return await future


@dataclass
class _Row:
    tools_kwargs: dict
    agent_data: AgentData
    active: list[str] | None = None  # extra_info.tool_selection: the tools this row may call (None: all)
    instances: dict[str, str] = field(default_factory=dict)  # per-trajectory tool -> its instance id
    start_errors: dict[str, str] = field(default_factory=dict)


class ErrorRecord:
    """Failures the model never sees (a lifecycle step, an interaction): logged, counted in `error_count`, the last
    RECENT_ERRORS kept in `recent_errors` (a long run does not grow it)."""

    def __init__(self) -> None:
        self.error_count = 0
        self.recent_errors: deque[str] = deque(maxlen=RECENT_ERRORS)

    def _record(self, row_key: str, error: str) -> None:
        self.error_count += 1
        self.recent_errors.append(error)
        logger.warning("row %s: %s", row_key, error)


class ToolRunner(ErrorRecord):
    """Runs the tool calls of many rows concurrently (see the module docstring); no method raises."""

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
        self.lifecycle: dict[str, str] = {}
        self.max_concurrency: dict[str, int] = {}
        for name, tool in tools.items():
            lifecycle = "function" if isinstance(tool, FunctionTool) else tool_setting(tool, "lifecycle", "call")
            if lifecycle not in (*LIFECYCLES, "function"):
                raise ValueError(f"tool {name!r}: lifecycle={lifecycle!r} must be one of {', '.join(LIFECYCLES)}")
            if lifecycle == "trajectory" and not callable(getattr(tool, "calc_reward", None)):
                raise ValueError(f"tool {name!r}: lifecycle=trajectory needs a calc_reward method")
            self.lifecycle[name] = lifecycle
            limit = tool_setting(tool, "max_concurrency")
            if limit is not None:
                if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                    raise ValueError(f"tool {name!r}: max_concurrency={limit!r} must be a positive integer")
                self.max_concurrency[name] = limit
        self._rows: dict[str, _Row] = {}
        self._gates: tuple[asyncio.AbstractEventLoop, dict[str, asyncio.Semaphore]] | None = None
        super().__init__()

    def _gate(self, name: str) -> asyncio.Semaphore | None:
        if name not in self.max_concurrency:
            return None
        loop = asyncio.get_running_loop()
        if self._gates is None or self._gates[0] is not loop:  # a semaphore belongs to one event loop
            self._gates = (loop, {n: asyncio.Semaphore(k) for n, k in self.max_concurrency.items()})
        return self._gates[1][name]

    def _row(self, row_key: str) -> _Row:
        row = self._rows.get(row_key)
        if row is None:  # a row that was not started: no tools_kwargs
            row = self._rows[row_key] = _Row({}, AgentData(messages=[], request_id=row_key, tools_kwargs={}))
        return row

    async def start(self, row_key: str, tools_kwargs: dict, tool_selection: list[str] | None = None) -> None:
        """Record the row's `extra_info.tools_kwargs` and `tool_selection` (verl 0.9.1: the only tools the row may
        call, in that order; None or empty: all); create the row's instance of every per-trajectory tool it may call."""
        tools_kwargs = dict(tools_kwargs or {})
        active = [n for n in tool_selection if n in self.tools] if tool_selection else None
        row = self._rows[row_key] = _Row(tools_kwargs, AgentData(messages=[], request_id=row_key,
                                                                  tools_kwargs=tools_kwargs), active)

        async def create(name: str) -> None:
            create_kwargs = dict((tools_kwargs.get(name) or {}).get("create_kwargs") or {})
            got = await run_guarded(f"{name}.create", self.timeout_s, self.tools[name].create, row_key,
                                    **create_kwargs, create_kwargs=create_kwargs)
            error = got.error or self._created(name, got.value)[1]
            if error is not None:
                row.start_errors[name] = error
                return self._record(row_key, error)
            row.instances[name] = got.value[0]

        await asyncio.gather(*(create(n) for n, kind in self.lifecycle.items()
                               if kind == "trajectory" and (active is None or n in active)))

    @staticmethod
    def _created(name: str, value: Any) -> tuple[Any, str | None]:
        if isinstance(value, (tuple, list)) and len(value) == 2 and value[0] is not None:
            return value[0], None
        return None, f"{name}.create returned {type(value).__name__}, not (instance_id, response)"

    async def _release(self, row_key: str, name: str, instance_id: Any, kwargs: dict) -> None:
        got = await run_guarded(f"{name}.release", self.timeout_s, self.tools[name].release, instance_id,
                                **(kwargs.get("release_kwargs") or {}))
        if got.error is not None:
            self._record(row_key, got.error)

    async def _execute(self, name: str, *args: Any, **kwargs: Any) -> Guarded:
        gate, tool = self._gate(name), self.tools[name]
        fn = (lambda arguments: call_function(tool, arguments)) if isinstance(tool, FunctionTool) else tool.execute
        if gate is None:
            return await run_guarded(f"{name}.execute", self.timeout_s, fn, *args, **kwargs)
        async with gate:
            return await run_guarded(f"{name}.execute", self.timeout_s, fn, *args, **kwargs)

    async def _run(self, row_key: str, row: _Row, call: ToolCall, agent_data: AgentData) -> Guarded:
        """The execute's outcome (or the step that failed before it) under the tool's lifecycle."""
        name, kind = call.name, self.lifecycle[call.name]
        if kind == "function":
            return await self._execute(name, call.arguments)
        kwargs = row.tools_kwargs.get(name) or {}
        execute_kwargs = dict(kwargs.get("execute_kwargs") or {})
        if kind == "trajectory":
            if name not in row.instances:
                error = row.start_errors.get(name, f"no instance of {name!r} for this row (start was not called)")
                return Guarded(None, error, False, error)
            return await self._execute(name, row.instances[name], call.arguments, agent_data=agent_data,
                                       **execute_kwargs)
        create_kwargs = dict(kwargs.get("create_kwargs") or {})
        got = await run_guarded(f"{name}.create", self.timeout_s, self.tools[name].create, **create_kwargs,
                                create_kwargs=create_kwargs)
        instance_id, error = (None, got.error) if got.error is not None else self._created(name, got.value)
        if error is not None:
            return Guarded(None, error, got.timed_out, got.reason or error)
        try:
            return await self._execute(name, instance_id, call.arguments, agent_data=agent_data, **execute_kwargs)
        finally:
            await self._release(row_key, name, instance_id, kwargs)

    async def _call_one(self, row_key: str, call: ToolCall, agent_data: AgentData | None) -> ToolResult:
        began = time.monotonic()
        name, row = call.name, self._row(row_key)
        text, reward, metrics, timed_out = "", 0.0, {}, False  # verl: a failed call's step reward is 0.0
        available = list(self.tools) if row.active is None else row.active
        if name not in available:
            error = f"unknown tool {name!r}"
            text = f"Unknown function '{name}'. Available tools: {available}"
        elif not isinstance(call.arguments, dict):
            error = reason = f"arguments must be a JSON object, got {type(call.arguments).__name__}"
        else:
            got = await self._run(row_key, row, call, row.agent_data if agent_data is None else agent_data)
            error, timed_out, reason = got.error, got.timed_out, got.reason
            if error is None:
                try:
                    if self.lifecycle[name] == "function":
                        response, reward, metrics = normalize_return(got.value)
                    elif isinstance(got.value, (tuple, list)) and len(got.value) == 3:
                        response, reward, metrics = got.value[0], _reward(got.value[1]), dict(got.value[2] or {})
                    else:
                        raise TypeError(f"returned {type(got.value).__name__}, not (response, reward, metrics)")
                    text = response_text(response)
                except (TypeError, ValueError) as e:
                    error, reason = f"{name}.execute {e}", str(e)
                    text, reward, metrics = "", 0.0, {}
            if error is None and metrics.get("error"):  # the tool reported its own failure, in its own words
                error, timed_out = str(metrics["error"]), bool(metrics.get("timed_out", False))
                reason = error
        if error is not None and not text:
            text = f"Error executing tool '{name}': {reason}"
        return ToolResult(name=name, text=truncate(text, self.max_tool_response_length, self.truncate_side),
                          reward=reward, error=error, timed_out=timed_out, seconds=time.monotonic() - began,
                          metrics=metrics)

    async def call(self, row_key: str, calls: list[ToolCall], agent_data: AgentData | None = None) -> list[ToolResult]:
        """Run the first `max_parallel_calls` calls concurrently (verl drops the rest); one ToolResult each, in order.
        `agent_data`: the row's AgentData, handed to every execute (None: the runner's own for the row, with empty
        messages)."""
        return list(await asyncio.gather(*(self._call_one(row_key, c, agent_data)
                                           for c in calls[: self.max_parallel_calls])))

    async def finish_scores(self, row_key: str) -> dict[str, float]:
        """Each per-trajectory tool's `calc_reward` for the row (0.0 on failure), then its `release`; frees the row.
        Call it once for every row (also with no per-trajectory tools: it drops the row's state)."""
        row = self._rows.pop(row_key, None)
        if row is None:
            return {}

        async def one(name: str, instance_id: Any) -> float:
            kwargs = row.tools_kwargs.get(name) or {}
            got = await run_guarded(f"{name}.calc_reward", self.timeout_s, self.tools[name].calc_reward, instance_id,
                                    **(kwargs.get("calc_reward_kwargs") or {}))
            error, reward = got.error, 0.0
            if error is None:
                value = got.value
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    error = f"{name}.calc_reward returned {value!r}, not a finite number"
                else:
                    reward = float(value)
            if error is not None:
                self._record(row_key, error)
            await self._release(row_key, name, instance_id, kwargs)
            return reward

        names = list(row.instances)
        return dict(zip(names, await asyncio.gather(*(one(n, row.instances[n]) for n in names))))
