"""engine/agent tools: verl's YAML and tool protocol (a verl-written class runs unchanged), verl 0.9.1's per-call
lifecycle and tripod's per-trajectory one, the runner's time-outs, errors, truncation, max_parallel_calls and
max_concurrency, and the bad-input lines of load_tools / validate_agent_inputs. (verl's own classes:
test_verl_tools.py.)"""
import asyncio
import time
from types import SimpleNamespace
from typing import Any, Optional
from uuid import uuid4

import pytest

from tests.helpers.common import REPO_ROOT
from tripod.engine.agent import (
    AgentData,
    ToolCall,
    ToolRunner,
    load_tools,
    tool_schemas,
    truncate,
    validate_agent_inputs,
)
from tripod.engine.agent.builtin_tools import evaluate

HERE = "tests.unit.test_agent_tools"


def _schema(name: str, arg: str = "answer") -> dict:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": {
        "type": "object", "properties": {arg: {"type": "string", "description": "x"}}, "required": [arg]}}}


class _Text:  # what verl's ToolResponse looks like to the runner: an object with .text
    def __init__(self, text: Optional[str] = None):
        self.text = text


class VerlGsm8kStyleTool:
    """Written against verl's signatures only (not tripod's BaseTool), like verl's Geo3kTool: the ground truth is
    create's own keyword (`create(instance_id, **create_kwargs)`, verl's SGLang rollout). `created` / `released`
    list the instance ids; `scored` counts calc_reward calls."""
    created: list = []
    released: list = []
    scored = 0

    def __init__(self, config: dict, tool_schema):
        self.config, self.tool_schema = config, tool_schema
        self.name = tool_schema.function.name
        self._instance_dict: dict = {}

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        VerlGsm8kStyleTool.created.append(instance_id)
        return instance_id, _Text()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        answer = str(parameters.get("answer", ""))
        state = self._instance_dict[instance_id]
        state["response"] = answer
        reward = 1.0 if state["response"] == state["ground_truth"] else 0.0
        step = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        data = kwargs.get("agent_data")
        return (_Text(f"Current parsed answer={answer!r} reward={reward} messages={len(data.messages)}"), step,
                {"scale": kwargs.get("scale"), "request": data.request_id})

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        VerlGsm8kStyleTool.scored += 1
        state = self._instance_dict[instance_id]
        return 1.0 if state["response"] == state["ground_truth"] else 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
        VerlGsm8kStyleTool.released.append(instance_id)


class PlainCreateKwargsTool(VerlGsm8kStyleTool):
    """Reads only `kwargs["create_kwargs"]` (`create(create_kwargs=...)`, verl's agent loop); answers with a plain
    string."""

    async def create(self, instance_id: Optional[str] = None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "reward": 0.0,
                                            "ground_truth": kwargs["create_kwargs"]["ground_truth"]}
        return instance_id, "created"

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        response, step, metrics = await super().execute(instance_id, parameters, **kwargs)
        return response.text, step, metrics


class Misbehaving:
    """One tool, several ways to fail, chosen by the `how` argument; its release fails too (after noting the id)."""
    let_go = False
    releases: list = []

    def __init__(self, config: dict, tool_schema):
        self.tool_schema = tool_schema

    async def create(self, instance_id=None, **kwargs):
        return instance_id or str(uuid4()), None

    async def execute(self, instance_id, parameters, **kwargs):
        how = parameters["how"]
        if how == "sleep":
            await asyncio.sleep(5)
        if how == "ignore_cancel":
            for _ in range(400):  # until the test lets it go (20 s at most)
                if Misbehaving.let_go:
                    break
                try:
                    await asyncio.sleep(0.05)
                except asyncio.CancelledError:
                    pass
        if how == "raise":
            raise RuntimeError("boom")
        if how == "exit":
            raise SystemExit(3)
        if how == "garbage":
            return 42
        if how == "bad_reward":
            return "ok", "not a number", {}
        if how == "huge":
            return "x" * (10 << 20), 0.0, {}
        if how == "image":
            return SimpleNamespace(text="a picture", image=["<PIL image>"], video=None), 0.0, {}
        return "fine", None, None  # no step reward, no metrics (verl's sandbox tool answers so)

    async def calc_reward(self, instance_id, **kwargs):
        raise ValueError("no reward today")

    async def release(self, instance_id, **kwargs):
        Misbehaving.releases.append(instance_id)
        raise ValueError("no release today")


