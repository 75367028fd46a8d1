"""`tripod tool` (engine/cli/tool.py): one call through the agent loop's ToolRunner, one JSON line on stdout; exit 0
when the tool failed (the failure is in the JSON), 2 on bad input; the time-out ends a call that sleeps or ignores
its cancellation at once; the truncation options are the runner's. (verl's own tools through it: test_verl_tools.py.)"""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.helpers.common import REPO_ROOT
from tripod.engine.agent import ToolCall, ToolRunner, load_all_tools
from tripod.engine.cli import main

CONFIGS = REPO_ROOT / "src" / "tripod" / "engine" / "agent" / "configs"
BOTH = str(CONFIGS / "calculator_and_python_tools.yaml")
FUNCTIONS = '''import asyncio
import time

from tripod.engine.agent import function_tool


@function_tool
def nap(seconds: float) -> str:
    """Sleep, blocking its thread.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


@function_tool("stubborn")
async def never_ends(word: str) -> str:
    """Ignore every cancellation.

    Args:
        word: Anything.
    """
    while True:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass


@function_tool
def shout(word: str) -> tuple:
    """Upper-case a word; step reward 0.5.

    Args:
        word: The word.
    """
    return word.upper(), 0.5, {"length": len(word)}
'''


def run(capsys, *argv: str) -> tuple[int, dict | None, str]:
    code = main(["tool", *argv])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == (1 if code == 0 else 0), out
    return code, json.loads(lines[0]) if lines else None, err


def test_the_calculator_and_the_python_tool(capsys, needs_sandbox):
    code, result, _ = run(capsys, BOTH, "calculator", "--args", '{"expression": "(12 + 30) * 7 / 3"}')
    assert code == 0 and {k: result[k] for k in ("tool", "text", "reward", "metrics", "error", "timed_out")} == {
        "tool": "calculator", "text": "98", "reward": 0.0, "metrics": {}, "error": None, "timed_out": False}
    code, result, _ = run(capsys, BOTH, "code_interpreter", "--args", '{"code": "print(sum(range(10)))"}')
    assert code == 0 and result["text"] == "45\n" and result["metrics"]["exit_code"] == 0


def test_a_failing_call_exits_0_with_the_failure_in_the_json(capsys, needs_sandbox):
    code, result, _ = run(capsys, BOTH, "calculator", "--args", '{"expression": "__import__(\'os\')"}')
    assert code == 0 and result["text"].startswith("Error: unsupported syntax") and "unsupported" in result["error"]
    code, result, _ = run(capsys, BOTH, "code_interpreter", "--args", '{"code": "raise SystemExit(3)"}')
    assert code == 0 and "3" in result["error"] and result["text"].endswith(result["error"])  # the sandbox's words


@pytest.mark.timeout(30)
def test_a_function_tool_with_the_time_out_and_truncation_options(capsys, tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(FUNCTIONS)
    runner = ToolRunner(load_all_tools(None, str(path)), max_parallel_calls=1, max_tool_response_length=99,
                        tool_response_truncate_side="middle", timeout_s=0.5)
    began = time.monotonic()  # asyncio.run, as the agent loop: it must not wait at exit for the sleeping thread
    (napped,) = asyncio.run(runner.call("r", [ToolCall("nap", {"seconds": 20})]))
    assert napped.timed_out and time.monotonic() - began < 5
    code, result, _ = run(capsys, "-", "shout", "--function-tool-path", str(path), "--args", '{"word": "tripod"}',
                          "--max-tool-response-length", "4", "--truncate-side", "right")
    assert code == 0 and (result["text"], result["reward"], result["metrics"]) == ("TRIP...(truncated)", 0.5,
                                                                                   {"length": 6})
    for name, args in (("nap", '{"seconds": 30}'), ("stubborn", '{"word": "x"}')):
        began = time.monotonic()
        code, result, _ = run(capsys, "-", name, "--function-tool-path", str(path), "--args", args,
                              "--timeout-s", "0.5")
        assert time.monotonic() - began < 5  # neither the blocked thread nor the stubborn task is waited for
        assert code == 0 and result["timed_out"] and result["text"] == (f"Error executing tool '{name}': timed out "
                                                                        "after 0.5 s"), result


@pytest.mark.parametrize("argv, expected", [
    ([BOTH, "search"], f"{BOTH}: no tool named 'search' (tools: calculator, code_interpreter)"),
    ([BOTH, "calculator", "--args", "[1, 2]"], "--args: must be a JSON object, got list"),
    ([BOTH, "calculator", "--args", "{oops"], "--args: not JSON (Expecting property name enclosed in double quotes: "
     "line 1 column 2 (char 1))"),
    (["missing.yaml", "calculator"], "missing.yaml: file not found (a `tools:` YAML file)"),
    (["-", "calculator"], "TOOL_CONFIG is '-' and no --function-tool-path is given: name a tools YAML or a Python "
     "file of @function_tool functions"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, argv, expected, tool_configs_load):
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.strip() == f"tripod tool: error: {expected}"
