"""Agentic rollouts: tools and interactions in verl's formats, run per trajectory without ever crashing the run.

    from tripod.engine.agent import AgentData, ToolCall, ToolRunner, load_all_tools, load_interactions, tool_schemas

    tools = load_all_tools(cfg.tool_config_path, cfg.function_tool_path)  # verl `tools:` YAML + @function_tool file
    interactions = load_interactions(cfg.interaction_config_path)        # verl `interaction:` YAML -> {name: instance}
    validate_agent_inputs(tools, interactions, dataset_extra_infos)      # one line per bad row, before any model
    runner = ToolRunner(tools, max_parallel_calls=1, max_tool_response_length=256,
                        tool_response_truncate_side="middle", timeout_s=60)
    await runner.start(row_key, extra_info.get("tools_kwargs") or {}, extra_info.get("tool_selection"))
    data = AgentData(messages=prompt_messages + history, request_id=row_key, tools_kwargs=...)
    results = await runner.call(row_key, [ToolCall("calculator", {"expression": "6*7"})], agent_data=data)
    scores = await runner.finish_scores(row_key)   # per-trajectory tools' calc_reward; frees the row

tools.py: schema, tool protocol, AgentData, loading; function_tools.py: @function_tool files; builtin_tools.py:
calculator and Python tool (sandbox.py runs the code); tool_runner.py: verl's per-call lifecycle (or tripod's
per-trajectory one), concurrency, time-outs, truncation; interactions.py: user simulators; validation.py: the rows'
tools_kwargs / tool_selection / interaction_kwargs. Nothing here needs torch.
"""
from tripod.engine.agent.function_tools import FunctionTool, function_tool, load_all_tools, load_function_tools
from tripod.engine.agent.interactions import BaseInteraction, InteractionRunner, load_interactions
from tripod.engine.agent.tool_runner import ToolCall, ToolResult, ToolRunner, truncate
from tripod.engine.agent.tools import (
    AgentData,
    BaseTool,
    OpenAIFunctionToolSchema,
    ToolResponse,
    load_tools,
    tool_schemas,
)
from tripod.engine.agent.validation import validate_agent_inputs

__all__ = ["AgentData", "BaseInteraction", "BaseTool", "FunctionTool", "InteractionRunner", "OpenAIFunctionToolSchema",
           "ToolCall", "ToolResponse", "ToolResult", "ToolRunner", "function_tool", "load_all_tools",
           "load_function_tools", "load_interactions", "load_tools", "tool_schemas", "truncate",
           "validate_agent_inputs"]
