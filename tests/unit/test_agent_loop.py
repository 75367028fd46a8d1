"""The agent loop (engine/agent/loop.py) on a scripted engine and a deterministic tool: token identity (the ids a
trajectory holds where the model wrote are the engine's, position for position, with its log-probs), the tool turns
are the chat template's suffix, budgets and turn limits, concurrent tool calls, and the hermes parser. A planted
decode-and-re-encode of the trajectory fails the identity check, and so does a turn cut before its stop token (each
model segment must be the engine's whole output, ending on a stop id where a tool or user turn follows)."""
from __future__ import annotations

import asyncio
import time

import pytest

from tests.helpers.agent import Replies, ScriptedEngine, ToyAdd, char_ids, chatml_tokenizer, model_segments
from tripod.engine.agent import ToolRunner
from tripod.engine.agent.chat_suffix import ChatSuffix
from tripod.engine.agent.hermes import ParsedCall, format_tool_call, parse_tool_calls
from tripod.engine.agent.loop import MODEL, TOOL, USER, AgentLoop
from tripod.engine.rollout.base import FINISH_LENGTH, SamplingParams


def make_loop(tok, *, delay=0.0, response_length=200, runner=True, **limits):
    tools = {"add": ToyAdd({"delay": delay, "lifecycle": "trajectory"})}  # calc_reward at the end: opted in
    run = ToolRunner(tools, max_parallel_calls=1, max_tool_response_length=256, tool_response_truncate_side="middle",
                     timeout_s=10) if runner else None
    return AgentLoop(tok, response_length, ChatSuffix(tok), run, **limits)


def prompts_of(tok, questions):
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False) for q in questions]


