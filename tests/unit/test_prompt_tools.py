"""Prompts rendered with the tools (engine/data/dataset.py `prompt_tools`): with multi-turn on and a tool config, the
chat template gets apply_chat_template(tools=...) as in verl's agent loop, so a Qwen-style template lists the
tool schemas in the system turn; a template that ignores `tools` (SmolLM2's) renders the prompt as before.
Planted by hand: dropping tools= from the call fails the first test."""
from __future__ import annotations

import json
from types import SimpleNamespace

from tests.helpers.agent import QWEN25_TEMPLATE, chatml_tokenizer
from tripod.engine.data.dataset import PromptDataset, prompt_tools

TOOLS_YAML = """tools:
  - class_name: tripod.engine.agent.builtin_tools.CalculatorTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: calculator
        description: Evaluate an arithmetic expression.
        parameters:
          type: object
          properties: {expression: {type: string, description: the expression}}
          required: [expression]
"""


def config(tmp_path, enable=True):
    path = tmp_path / "tools.yaml"
    path.write_text(TOOLS_YAML)
    mt = SimpleNamespace(enable=enable, tool_config_path=str(path), function_tool_path=None)
    return SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(multi_turn=mt)))


def prompt_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "2+3?"}], "data_source": "arithmetic",
                                "reward_model": {"ground_truth": "5"}}) + "\n")
    return str(path)


def rendered(tok, files, tools):
    ds = PromptDataset(files, tok, max_prompt_length=4096, tools=tools)
    return tok.decode(ds[0]["input_ids"])


def test_a_template_that_reads_tools_lists_the_schemas(tmp_path):
    tools = prompt_tools(config(tmp_path))
    assert [t["function"]["name"] for t in tools] == ["calculator"]
    tok, files = chatml_tokenizer(QWEN25_TEMPLATE), prompt_file(tmp_path)
    text = rendered(tok, files, tools)
    assert text.startswith("<|im_start|>system\nTools: [") and '"name": "calculator"' in text
    assert '"expression"' in text and text.endswith("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert "calculator" not in rendered(tok, files, None)  # without multi-turn tools: the template's own system turn
    assert prompt_tools(config(tmp_path, enable=False)) is None


def test_a_template_that_ignores_tools_renders_as_before(tmp_path):
    tok, files = chatml_tokenizer(), prompt_file(tmp_path)
    assert rendered(tok, files, prompt_tools(config(tmp_path))) == rendered(tok, files, None)
