"""The per-row agent loop (engine/agent/scheduler.py): while some rows wait for a slow interaction or tool, the
others run their turns (checked on the turns' clocks), and the trajectories are those of the lockstep loop and of
plain generate calls with each row's seed (the embedded engine's running batch, engine/rollout/running_batch.py,
against its `generate`). Plants: the lockstep rule in per_row mode fails the ordering; a position off by one in the
running batch fails the equality."""
from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.agent import ScriptedEngine, ToyAdd, chatml_tokenizer
from tripod.engine.agent import ToolRunner
from tripod.engine.agent.chat_suffix import ChatSuffix
from tripod.engine.agent.loop import AgentLoop
from tripod.engine.rollout.base import SamplingParams

SLOW_S = 0.4


class SlowForSome:
    """An interaction that answers "again" three times, after SLOW_S seconds for rows whose kwargs say slow."""

    def __init__(self) -> None:
        self.slow: dict[str, bool] = {}

    async def start(self, key, kwargs):
        self.slow[key] = bool(kwargs.get("slow"))

    async def respond(self, key, messages):
        if self.slow[key]:
            await asyncio.sleep(SLOW_S)
        return sum(m["role"] == "user" for m in messages) >= 3, "again", 0.0, {}

    async def finish(self, key):
        return 0.0


@pytest.fixture(scope="module")
def embedded():
    from safetensors.torch import load_file

    from tripod.engine.data.tiny_models import make_tiny_hf_model
    from tripod.engine.rollout import make_rollout_engine
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import family_of, hf_to_megatron

    torch.set_num_threads(1)
    tok = chatml_tokenizer()
    import tempfile

    hf_dir = make_tiny_hf_model(tempfile.mkdtemp(), "qwen2", seed=4, vocab_size=len(tok),
                                eos_token_id=tok.eos_token_id)
    arch = arch_from_hf(hf_dir)
    canon = hf_to_megatron(arch, load_file(os.path.join(hf_dir, "model.safetensors")))
    engine = make_rollout_engine("embedded", arch, None, pad_token_id=0)
    engine.load_weights({n: family_of(arch).shard(arch, n, t, 1, 0) for n, t in canon.items()})
    return tok, engine


def run_talks(tok, engine, scheduling):
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False)
               for q in ("slow one", "fast", "fast too")]
    # every ninth id ends a turn: the random model's turns stay short
    params = SamplingParams(max_new_tokens=300, temperature=1.0, seed=7,
                            stop_token_ids=tuple(range(3, len(tok), 9)))
    infos = [{"interaction_kwargs": {"name": "slow", "slow": i == 0}} for i in range(3)]
    loop = AgentLoop(tok, 300, ChatSuffix(tok), None, SlowForSome(), scheduling=scheduling)
    rows, stats = loop.run(engine, prompts, 2, params, infos)
    return rows, stats


def test_rows_run_their_turns_while_others_wait_and_match_lockstep(embedded):
    tok, engine = embedded
    per_row, stats = run_talks(tok, engine, "per_row")
    lockstep, _ = run_talks(tok, engine, "lockstep")
    plain, _ = run_talks(tok, SimpleNamespace(generate=engine.generate), "per_row")  # one generate call per batch
    # 4 model turns, 3 replies and the final one (appended, as verl does)
    assert all(len(t.turns) == 8 and t.turns[-1]["role"] == "user" for t in per_row), [len(t.turns) for t in per_row]
    slow, fast = per_row[:2], per_row[2:]
    # per row: the fast rows are done before a slow row's second turn is even asked for
    assert max(t.turn_times[-1][1] for t in fast) < min(t.turn_times[1][0] for t in slow)
    # lockstep: every row's second turn waits for the slow replies
    assert min(t.turn_times[1][1] for t in lockstep[2:]) >= max(t.turn_times[0][1] for t in lockstep[:2]) + SLOW_S
    for a, b, c in zip(per_row, lockstep, plain):
        assert a.response == b.response == c.response and a.codes == b.codes == c.codes
        torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(c.log_probs), atol=1e-5, rtol=0)
    assert 0 < stats["generate_s"] < stats["wall_s"]


def test_tool_rows_do_not_hold_up_the_others_through_generate_calls():
    """The call path (vLLM, SGLang): a scripted engine; every row calls a tool twice, the first row's tool is slow."""
    from tripod.engine.agent.hermes import format_tool_call

    tok = chatml_tokenizer()

    class Engine(ScriptedEngine):
        def answer(self, prompt_len, seq):
            turns = self.turns(prompt_len, seq)
            tool = "slow_add" if "slow" in self.tok.decode(seq[:prompt_len]) else "add"
            text = format_tool_call(tool, {"a": turns, "b": 1}) if turns < 2 else "#### 5"
            return [self.tok.convert_tokens_to_ids(c) for c in text] + [self.end]

    def run(scheduling):
        runner = ToolRunner({"add": ToyAdd({}), "slow_add": ToyAdd({"delay": SLOW_S})}, max_parallel_calls=1,
                            max_tool_response_length=256, tool_response_truncate_side="middle", timeout_s=10)
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                      tokenize=False), add_special_tokens=False)
                   for q in ("slow", "fast", "fast", "fast")]
        engine = Engine(tok)
        rows, _ = AgentLoop(tok, 600, ChatSuffix(tok), runner, scheduling=scheduling).run(
            engine, prompts, 1, SamplingParams(max_new_tokens=600))
        assert [t.tool_calls for t in rows] == [2, 2, 2, 2]
        return rows

    rows = run("per_row")
    assert max(t.turn_times[-1][1] for t in rows[1:]) < rows[0].turn_times[1][0]
    rows = run("lockstep")
    assert min(t.turn_times[1][1] for t in rows[1:]) >= rows[0].turn_times[0][1] + SLOW_S
