"""Agentic rollouts: tools and interactions in verl's formats, run per trajectory without ever crashing the run.

    from tripod.engine.agent import load_tools, load_interactions, tool_schemas, validate_agent_inputs, ToolRunner

    tools = load_tools(cfg.tool_config_path)                       # verl `tools:` YAML -> {name: instance}
    interactions = load_interactions(cfg.interaction_config_path)  # verl `interaction:` YAML -> {name: instance}
    validate_agent_inputs(tools, interactions, dataset_extra_infos)  # one line per bad row, before any model
    runner = ToolRunner(tools, max_parallel_calls=1, max_tool_response_length=256,
                        tool_response_truncate_side="middle", timeout_s=30)
    await runner.start(row_key, extra_info.get("tools_kwargs", {}))
    results = await runner.call(row_key, [ToolCall("calculator", {"expression": "6*7"})])   # -> [ToolResult]
    tool_reward = await runner.finish(row_key)

tools.py: schema, tool protocol, loading; builtin_tools.py: calculator and Python tool (sandbox.py runs the code);
tool_runner.py: per-row instances, concurrency, time-outs, truncation; interactions.py: user simulators;
validation.py: the rows' tools_kwargs / interaction_kwargs. Nothing here needs torch.
"""
from tripod.engine.agent.interactions import BaseInteraction, InteractionRunner, load_interactions
from tripod.engine.agent.tool_runner import ToolCall, ToolResult, ToolRunner, truncate
from tripod.engine.agent.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse, load_tools, tool_schemas
from tripod.engine.agent.validation import validate_agent_inputs

__all__ = ["BaseInteraction", "BaseTool", "InteractionRunner", "OpenAIFunctionToolSchema", "ToolCall", "ToolResponse",
           "ToolResult", "ToolRunner", "load_interactions", "load_tools", "tool_schemas", "truncate",
           "validate_agent_inputs"]