def check_identity(prompts, n, trajectories, engine_log, budget: int, stop_ids: set[int]):
    """Every model segment of every trajectory is the engine's whole output for exactly the tokens before it, with the
    engine's log-probs; shorter only as the row's last segment, ending at the response budget (`budget`: the loop's
    cut), and every segment a tool or user turn follows ends on a stop id. (A prefix check passes a turn whose last
    token was dropped.)"""
    outputs = {}
    for call in engine_log:
        for p, r, lp in zip(call["prompts"], call["responses"], call["log_probs"]):
            outputs[tuple(p)] = (r, lp)
    for row, t in enumerate(trajectories):
        seq = prompts[row // n] + t.response
        segments = model_segments(t.codes)
        assert segments, f"row {row} has no model tokens"
        for k, (s, e) in enumerate(segments):
            at = len(prompts[row // n])
            key = tuple(seq[: at + s])
            assert key in outputs, f"row {row}: the tokens before position {s} were never an engine input"
            r, lp = outputs[key]
            cut = k == len(segments) - 1 and e == budget and e - s < len(r)
            whole = r[: e - s] if cut else r
            assert t.response[s:e] == whole, \
                f"row {row} positions {s}..{e}: trained ids are not the engine's whole output ({len(r)} ids, " \
                f"{e - s} trained, budget {budget})"
            assert t.log_probs[s:e] == lp[: len(whole)], f"row {row} positions {s}..{e}: log-probs are not the engine's"
            if k < len(segments) - 1:
                assert t.response[e - 1] in stop_ids, \
                    f"row {row} positions {s}..{e}: a model turn before a tool / user turn ends on a non-stop id"


def test_trajectory_is_the_engines_tokens_then_the_templates_suffix():
    tok = chatml_tokenizer()
    engine, loop = ScriptedEngine(tok, calls_per_row=2), make_loop(tok)
    prompts = prompts_of(tok, ["2+3?", "what is 2+3?"])
    params = SamplingParams(max_new_tokens=200, n=2, seed=3)
    rows, stats = loop.run(engine, prompts, 2, params)
    check_identity(prompts, 2, rows, engine.log, loop.response_length, {engine.end})
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for t in rows:
        assert [turn["role"] for turn in t.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert sum(turn["n_tokens"] for turn in t.turns) == len(t.response) == len(t.codes) == len(t.log_probs)
        # a tool turn: what follows <|im_end|> in the template, the tool message, the next generation prompt
        tool = [k for k, c in enumerate(t.codes) if c == TOOL]
        first = tool[: t.turns[1]["n_tokens"]]
        assert t.response[first[0] - 1] == end
        assert tok.decode([t.response[k] for k in first]) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
        assert all(t.log_probs[k] == 0.0 for k in tool)
        assert t.tool_calls == 2 and t.tool_errors == 0 and t.reward == 1.0
    assert len(engine.log) == 3  # a turn of every live row is one generate call
    assert [len(c["prompts"]) for c in engine.log] == [4, 4, 4]
    assert stats["turns"] == 4 * 5 and stats["calls"] == 8 and stats["errors"] == 0
    assert 0 < stats["model_tokens"] < stats["tokens"]


def test_a_planted_decode_and_re_encode_fails_the_identity_check():
    tok = chatml_tokenizer()
    engine, loop = ScriptedEngine(tok), make_loop(tok)
    prompts = prompts_of(tok, ["2+3?"])
    rows, _ = loop.run(engine, prompts, 1, SamplingParams(max_new_tokens=200))
    for t in rows:  # the bug: the trajectory re-tokenized from its decoded text ("a", "b" -> "ab")
        text = tok.decode(t.response)
        t.response = list(tok.encode(text, add_special_tokens=False))
    with pytest.raises(AssertionError, match="trained ids are not the engine's"):
        check_identity(prompts, 1, rows, engine.log, loop.response_length, {engine.end})


@pytest.mark.parametrize("where", ["every turn", "the last turn"])
def test_a_turn_cut_before_its_stop_token_fails_the_identity_check(monkeypatch, where):
    """The bug a prefix check passed: the loop drops the last model token of a turn that ends on a stop token (the
    stop token itself). Every turn: the tool turns' template suffix still follows (a trained prefix of the engine's
    output); the last turn only: the row's end, where no suffix shows it."""
    import dataclasses

    from tripod.engine.rollout.base import FINISH_STOP

    model_turn = AgentLoop._model_turn

    def cut(self, r, out, prompt_len, room):
        answer = "####" in self.tokenizer.decode(out.token_ids)  # the scripted row's last turn
        if out.finish == FINISH_STOP and (where == "every turn" or answer):
            out = dataclasses.replace(out, token_ids=out.token_ids[:-1], log_probs=out.log_probs[:-1])
        return model_turn(self, r, out, prompt_len, room)

    monkeypatch.setattr(AgentLoop, "_model_turn", cut)
    tok = chatml_tokenizer()
    engine, loop = ScriptedEngine(tok), make_loop(tok)
    prompts = prompts_of(tok, ["2+3?"])
    rows, _ = loop.run(engine, prompts, 1, SamplingParams(max_new_tokens=200))
    with pytest.raises(AssertionError, match="trained ids are not the engine's whole output"):
        check_identity(prompts, 1, rows, engine.log, loop.response_length, {engine.end})


def test_the_response_budget_spans_every_turn_and_ends_on_model_tokens():
    tok = chatml_tokenizer()
    engine = ScriptedEngine(tok, calls_per_row=5)
    prompts = prompts_of(tok, ["2+3?"])
    full, _ = make_loop(tok).run(engine, prompts, 1, SamplingParams(max_new_tokens=400))
    first_turn = full[0].turns[0]["n_tokens"]
    # room for the first model turn and its tool turn, not for the second model turn's whole answer
    budget = first_turn + full[0].turns[1]["n_tokens"] + 10
    engine = ScriptedEngine(tok, calls_per_row=5)
    rows, _ = make_loop(tok, response_length=budget).run(engine, prompts, 1, SamplingParams(max_new_tokens=400))
    t = rows[0]
    assert len(t.response) == budget and t.finish == FINISH_LENGTH and t.codes[-1] == MODEL
    check_identity(prompts, 1, rows, engine.log, budget, {engine.end})
    # a tool turn that would not leave room for a model token is not appended (verl's rule)
    engine = ScriptedEngine(tok, calls_per_row=5)
    rows, _ = make_loop(tok, response_length=first_turn + full[0].turns[1]["n_tokens"]).run(
        engine, prompts, 1, SamplingParams(max_new_tokens=400))
    assert rows[0].codes == [MODEL] * first_turn and rows[0].done


@pytest.mark.parametrize("limit, turns", [("max_assistant_turns", 2), ("max_user_turns", 1)])
def test_turn_limits(limit, turns):
    tok = chatml_tokenizer()
    engine = ScriptedEngine(tok, calls_per_row=5)
    rows, _ = make_loop(tok, **{limit: turns}).run(engine, prompts_of(tok, ["1+1?"]), 1,
                                                   SamplingParams(max_new_tokens=400))
    assert [turn["role"] for turn in rows[0].turns] == ["assistant", "tool", "assistant"]


def test_rows_waiting_on_tools_run_their_calls_concurrently():
    tok = chatml_tokenizer()
    engine, loop = ScriptedEngine(tok), make_loop(tok, delay=0.5)
    start = time.perf_counter()
    rows, stats = loop.run(engine, prompts_of(tok, ["a?", "b?", "c?", "d?"]), 1,
                           SamplingParams(max_new_tokens=200))
    assert all(t.tool_calls == 1 for t in rows)
    assert stats["tool_s"] < 1.5, f"4 rows' 0.5 s tool calls took {stats['tool_s']:.2f} s: they ran one after another"
    assert time.perf_counter() - start < 5


def test_a_malformed_call_and_an_unknown_tool_give_error_turns():
    tok = chatml_tokenizer()

    class Engine(ScriptedEngine):
        def answer(self, prompt_len, seq):
            turns = self.turns(prompt_len, seq)
            text = ["<tool_call>{not json</tool_call>", format_tool_call("nope", {}), "done"][turns]
            return char_ids(self.tok, text) + [self.end]

    rows, stats = make_loop(tok, response_length=600).run(Engine(tok), prompts_of(tok, ["x"]), 1,
                                                          SamplingParams(max_new_tokens=600))
    t = rows[0]
    assert [turn["role"] for turn in t.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert "Error: the tool call is not JSON" in t.turns[1]["text"] and "Unknown function 'nope'" in t.turns[3]["text"]
    assert t.tool_errors == 2 and stats["errors"] == 2


def test_call_rate_and_parse_fraction_count_rows():
    """tool/call_rate: the share of rows with a tool call (a malformed block counts); tool/parse_frac: of those, the
    share whose every call parsed (what make demo-agent prints)."""
    from tripod.engine.agent.rollout import AgentRollout

    tok = chatml_tokenizer()

    class Engine(ScriptedEngine):
        def answer(self, prompt_len, seq):
            kind = self.tok.decode(seq[:prompt_len]).split("user\n")[-1][:4]
            first = {"good": format_tool_call("add", {"a": 1, "b": 2}), "bad!": "<tool_call>{not json</tool_call>",
                     "both": format_tool_call("add", {"a": 1, "b": 2}) + "<tool_call>[]</tool_call>"}.get(kind)
            return char_ids(self.tok, first if first and self.turns(prompt_len, seq) == 0 else "#### 3") + [self.end]

    loop = make_loop(tok, response_length=600)
    rows, stats = loop.run(Engine(tok), prompts_of(tok, ["good", "bad!", "none", "both"]), 2,
                           SamplingParams(max_new_tokens=600))
    assert [t.tool_parse_errors for t in rows] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert stats["called_rows"] == 6 and stats["parsed_rows"] == 2
    agent = AgentRollout(loop, engine=None, replicas=None, session=None)  # its metrics only
    agent._add(stats)
    m = agent.take_metrics()
    assert m["tool/call_rate"] == 6 / 8 and m["tool/parse_frac"] == 2 / 6, m
    agent._add(loop.run(Engine(tok), prompts_of(tok, ["none"]), 1, SamplingParams(max_new_tokens=600))[1])
    m = agent.take_metrics()
    assert m["tool/call_rate"] == 0 and "tool/parse_frac" not in m  # no row called: nothing to parse


def test_an_interaction_answers_with_a_user_turn_until_it_ends_the_row():
    tok = chatml_tokenizer()

    class Engine(ScriptedEngine):
        def answer(self, prompt_len, seq):
            return char_ids(self.tok, "ab") + [self.end]

    loop = AgentLoop(tok, 200, ChatSuffix(tok), None, Replies(2, "again", score=0.25, final=1.0))
    engine = Engine(tok)
    prompts = prompts_of(tok, ["hi"])
    rows, _ = loop.run(engine, prompts, 1, SamplingParams(max_new_tokens=50),
                       [{"interaction_kwargs": {"name": "again"}}])
    t = rows[0]
    # the reply that ends the conversation is appended too (verl)
    assert [turn["role"] for turn in t.turns] == ["assistant", "user", "assistant", "user", "assistant", "user"]
    assert USER in t.codes and t.reward == 3 * 0.25 + 1.0
    check_identity(prompts, 1, rows, engine.log, loop.response_length, {engine.end})


def test_hermes_parser():
    calls, errors = parse_tool_calls('x <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
                                     '<tool_call>{"name": "f", "arguments": "{\\"b\\": 2}"}</tool_call>'
                                     '<tool_call>[1]</tool_call><tool_call>{"name": "g"')
    assert calls == [ParsedCall("add", {"a": 1}), ParsedCall("f", {"b": 2})]
    assert len(errors) == 2 and "needs" in errors[0] and "not closed" in errors[1]
    assert parse_tool_calls(format_tool_call("add", {"a": 1, "b": 2}))[0] == [ParsedCall("add", {"a": 1, "b": 2})]
    assert asyncio.iscoroutinefunction(ToyAdd.execute)


@pytest.mark.parametrize("reasoning", [False, True])
@pytest.mark.parametrize("kind", ["tool", "user"])
def test_qwen3s_published_template_through_the_loop(kind, reasoning):
    """Qwen3's published template (thinking variant, tests/data/chat_templates) through the whole loop: a tool or a
    user turn after model turns with and without a <think> block never raises, every model segment is the engine's
    output for the tokens before it, and no row ends unrenderable (the old fallback, a minimal assistant turn behind
    which the template still renders differently, raised here and ended the run)."""
    from tests.helpers.agent import QWEN3_TEMPLATE

    tok = chatml_tokenizer(QWEN3_TEMPLATE)

    class Engine(ScriptedEngine):
        def answer(self, prompt_len, seq):
            turns = self.turns(prompt_len, seq)
            body = format_tool_call("add", {"a": turns, "b": 1}) if kind == "tool" and turns < 2 else f"#### {turns}"
            return char_ids(self.tok, ("<think>\nadd\n</think>\n\n" if reasoning else "") + body) + [self.end]

    runner = ToolRunner({"add": ToyAdd({})}, max_parallel_calls=1, max_tool_response_length=256,
                        tool_response_truncate_side="middle", timeout_s=10)
    loop = AgentLoop(tok, 600, ChatSuffix(tok), runner if kind == "tool" else None,
                     Replies(3) if kind == "user" else None)
    engine, prompts = Engine(tok), prompts_of(tok, ["2+3?", "what is 2+3?"])
    infos = [{"interaction_kwargs": {"name": "twice"}}] * 2 if kind == "user" else None
    rows, stats = loop.run(engine, prompts, 1, SamplingParams(max_new_tokens=600), infos)
    check_identity(prompts, 1, rows, engine.log, loop.response_length, {engine.end})
    assert stats["unrenderable"] == 0
    for t in rows:
        assert [turn["role"] for turn in t.turns][:4] == ["assistant", "tool" if kind == "tool" else "user"] * 2
        assert sum(c == MODEL for c in t.codes) == sum(turn["n_tokens"] for turn in t.turns if turn["trained"])


def test_an_unrenderable_turn_ends_its_row_and_the_run_goes_on():
    """A turn the chat template cannot render as a suffix (ChatSuffix gives None) ends that row, counted in
    multi_turn/ended_unrenderable; the other rows and the run go on."""
    from tripod.engine.agent.rollout import AgentRollout

    tok = chatml_tokenizer()

    class PicksOne(ChatSuffix):
        def suffix_ids(self, history, new, end_text):
            return None if "7" in new[0]["content"] else super().suffix_ids(history, new, end_text)

    class Engine(ScriptedEngine):
        def answer(self, prompt_len, seq):  # the "x" row adds 2 + 5 = 7: its tool turn cannot be rendered
            first = self.turns(prompt_len, seq) == 0
            k = 5 if self.tok.decode(seq[:prompt_len]).endswith("x<|im_end|>\n<|im_start|>assistant\n") else 1
            return char_ids(self.tok, format_tool_call("add", {"a": 2, "b": k}) if first else "#### 3") + [self.end]

    runner = ToolRunner({"add": ToyAdd({})}, max_parallel_calls=1, max_tool_response_length=256,
                        tool_response_truncate_side="middle", timeout_s=10)
    loop = AgentLoop(tok, 600, PicksOne(tok), runner)
    rows, stats = loop.run(Engine(tok), prompts_of(tok, ["x", "y"]), 2, SamplingParams(max_new_tokens=600))
    assert [t.unrenderable for t in rows] == [True, True, False, False]
    assert [len(t.turns) for t in rows] == [1, 1, 3, 3] and stats["unrenderable"] == 2
    agent = AgentRollout(loop, engine=None, replicas=None, session=None)
    agent._add(stats)
    assert agent.take_metrics()["multi_turn/ended_unrenderable"] == 2
