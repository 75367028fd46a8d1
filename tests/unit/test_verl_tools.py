"""verl 0.9.1 itself (installed --no-deps by `make venv`) against tripod's agent pieces: a tool subclassing verl's own
BaseTool and answering with verl's ToolResponse, and functions decorated with verl's own @function_tool, run through
tripod's ToolRunner and `tripod tool` as verl's tool agent loop runs them; verl's multi_turn / agent / data keys with
verl's defaults (read from verl's own YAML) load into tripod's schema; the prompts carry the raw chat, the chat
template kwargs and a row's tool_selection. The tool files live in tests/data/verl_tools/ for reuse in a training run."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from verl.tools.base_tool import BaseTool as VerlBaseTool
from verl.tools.function_tool import FUNCTION_TOOL_REGISTRY, normalize_function_tool_return
from verl.tools.schemas import ToolResponse as VerlToolResponse

from tests.data.verl_tools.counting_tool import VerlCountingTool
from tests.helpers.agent import QWEN3_TEMPLATE, QWEN25_TEMPLATE, chatml_tokenizer
from tests.helpers.common import REPO_ROOT, launch_env
from tripod.engine.agent import AgentData, ToolCall, ToolRunner, load_all_tools, tool_schemas
from tripod.engine.agent.function_tools import normalize_return
from tripod.engine.config import TripodConfig, load_config
from tripod.engine.data.dataset import PromptDataset

DATA = REPO_ROOT / "tests" / "data" / "verl_tools"
TOOLS_YAML, FUNCTIONS = str(DATA / "tools.yaml"), str(DATA / "function_tools.py")
VERL_CONFIG = Path(importlib.util.find_spec("verl").submodule_search_locations[0]) / "trainer" / "config"


def _runner(tools, **kw) -> ToolRunner:
    return ToolRunner(tools, **{"max_parallel_calls": 4, "max_tool_response_length": 256,
                                "tool_response_truncate_side": "middle", "timeout_s": 10.0, **kw})


def tripod_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tripod", "tool", *args], capture_output=True, text=True,
                          env=launch_env(), cwd=REPO_ROOT, timeout=120)


def test_a_verl_base_tool_runs_create_execute_release_per_call_and_never_calc_reward():
    tools = load_all_tools(TOOLS_YAML, None)
    assert isinstance(tools["count_letters"], VerlBaseTool)
    runner, before = _runner(tools), dict(VerlCountingTool.calls)
    kwargs = {"count_letters": {"create_kwargs": {"ground_truth": "3"}}}
    data = AgentData(messages=[{"role": "user", "content": "count"}], request_id="req-1", tools_kwargs=kwargs)

    async def episode():
        await runner.start("a", kwargs)
        first = await runner.call("a", [ToolCall("count_letters", {"word": "banana", "letter": "a"}),
                                        ToolCall("count_letters", {"word": "kiwi", "letter": "i"})], agent_data=data)
        data.messages.append({"role": "tool", "content": first[0].text})
        again = await runner.call("a", [ToolCall("count_letters", {"word": "apple", "letter": "p"})], agent_data=data)
        return first + again, await runner.finish_scores("a")

    results, scores = asyncio.run(episode())
    counted = {k: VerlCountingTool.calls[k] - before[k] for k in before}
    assert counted == {"create": 3, "execute": 3, "release": 3, "calc_reward": 0} and scores == {}
    assert [r.text.split(" (")[0] for r in results] == ["3", "2", "2"]
    # one instance open during each call (both calls of a turn may overlap), the conversation and row seen
    assert "messages 2, request req-1, truth 3" in results[2].text and "open 1" in results[2].text
    assert all(r.reward is None and r.error is None and r.metrics == {} for r in results)  # None reward: skipped
    assert data.extra_fields == {"count_letters_calls": 3} and tools["count_letters"]._instances == {}


def test_a_rows_tool_selection_limits_its_tools_as_verl_does():
    runner = _runner(load_all_tools(TOOLS_YAML, None))

    async def episode():
        await runner.start("r", {}, tool_selection=["calculator", "no_such"])
        return await runner.call("r", [ToolCall("count_letters", {"word": "a", "letter": "a"}),
                                       ToolCall("calculator", {"expression": "1+1"})])

    refused, allowed = asyncio.run(episode())
    assert refused.text == "Unknown function 'count_letters'. Available tools: ['calculator']"
    assert allowed.text == "2" and allowed.error is None


def test_tripod_tool_runs_the_verl_tool_and_prints_one_json_line():
    out = tripod_tool(TOOLS_YAML, "count_letters", "--args", '{"word": "banana", "letter": "n"}',
                      "--create-kwargs", '{"ground_truth": "2"}')
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1, out.stdout  # verl's BaseTool prints its schema: that went to stderr
    result = json.loads(lines[0])
    assert result["text"] == "2 (call 1, open 1, messages 0, request tripod-tool, truth 2)"
    assert (result["tool"], result["reward"], result["error"], result["timed_out"]) == ("count_letters", None,
                                                                                         None, False)
    assert '"name": "count_letters"' in out.stderr


def test_verl_function_tools_load_from_function_tool_path_with_verls_schemas():
    tools = load_all_tools(TOOLS_YAML, FUNCTIONS)
    assert list(tools) == ["count_letters", "calculator", "reverse_word", "letter_stats", "check_answer"]
    verls = {n: FUNCTION_TOOL_REGISTRY[n].tool_schema.model_dump(exclude_unset=True, exclude_none=True)
             for n in ("reverse_word", "letter_stats", "check_answer")}
    assert tool_schemas(tools)[2:] == list(verls.values())  # what verl renders into the prompt, exactly
    runner = _runner(tools, max_tool_response_length=50, tool_response_truncate_side="left")

    async def episode():
        return await runner.call("a", [ToolCall("reverse_word", {"word": "tripod" * 9}),
                                       ToolCall("letter_stats", {"word": "banana", "letter": "a"}),
                                       ToolCall("check_answer", {"answer": 4, "expected": 4}),
                                       ToolCall("check_answer", {"answer": 3, "expected": 4})])

    reverse, stats, right, wrong = asyncio.run(episode())
    assert reverse.text == "(truncated)..." + ("tripod" * 9)[::-1][-50:]  # verl's `left`: the last 50 kept
    assert stats.text == '{"count": 3, "length": 6}' and stats.reward == 0.0  # a dict: JSON, reward 0.0
    assert (right.text, right.reward, right.error) == ("correct", 1.0, None)
    assert wrong.text == "Error executing tool 'check_answer': 3 is not 4" and wrong.reward == 0.0
    assert "ValueError: 3 is not 4" in wrong.error


@pytest.mark.parametrize("ret", ["plain", {"a": "é"}, 7, (VerlToolResponse(text="t"),), ("s", None),
                                 ("s", 2, {"k": 1}), ("s", 0, None), VerlToolResponse(text="r")])
def test_function_tool_returns_normalize_as_verls(ret):
    response, reward, metrics = normalize_function_tool_return(ret)
    mine = normalize_return(ret)
    assert (mine[0].text, mine[1], mine[2]) == (response.text, reward, metrics)


def test_tripods_function_tool_decorator_infers_verls_schema(tmp_path):
    body = ('(word: str, times: int = 1) -> str:\n    """Repeat a word.\n\n    Args:\n        word: The word.\n'
            '        times: How often.\n    """\n    return word * times\n')
    path = tmp_path / "both.py"
    path.write_text("from tripod.engine.agent import function_tool as ours\n"
                    "from verl.tools.function_tool import function_tool as verls\n\n\n"
                    f"@ours\ndef repeat_ours{body}\n\n@verls\ndef repeat_verls{body}")
    tools = load_all_tools(None, str(path))
    ours, verls = (tools[n].tool_schema.model_dump(exclude_unset=True) for n in ("repeat_ours", "repeat_verls"))
    assert ours["function"].pop("name") == "repeat_ours" and verls["function"].pop("name") == "repeat_verls"
    assert ours == verls and ours["function"]["parameters"]["required"] == ["word"]
    clash = tmp_path / "clash.py"
    clash.write_text("from tripod.engine.agent import function_tool\n\n\n@function_tool\ndef calculator(x: int) -> int:\n"
                     '    """Shadow the calculator.\n\n    Args:\n        x: A number.\n    """\n    return x\n')
    with pytest.raises(ValueError) as info:
        load_all_tools(TOOLS_YAML, str(clash))
    assert str(info.value) == (f"function tool name(s) ['calculator'] of '{clash}' collide with tools already declared "
                               f"in '{TOOLS_YAML}'; each tool name must be unique across tool_config_path and "
                               "function_tool_path: rename one of them")


