"""`tripod tool TOOL_CONFIG NAME --args JSON [--create-kwargs JSON]`: one tool call, run exactly as the agent loop
runs it, to try a tool before a training run.

TOOL_CONFIG is a `tools:` YAML (multi_turn.tool_config_path), or `-` for none when the tool comes from
`--function-tool-path` (multi_turn.function_tool_path). The call goes through engine/agent/tool_runner.py's
ToolRunner: the tool's lifecycle (verl 0.9.1's create, execute, release per call; a per-trajectory tool's start,
execute, calc_reward and release; a function tool's plain call), the time-out, the truncation, and for the built-in
Python tool its sandbox. `--create-kwargs` stands for a row's `extra_info.tools_kwargs.NAME.create_kwargs`.

Prints ONE JSON line on stdout: {"tool", "text" (the tool turn's content as the model would see it), "reward" (the
step reward; null when the tool gave none), "metrics", "error", "timed_out", "seconds"}; whatever the tool prints goes
to stderr. The exit code is 0 whenever the call ran, the tool's failure included (it is in the JSON), and 2 for bad
input (one line naming the file or option).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any


def _json_object(text: str | None, option: str) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{option}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option}: must be a JSON object, got {type(value).__name__}")
    return value


async def _call(runner: Any, name: str, arguments: dict, create_kwargs: dict) -> Any:
    from tripod.engine.agent import ToolCall

    await runner.start("tripod-tool", {name: {"create_kwargs": create_kwargs}})
    try:
        (result,) = await runner.call("tripod-tool", [ToolCall(name, arguments)])
    finally:
        await runner.finish_scores("tripod-tool")
    return result


def cmd_tool(args: argparse.Namespace) -> int:
    from tripod.engine.agent import ToolRunner, load_all_tools
    from tripod.engine.agent.tool_runner import run_abandoning
    from tripod.engine.config import MultiTurnConfig

    defaults = MultiTurnConfig()
    arguments = _json_object(args.args, "--args")
    create_kwargs = _json_object(args.create_kwargs, "--create-kwargs")
    tool_config = None if args.tool_config == "-" else args.tool_config
    if tool_config is None and not args.function_tool_path:
        raise ValueError("TOOL_CONFIG is '-' and no --function-tool-path is given: name a tools YAML or a Python file "
                         "of @function_tool functions")
    with contextlib.redirect_stdout(sys.stderr):  # stdout holds the JSON line only (verl's BaseTool prints its schema)
        tools = load_all_tools(tool_config, args.function_tool_path)
        if args.name not in tools:
            where = " and ".join(p for p in (tool_config, args.function_tool_path) if p)
            raise ValueError(f"{where}: no tool named {args.name!r} (tools: {', '.join(tools) or 'none'})")
        given = lambda value, default: default if value is None else value  # noqa: E731
        runner = ToolRunner(tools, max_parallel_calls=1,
                            max_tool_response_length=given(args.max_tool_response_length,
                                                           defaults.max_tool_response_length),
                            tool_response_truncate_side=given(args.truncate_side, defaults.tool_response_truncate_side),
                            timeout_s=given(args.timeout_s, defaults.tool_timeout_s))
        result = run_abandoning(_call(runner, args.name, arguments, create_kwargs))
    for error in runner.recent_errors:  # failures the tool turn does not show (release, calc_reward)
        print(f"tripod tool: {error}", file=sys.stderr)
    print(json.dumps({"tool": result.name, "text": result.text, "reward": result.reward, "metrics": result.metrics,
                      "error": result.error, "timed_out": result.timed_out, "seconds": round(result.seconds, 6)},
                     default=str), flush=True)
    return 0


def add_tool_command(subparsers) -> None:
    p = subparsers.add_parser("tool", help="one tool call as the agent loop runs it; prints one JSON line",
                              description="Run one call of a tool from a verl `tools:` YAML or a function_tool_path "
                                          "file through the agent loop's tool runner (lifecycle, time-out, "
                                          "truncation) and print {tool, text, reward, metrics, error, timed_out, "
                                          "seconds} as one JSON line. Exit code 0 even when the tool failed.")
    p.add_argument("tool_config", metavar="TOOL_CONFIG", help="a `tools:` YAML (multi_turn.tool_config_path), or - "
                                                              "for none")
    p.add_argument("name", metavar="NAME", help="the tool's name (its schema's function.name)")
    p.add_argument("--args", default="{}", help="the call's arguments, a JSON object (default {})")
    p.add_argument("--create-kwargs", default=None, help="the row's tools_kwargs.NAME.create_kwargs, a JSON object")
    p.add_argument("--function-tool-path", default=None,
                   help="a Python file of @function_tool functions (multi_turn.function_tool_path)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="each step's time-out in seconds (default multi_turn.tool_timeout_s's default)")
    p.add_argument("--max-tool-response-length", type=int, default=None,
                   help="characters kept of the text (default multi_turn.max_tool_response_length's default)")
    p.add_argument("--truncate-side", choices=("left", "right", "middle"), default=None,
                   help="which part of a long text is cut (default multi_turn.tool_response_truncate_side's default)")
    p.set_defaults(func=cmd_tool)