def _write_tools(tmp_path, entries: list[dict]) -> str:
    import yaml

    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": entries}))
    return str(path)


def _runner(tools, timeout_s=30.0, max_parallel_calls=8, length=100_000, side="middle") -> ToolRunner:
    return ToolRunner(tools, max_parallel_calls=max_parallel_calls, max_tool_response_length=length,
                      tool_response_truncate_side=side, timeout_s=timeout_s)


def _gsm8k_tools(tmp_path, **config) -> dict:
    return load_tools(_write_tools(tmp_path, [
        {"class_name": f"{HERE}.VerlGsm8kStyleTool", "config": {"type": "native", **config},
         "tool_schema": _schema("gsm8k")},
        {"class_name": f"{HERE}.PlainCreateKwargsTool", "config": {"type": "native"}, "tool_schema": _schema("plain")},
        {"class_name": "tripod.engine.agent.builtin_tools.CalculatorTool", "config": {"type": "native"}},
    ]))


# a row of verl's gsm8k_multiturn_w_tool.py: tools_kwargs.{tool}.create_kwargs.ground_truth
ROW = {"gsm8k": {"create_kwargs": {"ground_truth": "72"}, "execute_kwargs": {"scale": 2}},
       "plain": {"create_kwargs": {"ground_truth": "5"}}}


def test_verl_written_tool_classes_and_the_calculator_run_with_verls_per_call_lifecycle(tmp_path):
    tools = _gsm8k_tools(tmp_path)
    assert list(tools) == ["gsm8k", "plain", "calculator"]
    assert [s["function"]["name"] for s in tool_schemas(tools)] == ["gsm8k", "plain", "calculator"]
    assert tool_schemas(tools)[0] == _schema("gsm8k")
    runner = _runner(tools)
    created, released, scored = len(VerlGsm8kStyleTool.created), len(VerlGsm8kStyleTool.released), \
        VerlGsm8kStyleTool.scored
    data = AgentData(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                     request_id="req-7", tools_kwargs=ROW)

    async def episode():
        await runner.start("row0", ROW)
        first = await runner.call("row0", [ToolCall("gsm8k", {"answer": "71"}), ToolCall("plain", {"answer": "5"}),
                                           ToolCall("calculator", {"expression": "(12 + 30) * 7 / 3"})],
                                  agent_data=data)
        second = await runner.call("row0", [ToolCall("gsm8k", {"answer": "72"})])  # no agent_data: the runner's
        return first, second, await runner.finish_scores("row0")

    first, second, scores = asyncio.run(episode())
    assert [r.error for r in first + second] == [None] * 4
    assert first[0].text == "Current parsed answer='71' reward=0.0 messages=2" and first[0].reward == -0.05
    assert first[0].metrics == {"scale": 2, "request": "req-7"}  # execute_kwargs and agent_data reached execute
    assert first[1].text == "Current parsed answer='5' reward=1.0 messages=2" and first[2].text == "98"
    # a fresh instance per call: the second call does not see the first's state (its reward "rises" from 0 again)
    assert second[0].reward == 0.0 and second[0].metrics["request"] == "row0"
    new_created = VerlGsm8kStyleTool.created[created:]
    assert len(new_created) == 2 and len(set(new_created)) == 2  # gsm8k's two calls (plain's create is its own)
    now_released = VerlGsm8kStyleTool.released[released:]
    assert len(now_released) == 3 and set(new_created) <= set(now_released)  # every call released its instance
    assert scores == {} and VerlGsm8kStyleTool.scored == scored  # verl 0.9.1 never calls calc_reward