def test_tripod_tool_runs_a_verl_function_tool():
    out = tripod_tool("-", "letter_stats", "--function-tool-path", FUNCTIONS, "--args",
                      '{"word": "tripod", "letter": "p"}')
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"tool": "letter_stats", "text": '{"count": 1, "length": 6}', "reward": 0.0,
                                      "metrics": {}, "error": None, "timed_out": False,
                                      "seconds": json.loads(out.stdout)["seconds"]}


def test_verls_multi_turn_agent_and_data_keys_load_with_verls_defaults():
    rollout = OmegaConf.to_container(OmegaConf.load(VERL_CONFIG / "rollout" / "rollout.yaml"))
    data = OmegaConf.to_container(OmegaConf.load(VERL_CONFIG / "data" / "legacy_data.yaml"))
    ours = OmegaConf.to_container(OmegaConf.structured(TripodConfig))

    def same(verl: dict, mine: dict, where: str) -> None:
        for key, value in verl.items():
            if key == "_target_":
                continue
            assert key in mine, f"{where}.{key}: verl 0.9.1's key is not in tripod's schema"
            if isinstance(value, dict) and value:
                same(value, mine[key], f"{where}.{key}")
            else:
                assert mine[key] == value, f"{where}.{key}: tripod's default {mine[key]!r}, verl's {value!r}"

    arr = ours["actor_rollout_ref"]["rollout"]
    same(rollout["multi_turn"], arr["multi_turn"], "multi_turn")
    same(rollout["agent"], arr["agent"], "agent")
    same({k: data[k] for k in ("return_raw_chat", "apply_chat_template_kwargs")}, ours["data"], "data")
    verls = [f"actor_rollout_ref.rollout.{section}.{k}={json.dumps(v)}" for section in ("multi_turn", "agent")
             for k, v in rollout[section].items() if not isinstance(v, dict) and k != "_target_"]
    loaded = load_config(overrides=verls + [f"data.{k}={json.dumps(data[k])}" for k in ("return_raw_chat",)])
    assert loaded.actor_rollout_ref.rollout.check() == []  # verl's values pass tripod's checks


