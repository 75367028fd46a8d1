"""Tools in verl's format: the `tools:` YAML list, the OpenAI function schema, the tool class protocol, AgentData.

    tools:
      - class_name: tripod.engine.agent.builtin_tools.CalculatorTool   # any importable module.Class
        config: {type: native}                                           # handed to the constructor as a dict
        tool_schema:                                                     # an OpenAI function schema
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, properties: {...}, required: [...]}}

A tool class needs verl's constructor `(config: dict, tool_schema)` (the schema arrives as a pydantic model shaped
like verl 0.9.1's `OpenAIFunctionToolSchema`, so `tool_schema.function.name` works) and the async methods
`create(instance_id=None, **kwargs) -> (instance_id, response)`, `execute(instance_id, parameters, **kwargs) ->
(response, step_reward, metrics)` and `release(instance_id, **kwargs)`; `calc_reward(instance_id, **kwargs) ->
float` only for a tool that opts into tripod's per-trajectory lifecycle (tool_runner.py). A response is anything
with `.text` (verl's `ToolResponse`, this module's) or a plain string. Nothing has to inherit `BaseTool`: a class
written against verl's signatures, or subclassing verl's own `BaseTool`, runs unchanged. A tool reports a failure
without raising by putting `error` (a short string) and/or `timed_out: True` in its metrics; the runner counts them
like a raised exception. A schema may be left out of the YAML when the class supplies one through
`get_openai_tool_schema()` (as verl allows). Only `config.type: native` exists (verl 0.9.1 removed `mcp` too).

Two per-tool settings, read by `tool_setting` from a class / instance attribute or else the tool's `config`:
`lifecycle` (`call`, verl 0.9.1's default, or `trajectory`) and `max_concurrency` (most executes of the tool at once
over all rows of a batch).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_HINT = ("write {type: function, function: {name, description, parameters: {type: object, properties: "
               "{arg: {type, description}}, required: [...]}}}")


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter (verl 0.9.1's fields: a union's type is a list, an enum may hold any JSON values; further
    JSON-schema keys such as `items` are kept, where verl drops them)."""
    model_config = ConfigDict(extra="allow")
    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    name: str = Field(min_length=1)
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[]))
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """verl's tool schema model: what a tool's constructor receives."""
    type: str
    function: OpenAIFunctionSchema


@dataclass
class ToolResponse:
    """A tool's answer (verl's `ToolResponse`, text only: tripod's agent loop is text-only)."""
    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video


@dataclass
class AgentData:
    """What verl 0.9.1's tool agent loop hands every `execute` as `agent_data=` (its `AgentData`'s fields): a tool
    written for verl reads the conversation or stores per-trajectory state in `extra_fields` through it. The loop makes
    one per row; tripod's trajectories are text-only, so the multimodal fields stay empty."""
    messages: list[dict[str, Any]]  # the conversation so far: the prompt's messages, then the trajectory's turns
    request_id: str
    tools_kwargs: dict[str, Any]  # the row's extra_info.tools_kwargs
    image_data: list[Any] | None = None
    video_data: list[Any] | None = None
    audio_data: list[Any] | None = None
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    mm_processor_output: list[dict[str, Any]] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)
    user_turns: int = 0
    assistant_turns: int = 0
    tool_calls: list[Any] = field(default_factory=list)
    routed_experts: Any = None
    extra_fields: dict[str, Any] = field(default_factory=dict)


def tool_setting(tool: object, key: str, default: Any = None) -> Any:
    """A per-tool setting: the tool's attribute `key` (class or instance), else its `config[key]`, else `default`."""
    value = getattr(tool, key, None)
    if value is None:
        config = getattr(tool, "config", None)
        value = config.get(key) if isinstance(config, dict) else None
    return default if value is None else value


