"""A 2-step `tripod train` run whose tools are written against verl 0.9.1 itself (tests/data/verl_tools/): a
`BaseTool` subclass of verl's answering with verl's `ToolResponse` and a None step reward, and functions decorated
with verl's `@function_tool` (multi_turn.function_tool_path). A tiny random model never writes a hermes call by
itself: the tokenizer has extra tokens, each a whole call of one of those tools (as tests/multiprocess/test_matrix.py
does with the calculator). The dumped rollouts show the tools ran as verl runs them: the counting tool's answers (it
reports its call number, how many of its instances are open, the conversation's length and the row's create_kwargs)
carry the row's ground truth from tools_kwargs and the conversation through agent_data; the function tools' answers
are their return values; no tool call failed. (The lifecycle counts themselves: tests/unit/test_verl_tools.py.)"""
from __future__ import annotations

import json
import os
import re

from tests.helpers.common import REPO_ROOT
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import metrics, train

VERL_TOOLS = os.path.join(REPO_ROOT, "tests", "data", "verl_tools")
REVERSED = ["tripod", "verl", "gloo", "megatron", "rollout", "critic", "actor", "reward", "token", "loss", "mask",
            "shard"]
STOP_IDS = list(range(40, 66))  # a fifth of the vocabulary ends a model turn: a random model's turns stay short


def calling_tokenizer():
    from tripod.engine.agent.hermes import format_tool_call
    from tripod.engine.data.char_tokenizer import char_tokenizer

    tok = char_tokenizer()
    words = ["banana", "area", "sky", "data", "apple", "grape", "oak", "gala", "java", "tea", "moss", "papaya"]
    tok.add_tokens([format_tool_call("count_letters", {"word": w, "letter": "a"}) for w in words]
                   + [format_tool_call("reverse_word", {"word": w}) for w in REVERSED])
    return tok


def test_verl_tools_through_a_training_run(tmp_path):
    import pyarrow.parquet as pq

    from tripod.engine.data import write_prompt_parquet

    setup = make_ppo_setup(tmp_path)
    calling_tokenizer().save_pretrained(setup["model"])
    rows = pq.read_table(setup["train"]).to_pylist()
    for row in rows:
        row["extra_info"]["tools_kwargs"] = {
            "count_letters": {"create_kwargs": {"ground_truth": row["reward_model"]["ground_truth"]}}}
    write_prompt_parquet(rows, setup["train"])
    run_dir = str(tmp_path / "run")
    args = tiny_overrides(setup, run_dir, steps=2) + [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "data.max_response_length=200",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={VERL_TOOLS}/tools.yaml",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={VERL_TOOLS}/function_tools.py",
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=4",
        f"actor_rollout_ref.rollout.stop_token_ids=[{','.join(map(str, STOP_IDS))}]",
        f"trainer.rollout_data_dir={run_dir}/dump", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.logger=[jsonl]"]
    proc = train(args, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    steps = metrics(run_dir)
    assert len(steps) == 2 and all(m["tool/errors"] == 0 for m in steps), steps
    assert sum(m["tool/calls_mean"] for m in steps) > 0
    tool_turns = []
    for step in (1, 2):
        with open(os.path.join(run_dir, "dump", f"{step}.jsonl")) as f:
            for line in f:
                row = json.loads(line)
                tool_turns += [(row, t["text"]) for t in row["turns"] if t["role"] == "tool"]
                assert all(t["trained"] == (t["role"] == "assistant") for t in row["turns"])
    # the dump's text is the character tokenizer's decode, which drops spaces
    answer = re.compile(r"(\d+) ?\(call ?(\d+), ?open ?(\d+), ?messages ?(\d+), ?request ?[^,]+, ?truth ?([^)\s]+)\)")
    counted = [(row, m) for row, text in tool_turns for m in answer.finditer(text)]
    reversed_ = [text for _, text in tool_turns if any(w[::-1] in text for w in REVERSED)]
    assert counted and reversed_, [text for _, text in tool_turns][:6]
    for row, m in counted:
        assert int(m.group(3)) >= 1 and int(m.group(4)) >= 2  # its own instance open; the prompt and the call seen
        assert m.group(5) == row["gts"], (m.group(5), row["gts"])  # create_kwargs from the row's tools_kwargs
    # every answer is its own call (a call whose turn found no room in the budget is not in the dump)
    calls = [int(m.group(2)) for _, m in counted]
    assert len(set(calls)) == len(calls), calls
    print(f"tool turns: {len(tool_turns)}, counting-tool calls: {len(counted)}, function-tool calls: {len(reversed_)}")