@pytest.mark.parametrize("key, value, expected", [
    ("multi_turn.use_inference_chat_template", True, "multi_turn.use_inference_chat_template=true: tripod always "
     "trains on the tokens the model generated (verl 0.9.1's only path); set it to false"),
    ("multi_turn.num_repeat_rollouts", 4, "multi_turn.num_repeat_rollouts=4: verl's deprecated repeat count is not "
     "supported; set actor_rollout_ref.rollout.n (responses per prompt) and leave this null"),
    ("multi_turn.tokenization_sanity_check_mode", "loose", "multi_turn.tokenization_sanity_check_mode='loose' is not "
     "one of ['strict', 'ignore_strippable', 'disable']"),
    ("agent.default_agent_loop", "tool_agent", "agent.default_agent_loop=tool_agent needs "
     "actor_rollout_ref.rollout.multi_turn.enable=true (tripod's agent loop follows it); turn multi_turn on or set "
     "single_turn_agent"),
    ("agent.agent_loop_config_path", "loops.yaml", "agent.agent_loop_config_path='loops.yaml': custom agent-loop "
     "classes are not supported; tripod's agent loop takes actor_rollout_ref.rollout.multi_turn.* (set it to null)"),
    ("agent.custom_async_server.name", "AsyncvLLMServer", "agent.custom_async_server: a custom rollout server is not "
     "supported; pick an engine with actor_rollout_ref.rollout.name (set path and name to null)"),
])
def test_verl_keys_tripod_cannot_honour_are_refused_in_one_line(key, value, expected):
    cfg = load_config(overrides=[f"actor_rollout_ref.rollout.{key}={json.dumps(value)}"])
    assert cfg.actor_rollout_ref.rollout.check() == [f"actor_rollout_ref.rollout.{expected}"]


def test_prompts_carry_the_raw_chat_the_template_kwargs_and_a_rows_tool_selection(tmp_path):
    schemas = tool_schemas(load_all_tools(TOOLS_YAML, None))
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}],
             "data_source": "arithmetic", "reward_model": {"ground_truth": "5"}, "extra_info": {}},
            {"prompt": [{"role": "user", "content": "n in banana?"}], "data_source": "arithmetic",
             "reward_model": {"ground_truth": "2"}, "extra_info": {"tool_selection": ["count_letters"]}}]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = chatml_tokenizer(QWEN25_TEMPLATE)
    ds = PromptDataset(str(chat), tok, max_prompt_length=4096, tools=schemas)
    batch = ds.batch([0, 1])
    assert batch.raw_prompts == [rows[0]["prompt"], rows[1]["prompt"]]
    assert batch.raw_prompts[0] is ds[0]["raw_prompt"]  # shared with the dataset, not copied per batch
    texts = [tok.decode(ds[i]["input_ids"]) for i in range(2)]
    assert '"calculator"' in texts[0] and '"count_letters"' in texts[0]
    assert '"count_letters"' in texts[1] and '"calculator"' not in texts[1]  # the row's selection only, as verl
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({**rows[0], "prompt": "2+3?"}) + "\n")
    assert PromptDataset(str(plain), tok, max_prompt_length=4096).batch([0]).raw_prompts is None
    qwen3 = chatml_tokenizer(QWEN3_TEMPLATE)
    thinking, quiet = (qwen3.decode(PromptDataset(str(chat), qwen3, max_prompt_length=4096,
                                                  chat_template_kwargs=kw)[0]["input_ids"])
                       for kw in (None, {"enable_thinking": False}))
    # data.apply_chat_template_kwargs reached the template: Qwen3's empty think block after the generation prompt
    assert "<think>" not in thinking and quiet.startswith(thinking) and "</think>" in quiet[len(thinking):]