class BaseTool:
    """Optional base class with verl's defaults: a fresh instance per call (verl 0.9.1), no state, reward 0."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__}: no tool_schema in the tool config and none from "
                             "get_openai_tool_schema()")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


def parse_tool_schema(schema: Any, where: str) -> OpenAIFunctionToolSchema:
    """Validate an OpenAI function schema; one-line ValueError naming `where` and the first problem."""
    try:
        parsed = OpenAIFunctionToolSchema.model_validate(schema)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ValueError(f"{where} is not an OpenAI function schema ({loc}: {first['msg']}); {SCHEMA_HINT}") from None
    if parsed.type != "function" or parsed.function.parameters.type != "object":
        raise ValueError(f"{where} is not an OpenAI function schema (type must be 'function' and "
                         f"function.parameters.type 'object'); {SCHEMA_HINT}")
    missing = sorted(set(parsed.function.parameters.required) - set(parsed.function.parameters.properties))
    if missing:
        raise ValueError(f"{where}: function.parameters.required names {missing}, which are not in properties")
    return parsed


def import_class(dotted: Any, where: str) -> type:
    """`module.Class` -> the class; one-line ValueError naming `where` and the fix."""
    if not isinstance(dotted, str) or "." not in dotted.strip("."):
        raise ValueError(f"{where}.class_name {dotted!r} must be an importable 'package.module.ClassName'")
    module_name, class_name = dotted.rsplit(".", 1)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001  (any import-time failure of user code is a config error here)
        raise ValueError(f"{where}.class_name {dotted!r}: cannot import module {module_name!r} "
                         f"({type(e).__name__}: {e}); fix the name or put the module on PYTHONPATH") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"{where}.class_name {dotted!r}: module {module_name!r} has no class {class_name!r}")
    return cls


def load_yaml_list(path: str, key: str) -> list[dict]:
    """The `key:` list of a YAML file as plain dicts (omegaconf, as verl: `${...}` interpolations resolve)."""
    from omegaconf import OmegaConf

    if not Path(path).is_file():
        raise ValueError(f"{path}: file not found (a `{key}:` YAML file)")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{path}: not readable YAML ({type(e).__name__}: {e})") from None
    items = data.get(key) if isinstance(data, dict) else None
    if not isinstance(items, list) or not all(isinstance(it, dict) for it in items):
        raise ValueError(f"{path}: expected a top-level `{key}:` list of mappings")
    return items


def schema_of(tool: object) -> OpenAIFunctionToolSchema:
    schema = getattr(tool, "tool_schema", None)
    if schema is None and hasattr(tool, "get_openai_tool_schema"):
        schema = tool.get_openai_tool_schema()
    if isinstance(schema, OpenAIFunctionToolSchema):
        return schema
    dumped = schema.model_dump(exclude_unset=True) if hasattr(schema, "model_dump") else schema
    return parse_tool_schema(dumped, f"{type(tool).__name__}.tool_schema")


def load_tools(tool_config_path: str) -> dict[str, object]:
    """Build every tool of a verl `tools:` YAML: name (the schema's function name) -> instance."""
    tools: dict[str, object] = {}
    for i, entry in enumerate(load_yaml_list(tool_config_path, "tools")):
        where = f"{tool_config_path}: tools[{i}]"
        cls = import_class(entry.get("class_name"), where)
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{where}.config must be a mapping")
        if config.get("type", "native") != "native":
            raise ValueError(f"{where}.config.type {config['type']!r}: only 'native' tools are supported")
        raw = entry.get("tool_schema")
        schema = None if raw is None else parse_tool_schema(raw, f"{where}.tool_schema")
        try:
            tool = cls(config=config, tool_schema=schema)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{where}: {entry['class_name']}(config, tool_schema) raised "
                             f"{type(e).__name__}: {e}") from None
        if not hasattr(tool, "config"):  # verl's BaseTool keeps it; tool_setting reads lifecycle / max_concurrency there
            try:
                tool.config = config
            except AttributeError:  # __slots__: the settings must then be class attributes
                pass
        name = schema_of(tool).function.name
        if name in tools:
            raise ValueError(f"{where}: duplicate tool name {name!r}; function names must be unique")
        needed = ("create", "execute", "release") + (("calc_reward",) if tool_setting(tool, "lifecycle") == "trajectory"
                                                      else ())
        missing = [m for m in needed if not callable(getattr(tool, m, None))]
        if missing:
            raise ValueError(f"{where}: {entry['class_name']} lacks the tool method(s) {missing} (verl's BaseTool API)")
        tools[name] = tool
    return tools


def tool_schemas(tools: dict[str, object]) -> list[dict]:
    """The OpenAI function schemas for `apply_chat_template(tools=...)`, dumped as verl does."""
    return [schema_of(t).model_dump(exclude_unset=True, exclude_none=True) for t in tools.values()]
