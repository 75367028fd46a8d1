"""The hermes tool-call syntax (Qwen2.5 / Qwen3 chat templates, NousResearch Hermes): parsing a model turn's text and
writing a call the way a model is taught to.

A call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` inside the assistant's turn; a turn may hold
several. `parse_tool_calls` returns every well-formed call in order and, for each `<tool_call>` block that is not one
(not JSON, no string "name", "arguments" not an object, an unclosed block), a short error the agent loop turns into an
error tool message (the model then sees what went wrong, as an unknown tool name does), so a malformed call is never
silently dropped. `arguments` given as a JSON string (as some models write) is decoded once more.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

FORMATS = ("hermes",)  # actor_rollout_ref.rollout.multi_turn.format
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


@dataclass
class ParsedCall:
    """A call the model wrote: what engine/agent/tool_runner.py's `ToolRunner.call` takes (its `ToolCall` fields)."""
    name: str
    arguments: dict = field(default_factory=dict)


def parse_tool_calls(text: str) -> tuple[list[ParsedCall], list[str]]:
    """(the well-formed calls of `text` in order, one error line per malformed `<tool_call>` block)."""
    calls: list[ParsedCall] = []
    errors: list[str] = []
    for block in _BLOCK.findall(text):
        body = block.strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"the tool call is not JSON ({e.msg} at character {e.pos}): {body[:200]!r}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            errors.append(f'the tool call needs {{"name": "<tool>", "arguments": {{...}}}}, got {body[:200]!r}')
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            errors.append(f"the arguments of tool call {obj['name']!r} must be a JSON object, got {str(args)[:200]!r}")
            continue
        calls.append(ParsedCall(obj["name"], args))
    tail = _BLOCK.sub("", text)
    if OPEN in tail:
        errors.append(f"a {OPEN} block is not closed with {CLOSE}")
    return calls, errors


def format_tool_call(name: str, arguments: dict) -> str:
    """One call as a model writes it (the SFT transcripts and the tests use it)."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"
