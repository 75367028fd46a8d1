"""Checking the rows' `extra_info.tools_kwargs` / `tool_selection` / `interaction_kwargs` against the loaded tools and
interactions, before any model is built: one line naming the row, the key and the fix."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

TOOL_KWARG_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")
_RESERVED = {"create_kwargs": ("instance_id", "create_kwargs"), "execute_kwargs": ("agent_data",)}  # passed already


def _row_problem(i: int, info: Any, tools: Mapping[str, object], interactions: Mapping[str, object]) -> str | None:
    if info is None:
        info = {}
    if not isinstance(info, Mapping):
        return f"row {i}: extra_info is {type(info).__name__}, not a mapping"
    tools_kwargs = info.get("tools_kwargs") or {}
    if not isinstance(tools_kwargs, Mapping):
        return f"row {i}: extra_info.tools_kwargs must be a mapping {{tool_name: {{create_kwargs: ...}}}}"
    for name, kwargs in tools_kwargs.items():
        if kwargs is None:  # parquet struct columns give every row every key; an absent tool reads as None
            continue
        if name not in tools:
            return (f"row {i}: extra_info.tools_kwargs names tool {name!r}, which tool_config_path does not define "
                    f"(tools: {', '.join(tools) or 'none'}); fix the row or add the tool")
        if not isinstance(kwargs, Mapping):
            return f"row {i}: extra_info.tools_kwargs.{name} must be a mapping with keys among {TOOL_KWARG_KEYS}"
        unknown = sorted(set(kwargs) - set(TOOL_KWARG_KEYS))
        if unknown:
            return f"row {i}: extra_info.tools_kwargs.{name} has unknown keys {unknown}; allowed: {TOOL_KWARG_KEYS}"
        for key in TOOL_KWARG_KEYS:
            if kwargs.get(key) is not None and not isinstance(kwargs[key], Mapping):
                return f"row {i}: extra_info.tools_kwargs.{name}.{key} must be a mapping"
        for key, reserved in _RESERVED.items():
            clash = sorted(set(kwargs.get(key) or {}) & set(reserved))
            if clash:
                return f"row {i}: extra_info.tools_kwargs.{name}.{key} may not use the names {clash}"
    selection = info.get("tool_selection")
    if selection is not None:
        if not isinstance(selection, (list, tuple)) or not all(isinstance(n, str) for n in selection):
            return f"row {i}: extra_info.tool_selection must be a list of tool names"
        unknown = sorted(set(selection) - set(tools))
        if unknown:
            return (f"row {i}: extra_info.tool_selection names {unknown}, which the tool files do not define "
                    f"(tools: {', '.join(tools) or 'none'})")
    if interactions:
        kwargs = info.get("interaction_kwargs")
        if not isinstance(kwargs, Mapping) or kwargs.get("name") is None:
            return (f"row {i}: extra_info.interaction_kwargs.name is required with interaction_config_path "
                    f"(one of {sorted(interactions)})")
        if kwargs["name"] not in interactions:
            return (f"row {i}: extra_info.interaction_kwargs.name {kwargs['name']!r} is not in "
                    f"interaction_config_path (interactions: {sorted(interactions)})")
    return None


def validate_agent_inputs(tools: Mapping[str, object], interactions: Mapping[str, object],
                          extra_infos: Iterable[Mapping[str, Any] | None]) -> None:
    """Raise ValueError with one line for the first bad row (and how many more are bad). `extra_infos` are the
    rows' `extra_info` dicts, in dataset order."""
    first, bad = None, 0
    for i, info in enumerate(extra_infos):
        problem = _row_problem(i, info, tools, interactions)
        if problem is not None:
            first, bad = first or problem, bad + 1
    if first is not None:
        raise ValueError(first + (f" ({bad - 1} more rows have problems)" if bad > 1 else ""))