class TrajectoryTool(VerlGsm8kStyleTool):
    """Opts into tripod's per-trajectory lifecycle with a class attribute."""
    lifecycle = "trajectory"


@pytest.mark.parametrize("how", ["config", "attribute"])
def test_a_tool_may_opt_into_one_instance_per_trajectory_with_calc_reward_at_the_end(tmp_path, how):
    if how == "config":
        tools = _gsm8k_tools(tmp_path, lifecycle="trajectory")
    else:
        tools = load_tools(_write_tools(tmp_path, [{"class_name": f"{HERE}.TrajectoryTool", "config": {},
                                                    "tool_schema": _schema("gsm8k")}]))
    runner = _runner(tools)
    created, scored = len(VerlGsm8kStyleTool.created), VerlGsm8kStyleTool.scored

    async def episode():
        await asyncio.gather(runner.start("a", ROW), runner.start("b", {"gsm8k": {"create_kwargs": {"ground_truth": "1"}}}))
        first = await runner.call("a", [ToolCall("gsm8k", {"answer": "71"})])
        second = await runner.call("a", [ToolCall("gsm8k", {"answer": "72"})])
        return first + second, await runner.finish_scores("a"), await runner.finish_scores("b")

    results, scores_a, scores_b = asyncio.run(episode())
    assert VerlGsm8kStyleTool.created[created:] == ["a", "b"]  # at start, one per row, the row key as its id
    assert [r.reward for r in results] == [-0.05, 0.0]  # the second call saw the first's state: 0 -> 1 is a rise
    assert scores_a == {"gsm8k": 1.0} and scores_b == {"gsm8k": 0.0}
    assert VerlGsm8kStyleTool.scored == scored + 2 and {"a", "b"} <= set(VerlGsm8kStyleTool.released)


@pytest.mark.timeout(120)
def test_failing_tools_give_error_results_and_the_runner_goes_on(tmp_path):
    path = _write_tools(tmp_path, [
        {"class_name": f"{HERE}.Misbehaving", "config": {}, "tool_schema": _schema("bad", "how")},
        {"class_name": "tripod.engine.agent.builtin_tools.CalculatorTool", "config": {}}])
    runner = _runner(load_tools(path), timeout_s=0.5, length=1000, max_parallel_calls=16)
    hows = ["sleep", "ignore_cancel", "raise", "exit", "garbage", "bad_reward", "huge", "image", "no_reward"]

    async def episode():
        await runner.start("r", {})
        began = time.monotonic()
        results = await runner.call("r", [ToolCall("bad", {"how": h}) for h in hows] + [ToolCall("nope", {}),
                                          ToolCall("calculator", {"expression": "__import__('os')"})])
        took = time.monotonic() - began
        Misbehaving.let_go = True
        after = await runner.call("r", [ToolCall("calculator", {"expression": "2**10"})])
        return results, took, after, await runner.finish_scores("r")

    released = len(Misbehaving.releases)
    results, took, after, scores = asyncio.run(episode())
    by = dict(zip(hows + ["unknown", "calc"], results))
    assert took < 4.0, took  # the sleeping and the cancellation-ignoring calls were cut at 0.5 s, concurrently
    for how in ("sleep", "ignore_cancel"):
        assert by[how].timed_out and "timed out after 0.5 s" in by[how].error, by[how]
        assert by[how].text == "Error executing tool 'bad': timed out after 0.5 s"
    # the text is the tool message verbatim, in verl 0.9.1's words; the error says which step failed and how
    assert by["raise"].text == "Error executing tool 'bad': boom" and "execute: RuntimeError: boom" in by["raise"].error
    assert "sys.exit(3)" in by["exit"].error and by["exit"].text.startswith("Error executing tool 'bad': ")
    assert "not (response, reward, metrics)" in by["garbage"].error and "not a finite number" in by["bad_reward"].error
    assert "text-only" in by["image"].error
    assert by["unknown"].text == "Unknown function 'nope'. Available tools: ['bad', 'calculator']"
    assert by["calc"].text.startswith("Error: unsupported syntax") and "unsupported syntax" in by["calc"].error
    assert by["huge"].error is None and len(by["huge"].text) == 1000 + len("...(truncated)...")
    assert by["no_reward"].text == "fine" and by["no_reward"].reward is None and by["no_reward"].error is None
    assert all(r.error is not None for n, r in by.items() if n not in ("huge", "no_reward"))
    assert all(r.reward == 0.0 for n, r in by.items() if r.error is not None)  # verl: a failed call's reward is 0
    assert not any(r.timed_out for n, r in by.items() if n not in ("sleep", "ignore_cancel"))
    assert after[0].text == "1024" and after[0].error is None
    # every call of `bad` released its instance (the timed-out ones too); the failed releases are counted, not shown
    assert len(Misbehaving.releases) - released == len(hows) == runner.error_count and scores == {}
    assert all(e.endswith("ValueError: no release today") for e in runner.recent_errors)


