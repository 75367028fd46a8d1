"""Function tools (verl 0.9.1's `multi_turn.function_tool_path`): the `@function_tool` functions of a Python file.

    # my_tools.py                                   multi_turn.function_tool_path: my_tools.py
    from tripod.engine.agent import function_tool   # or: from verl.tools.function_tool import function_tool

    @function_tool
    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: The first.
            b: The second.
        \"\"\"
        return a + b

Either decorator works, and one file may mix them; tripod never imports verl. The schema is inferred as verl infers
it, by `transformers.utils.get_json_schema` (a Google-style docstring with an `Args:` block and a type hint on every
parameter; variadic parameters are refused), unless `schema=` is given; `@function_tool("name")` renames the tool.
verl's decorator attaches nothing to the function: it registers a `FunctionTool` in
`verl.tools.function_tool.FUNCTION_TOOL_REGISTRY`, so the file's verl tools are the entries that registry gained while
the file ran (read from `sys.modules`, present only when the file imported verl); tripod's decorator registers in
this module's registry the same way.

A function tool has no lifecycle (no create / release / calc_reward, the row's tools_kwargs are ignored): the runner
calls it with the parsed arguments, an `async def` awaited, a plain function in a daemon thread (so one past its
time-out cannot hold up the event loop's shutdown), and its return value becomes `(response, reward, metrics)` by
verl's `normalize_function_tool_return` rules (`normalize_return`).
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from tripod.engine.agent.tools import OpenAIFunctionToolSchema, ToolResponse, load_tools, parse_tool_schema

REGISTRY: dict[str, "FunctionTool"] = {}  # tripod's @function_tool registrations, by tool name
_LOADED: dict[str, dict[str, "FunctionTool"]] = {}  # absolute path -> its tools (a file runs once, as in verl)
_VERL_MODULE = "verl.tools.function_tool"


@dataclass
class FunctionTool:
    """A function as a tool: verl's `FunctionTool` fields, the schema as tripod's model."""
    name: str
    fn: Callable[..., Any]
    tool_schema: OpenAIFunctionToolSchema
    is_async: bool = False


def _schema_from_fn(fn: Callable, name: str) -> OpenAIFunctionToolSchema:
    variadic = [n for n, p in inspect.signature(fn).parameters.items()
                if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"@function_tool {name!r} ({fn.__module__}.{fn.__qualname__}) declares variadic "
                         f"parameter(s) {variadic}, which an OpenAI tool schema cannot express; name them")
    from transformers.utils import get_json_schema

    raw = get_json_schema(fn)
    raw["function"]["name"] = name
    return parse_tool_schema(raw, f"@function_tool {name!r}")


def function_tool(name: str | Callable | None = None, *, schema: Any = None) -> Any:
    """Register a function as a tool, as verl 0.9.1's decorator does (bare, `@function_tool("name")`, or
    `schema=` an OpenAI function schema dict / model); returns the function unchanged."""

    def decorate(fn: Callable, tool_name: str | None) -> Callable:
        tool_name = tool_name or fn.__name__
        if schema is None:
            built = _schema_from_fn(fn, tool_name)
        else:
            raw = schema.model_dump(exclude_unset=True) if hasattr(schema, "model_dump") else schema
            built = parse_tool_schema(raw, f"@function_tool {tool_name!r} schema")
        existing = REGISTRY.get(tool_name)
        if existing is not None and existing.fn is not fn:
            raise ValueError(f"function tool {tool_name!r} is already registered to {existing.fn.__module__}."
                             f"{existing.fn.__qualname__}; refusing to overwrite it with {fn.__module__}."
                             f"{fn.__qualname__}")
        REGISTRY[tool_name] = FunctionTool(tool_name, fn, built, inspect.iscoroutinefunction(fn))
        return fn

    if callable(name) and schema is None:
        return decorate(name, None)
    return lambda fn: decorate(fn, name if isinstance(name, str) else None)


def _verl_registry() -> dict:
    module = sys.modules.get(_VERL_MODULE)
    return getattr(module, "FUNCTION_TOOL_REGISTRY", {}) if module is not None else {}


def load_function_tools(path: str) -> dict[str, FunctionTool]:
    """The tools a function_tool_path file registers (tripod's or verl's decorator), by name; one-line ValueError
    naming the file when it does not run or a tool's schema does not parse."""
    abs_path = os.path.abspath(path)
    if abs_path in _LOADED:
        return _LOADED[abs_path]
    if not os.path.isfile(abs_path):
        raise ValueError(f"{path}: file not found (multi_turn.function_tool_path: a Python file of @function_tool "
                         "functions)")
    ours, verls = dict(REGISTRY), dict(_verl_registry())
    # verl's synthetic module name, so the file can import its siblings through sys.modules as under verl
    module_name = "_tripod_function_tools_" + abs_path.replace(os.sep, "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(module_name, abs_path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: not loadable as a Python module (multi_turn.function_tool_path)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001  (user code: any failure is a config error, one line)
        sys.modules.pop(module_name, None)
        raise ValueError(f"{path}: running the file raised {type(e).__name__}: {' '.join(str(e).split())}") from None
    tools = {n: t for n, t in REGISTRY.items() if ours.get(n) is not t}
    for name, entry in _verl_registry().items():
        if verls.get(name) is entry:
            continue
        if name in tools:
            raise ValueError(f"{path}: function tool {name!r} is registered by both tripod's and verl's decorator")
        schema = entry.tool_schema  # verl's pydantic model: its set fields, as verl's own dump for the template
        raw = schema.model_dump(exclude_unset=True) if hasattr(schema, "model_dump") else schema
        tools[name] = FunctionTool(name, entry.fn, parse_tool_schema(raw, f"{path}: function tool {name!r}"),
                                   bool(getattr(entry, "is_async", inspect.iscoroutinefunction(entry.fn))))
    _LOADED[abs_path] = tools
    return tools


def load_all_tools(tool_config_path: str | None, function_tool_path: str | None) -> dict[str, object]:
    """verl's `load_all_tools`: the tools of tool_config_path, then the function tools of function_tool_path; a name
    in both is one line, as in verl."""
    tools = load_tools(tool_config_path) if tool_config_path else {}
    functions = load_function_tools(function_tool_path) if function_tool_path else {}
    collisions = sorted(set(tools) & set(functions))
    if collisions:
        raise ValueError(f"function tool name(s) {collisions} of '{function_tool_path}' collide with tools already "
                         f"declared in '{tool_config_path}'; each tool name must be unique across tool_config_path "
                         "and function_tool_path: rename one of them")
    return {**tools, **functions}


def _response(value: Any) -> Any:
    if isinstance(value, str):
        return ToolResponse(text=value)
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    if hasattr(value, "text"):  # verl's ToolResponse or tripod's
        return value
    return ToolResponse(text=str(value))


def normalize_return(ret: Any) -> tuple[Any, float, dict]:
    """verl 0.9.1's `normalize_function_tool_return`: a response (`.text`), str, dict (as JSON) or anything (as str);
    or a tuple `(response,)`, `(response, reward)`, `(response, reward, metrics)` whose None reward is 0.0 and None
    metrics {}. A tuple of another length is a TypeError (a tool authoring bug)."""
    if isinstance(ret, tuple):
        if not 1 <= len(ret) <= 3:
            raise TypeError(f"@function_tool return tuple must have length 1, 2, or 3 (got length {len(ret)}); use "
                            "(response,), (response, reward), or (response, reward, metrics)")
        reward = 0.0 if len(ret) < 2 or ret[1] is None else float(ret[1])
        metrics = {} if len(ret) < 3 or ret[2] is None else dict(ret[2])
        return _response(ret[0]), reward, metrics
    return _response(ret), 0.0, {}
