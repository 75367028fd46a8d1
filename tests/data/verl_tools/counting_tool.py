"""A tool written for verl 0.9.1 and nothing else: it subclasses verl's own `BaseTool`, answers with verl's
`ToolResponse` and a None step reward (as verl's sandbox tool does), reads `agent_data`, and counts its lifecycle
calls, so a run through tripod shows the lifecycle verl 0.9.1's `_call_tool` drives: per call create, execute,
release; never calc_reward. Used by tests/unit/test_verl_tools.py (through `tools.yaml`) and reusable for a training
run (PYTHONPATH=the repository root)."""
from __future__ import annotations

from typing import Any, Optional
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse


class VerlCountingTool(BaseTool):
    """`count_letters(word, letter)`: how often `letter` occurs in `word`; the answer also says which call of this
    process it was, how many instances are open, the conversation's length and the row's ground truth
    (create_kwargs)."""
    calls = {"create": 0, "execute": 0, "release": 0, "calc_reward": 0}

    def __init__(self, config: dict, tool_schema):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict] = {}

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        VerlCountingTool.calls["create"] += 1
        instance_id = instance_id or str(uuid4())
        self._instances[instance_id] = {"ground_truth": (kwargs.get("create_kwargs") or {}).get("ground_truth")}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, None, None]:
        VerlCountingTool.calls["execute"] += 1
        agent_data = kwargs["agent_data"]
        agent_data.extra_fields["count_letters_calls"] = agent_data.extra_fields.get("count_letters_calls", 0) + 1
        word, letter = str(parameters.get("word", "")), str(parameters.get("letter", ""))
        count = word.count(letter) if letter else 0
        text = (f"{count} (call {VerlCountingTool.calls['execute']}, open {len(self._instances)}, "
                f"messages {len(agent_data.messages)}, request {agent_data.request_id}, "
                f"truth {self._instances[instance_id]['ground_truth']})")
        return ToolResponse(text=text), None, None

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        VerlCountingTool.calls["calc_reward"] += 1  # verl 0.9.1 never calls it
        return 1.0

    async def release(self, instance_id: str, **kwargs) -> None:
        VerlCountingTool.calls["release"] += 1
        del self._instances[instance_id]