def test_truncation_is_verls_in_characters():
    text = "abcdefghij"
    assert truncate(text, 4, "left") == "(truncated)...ghij"  # verl 0.9.1: `left` cuts the left side
    assert truncate(text, 4, "right") == "abcd...(truncated)"
    assert truncate(text, 4, "middle") == "ab...(truncated)...ij"
    assert truncate(text, 10, "middle") == text
    with pytest.raises(ValueError, match="tool_response_truncate_side='top' must be one of left, right, middle"):
        _runner({}, side="top")


class CountsConcurrency:
    """Each call waits until `want` calls are inside execute at once (proves they run concurrently)."""
    inside = 0
    peak = 0

    def __init__(self, config, tool_schema):
        self.tool_schema, self.want = tool_schema, config["want"]

    async def create(self, instance_id=None, **kwargs):
        return instance_id or str(uuid4()), ""

    async def execute(self, instance_id, parameters, **kwargs):
        cls = CountsConcurrency
        cls.inside += 1
        cls.peak = max(cls.peak, cls.inside)
        for _ in range(200):
            if cls.peak >= self.want:
                break
            await asyncio.sleep(0.005)
        cls.inside -= 1
        return f"call {parameters['answer']}", 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        return None


def test_max_parallel_calls_runs_that_many_concurrently_and_drops_the_rest(tmp_path):
    path = _write_tools(tmp_path, [{"class_name": f"{HERE}.CountsConcurrency", "config": {"want": 3},
                                    "tool_schema": _schema("count")}])
    runner = _runner(load_tools(path), max_parallel_calls=3)
    CountsConcurrency.peak = 0

    async def episode():
        await runner.start("r", {})
        return await runner.call("r", [ToolCall("count", {"answer": str(i)}) for i in range(5)])

    results = asyncio.run(episode())
    assert [r.text for r in results] == ["call 0", "call 1", "call 2"]  # verl: calls past the limit are dropped
    assert CountsConcurrency.peak == 3


def test_max_concurrency_caps_a_tools_executes_over_all_rows(tmp_path):
    """Four rows call at once; each call waits (up to 1 s) for a third to be inside with it, which the cap of 2 never
    lets happen. Waiting for the cap is not part of the 1.5 s time-out."""
    path = _write_tools(tmp_path, [{"class_name": f"{HERE}.CountsConcurrency", "config": {"want": 3,
                                                                                          "max_concurrency": 2},
                                    "tool_schema": _schema("count")}])
    runner = _runner(load_tools(path), timeout_s=1.5)
    CountsConcurrency.peak = 0

    async def episode():
        return await asyncio.gather(*(runner.call(f"r{i}", [ToolCall("count", {"answer": str(i)})]) for i in range(4)))

    results = asyncio.run(episode())
    assert [r[0].text for r in results] == [f"call {i}" for i in range(4)] and CountsConcurrency.peak == 2


