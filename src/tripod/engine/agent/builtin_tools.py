"""Built-in tools: a calculator (safe arithmetic) and a Python code tool (a sandbox of Linux namespaces, sandbox.py).

    tools:
      - class_name: tripod.engine.agent.builtin_tools.CalculatorTool
        config: {type: native}                   # tool_schema may be left out: the default below is used
      - class_name: tripod.engine.agent.builtin_tools.PythonTool
        config: {type: native, timeout: 10, cpu_time_limit: 10, memory_limit_mb: 1024, max_output_bytes: 16384,
                 max_processes: 64, max_concurrency: 4}   # unsafe_local: true only where namespaces are unavailable

The calculator parses the expression with `ast` and evaluates numbers, + - * / // % **, parentheses and a few
math functions only (no names, attributes or calls of anything else); huge powers are refused. A failure is
reported to the runner through the metrics' `error` key (it counts in tool/errors), with the message as the text.
"""
from __future__ import annotations

import ast
import asyncio
import logging
import math
import operator
import os
import sys
from typing import Any

from tripod.engine.agent import sandbox
from tripod.engine.agent.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse

logger = logging.getLogger(__name__)

_MAX_BITS = 4096  # integers beyond ~1e1233 are refused (and so are powers that would make them)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt, "floor": math.floor,
              "ceil": math.ceil, "log": math.log, "exp": math.exp}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def _schema(name: str, description: str, arg: str, arg_description: str) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.model_validate({
        "type": "function", "function": {"name": name, "description": description, "parameters": {
            "type": "object", "properties": {arg: {"type": "string", "description": arg_description}},
            "required": [arg]}}})


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError with a short reason for anything else."""
    if len(expression) > 1000:
        raise ValueError("expression longer than 1000 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _eval(tree.body)


def _checked(value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("only numbers are allowed")
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise ValueError("result too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not finite")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        return _checked(node.value)
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 1 and abs(left) > 1:
            if math.log2(abs(left)) * abs(right) > _MAX_BITS:
                raise ValueError("result too large")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except (ZeroDivisionError, OverflowError) as e:
            raise ValueError(str(e)) from None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS and not node.keywords:
        args = [_eval(a) for a in node.args]
        try:
            return _checked(_FUNCTIONS[node.func.id](*args))
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"{node.func.id}: {e}") from None
    raise ValueError(f"unsupported syntax: {ast.unparse(node)!r}")


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".12g")


class CalculatorTool(BaseTool):
    """`calculator(expression)` -> the value as text."""

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return _schema("calculator", "Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses, "
                       "sqrt, abs, round, min, max, floor, ceil, log, exp).", "expression",
                       "The expression, e.g. (12 + 30) * 7 / 3")

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        try:
            return ToolResponse(text=format_number(evaluate(str(parameters.get("expression", ""))))), 0.0, {}
        except ValueError as e:
            return ToolResponse(text=f"Error: {e}"), 0.0, {"error": str(e)}


class PythonTool(BaseTool):
    """`code_interpreter(code)` -> what the code printed (stdout, then stderr), run by sandbox.run_python in fresh
    Linux namespaces (what it sees and what limits it: sandbox.py's docstring). Where namespaces are unavailable the
    tool refuses to start, unless `unsafe_local: true` lets it run the code as tripod's user with rlimits only."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        super().__init__(config, tool_schema)
        self.wall_s = float(config.get("timeout", 10))
        self.cpu_s = float(config.get("cpu_time_limit", self.wall_s))
        self.memory_mb = int(config.get("memory_limit_mb", 1024))
        self.max_output_bytes = int(config.get("max_output_bytes", 16384))
        self.max_processes = int(config.get("max_processes", 64))
        self.python = os.path.realpath(config.get("python") or sys.executable)  # a venv's python -> the base one
        self.max_concurrency = int(config.get("max_concurrency", os.cpu_count() or 1))
        if min(self.wall_s, self.cpu_s, self.memory_mb, self.max_output_bytes, self.max_concurrency,
               self.max_processes) <= 0:
            raise ValueError("timeout, cpu_time_limit, memory_limit_mb, max_output_bytes, max_concurrency and "
                             "max_processes must be positive")
        unsafe_local = config.get("unsafe_local", False)
        if not isinstance(unsafe_local, bool):
            raise ValueError(f"unsafe_local must be true or false, not {unsafe_local!r}")
        problem = sandbox.namespace_problem()
        if problem is not None and not unsafe_local:
            raise ValueError(f"PythonTool: no sandbox for model-written code here ({problem}); allow unprivileged "
                             "user namespaces (sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1; "
                             "a container needs them too) or set `unsafe_local: true` in the tool's config to run the "
                             "code without isolation")
        if problem is not None:
            logger.warning("PythonTool: UNSAFE: unsafe_local is true and there is no sandbox (%s): model-written code "
                           "runs as this process's user and can read and write its files, reach the network and "
                           "signal its processes", problem)
        self.isolated = problem is None
        self._gate: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return _schema("code_interpreter", "Run a Python program and return what it prints. Use print() to show "
                       "results.", "code", "The Python source to run")

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._gate is None or self._gate[0] is not loop:  # a semaphore belongs to one event loop
            self._gate = (loop, asyncio.Semaphore(self.max_concurrency))
        return self._gate[1]

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text="Error: `code` must be a non-empty string"), 0.0, {"error": "no code"}
        async with self._semaphore():
            result = await sandbox.run_python(code, wall_s=self.wall_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb,
                                              max_output_bytes=self.max_output_bytes, python=self.python,
                                              max_processes=self.max_processes, isolated=self.isolated)
        text = result.stdout + result.stderr
        failure = result.failure()
        if failure:
            text += ("\n" if text and not text.endswith("\n") else "") + f"Error: {failure}"
        metrics: dict[str, Any] = {"exit_code": result.exit_code, "seconds": result.seconds}
        if failure:
            metrics.update(error=failure, timed_out=result.timed_out)
        return ToolResponse(text=text), 0.0, metrics