def test_lifecycle_failures_are_counted_and_only_the_last_few_kept(tmp_path):
    runner = _runner(load_tools(_write_tools(tmp_path, [{"class_name": f"{HERE}.Misbehaving", "config": {},
                                                         "tool_schema": _schema("bad", "how")}])),
                     max_parallel_calls=30)

    async def episode():
        return await runner.call("r", [ToolCall("bad", {"how": "fine"}) for _ in range(25)])

    results = asyncio.run(episode())
    assert [r.text for r in results] == ["fine"] * 25 and all(r.error is None for r in results)
    assert runner.error_count == 25 and len(runner.recent_errors) == 20  # a failed release is not the call's error


@pytest.mark.parametrize("config, expected", [
    ({"lifecycle": "episode"}, "tool 'count': lifecycle='episode' must be one of call, trajectory"),
    ({"max_concurrency": 0}, "tool 'count': max_concurrency=0 must be a positive integer"),
])
def test_a_bad_lifecycle_or_max_concurrency_is_one_line(tmp_path, config, expected):
    tools = load_tools(_write_tools(tmp_path, [{"class_name": f"{HERE}.CountsConcurrency",
                                                "config": {"want": 1, **config}, "tool_schema": _schema("count")}]))
    with pytest.raises(ValueError) as info:
        _runner(tools)
    assert str(info.value) == expected


@pytest.mark.parametrize("entry, expected", [
    ({"class_name": "no_such_package.tools.Calc", "tool_schema": _schema("x")},
     r"tools\[0\]\.class_name 'no_such_package\.tools\.Calc': cannot import module 'no_such_package\.tools' "
     r"\(ModuleNotFoundError: No module named 'no_such_package'\); fix the name or put the module on PYTHONPATH"),
    ({"class_name": "tripod.engine.agent.builtin_tools.NoSuchTool"},
     r"tools\[0\]\.class_name .*: module 'tripod\.engine\.agent\.builtin_tools' has no class 'NoSuchTool'"),
    ({"class_name": "tripod.engine.agent.builtin_tools.CalculatorTool", "tool_schema": {"name": "calculator"}},
     r"tools\[0\]\.tool_schema is not an OpenAI function schema \(type: Field required\); write \{type: function"),
    ({"class_name": "tripod.engine.agent.builtin_tools.CalculatorTool",
      "tool_schema": {"type": "function", "function": {"name": "calculator", "parameters": {}}}},
     r"tools\[0\]\.tool_schema is not an OpenAI function schema \(function\.description: Field required\)"),
    ({"class_name": "tripod.engine.agent.builtin_tools.CalculatorTool",
      "tool_schema": {**_schema("c"), "type": "retrieval"}},
     r"tools\[0\]\.tool_schema is not an OpenAI function schema \(type must be 'function'"),
    ({"class_name": "tripod.engine.agent.builtin_tools.CalculatorTool", "config": {"type": "mcp"}},
     r"tools\[0\]\.config\.type 'mcp': only 'native' tools are supported"),
])
def test_a_bad_tool_config_is_one_line_naming_the_file_and_entry(tmp_path, entry, expected):
    path = _write_tools(tmp_path, [entry])
    with pytest.raises(ValueError) as info:
        load_tools(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    assert __import__("re").search(expected, message), message


def test_rows_tools_kwargs_and_interaction_kwargs_are_checked_before_any_model():
    tools, interactions = {"calculator": object(), "gsm8k": object()}, {"gsm8k": object()}
    good = {"tools_kwargs": {"gsm8k": {"create_kwargs": {"ground_truth": "3"}}, "calculator": None},
            "interaction_kwargs": {"name": "gsm8k", "ground_truth": "3"}}
    validate_agent_inputs(tools, interactions, [good, good])  # a tool absent from a parquet struct reads as None
    validate_agent_inputs(tools, {}, [{"tools_kwargs": {}}, None, {}, {"tool_selection": ["gsm8k"]},
                                      {"tool_selection": None}])
    bad = {"tools_kwargs": {"search": {"create_kwargs": {}}}, "interaction_kwargs": {"name": "gsm8k"}}
    cases = [
        ([good, bad, bad], interactions, "row 1: extra_info.tools_kwargs names tool 'search', which "
         "tool_config_path does not define (tools: calculator, gsm8k); fix the row or add the tool (1 more rows "
         "have problems)"),
        ([{"tools_kwargs": {"gsm8k": {"create_kwarg": {}}}}], {}, "row 0: extra_info.tools_kwargs.gsm8k has unknown "
         "keys ['create_kwarg']; allowed: ('create_kwargs', 'execute_kwargs', 'calc_reward_kwargs', 'release_kwargs')"),
        ([{"tools_kwargs": {"gsm8k": {"create_kwargs": {"instance_id": "x"}}}}], {},
         "row 0: extra_info.tools_kwargs.gsm8k.create_kwargs may not use the names ['instance_id']"),
        ([{"tools_kwargs": {"gsm8k": {"execute_kwargs": {"agent_data": "x"}}}}], {},
         "row 0: extra_info.tools_kwargs.gsm8k.execute_kwargs may not use the names ['agent_data']"),
        ([{"tool_selection": ["calculator", "search"]}], {}, "row 0: extra_info.tool_selection names ['search'], "
         "which the tool files do not define (tools: calculator, gsm8k)"),
        ([{"tool_selection": "calculator"}], {}, "row 0: extra_info.tool_selection must be a list of tool names"),
        ([{"tools_kwargs": {}}], interactions, "row 0: extra_info.interaction_kwargs.name is required with "
         "interaction_config_path (one of ['gsm8k'])"),
        ([{"interaction_kwargs": {"name": "weather"}}], interactions, "row 0: extra_info.interaction_kwargs.name "
         "'weather' is not in interaction_config_path (interactions: ['gsm8k'])"),
    ]
    for rows, inter, expected in cases:
        with pytest.raises(ValueError) as info:
            validate_agent_inputs(tools, inter, rows)
        assert str(info.value) == expected


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert evaluate("(12 + 30) * 7 / 3") == 98.0 and evaluate("-2**3 + 7 // 2 % 4") == -5
    assert evaluate("sqrt(16) + max(1, 2) + round(2.6)") == 9.0
    for bad, reason in [("__import__('os').system('true')", "unsupported syntax"), ("9**9**9", "result too large"),
                        ("1/0", "division by zero"), ("'a' * 3", "only numbers"), ("2 +", "not an arithmetic"),
                        ("().__class__", "unsupported syntax")]:
        with pytest.raises(ValueError, match=reason):
            evaluate(bad)


def test_the_shipped_tool_and_interaction_configs_load(tool_configs_load):
    from tripod.engine.agent import load_interactions
    from tripod.engine.agent.builtin_tools import CalculatorTool

    configs = REPO_ROOT / "src" / "tripod" / "engine" / "agent" / "configs"
    calculator = load_tools(str(configs / "calculator_tool.yaml"))
    both = load_tools(str(configs / "calculator_and_python_tools.yaml"))
    assert list(calculator) == ["calculator"] and list(both) == ["calculator", "code_interpreter"]
    default = CalculatorTool({}, None).get_openai_tool_schema().model_dump(exclude_unset=True, exclude_none=True)
    assert tool_schemas(calculator) == [default]  # the YAML spells out the class's own schema
    assert both["code_interpreter"].wall_s == 10 and both["code_interpreter"].memory_mb == 1024
    assert list(load_interactions(str(configs / "gsm8k_interaction.yaml"))) == ["gsm8k"]
