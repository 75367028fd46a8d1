"""Multi-turn rewards (engine/agent/rewards.py): the reward function sees the whole trajectory (its decoded turns,
the messages and verl's tool_rewards / turn_scores / rollout_reward_scores / num_turns in extra_info), and with
multi_turn.add_rollout_rewards the trained score is the rule reward plus the tool rewards, added exactly once.
Planted by hand: not adding them (score 1.0) and adding them twice (4.0) both fail the equality."""
from __future__ import annotations

import torch.distributed as dist

from tests.helpers.agent import ScriptedEngine, ToyAdd, chatml_tokenizer
from tripod.engine.agent import ToolRunner
from tripod.engine.agent.chat_suffix import ChatSuffix
from tripod.engine.agent.loop import AgentLoop
from tripod.engine.agent.rewards import reward_fields, rollout_reward
from tripod.engine.data.dataset import PromptBatch
from tripod.engine.rewards import RewardPool, register_reward
from tripod.engine.rewards.scorer import RowScorer
from tripod.engine.rollout.base import SamplingParams
from tripod.engine.rollout.generators import RolloutReplicas
from tripod.engine.rollout.rows import Rollout

SEEN: list[dict] = []


@register_reward("test_agent_rewards")
def exact_answer(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """1.0 when the last model turn ends with '#### <ground truth>'; records what it was given."""
    SEEN.append({"solution": solution_str, **(extra_info or {})})
    return 1.0 if solution_str.rstrip().endswith(f"#### {ground_truth}") else 0.0


class StepAdd(ToyAdd):
    """ToyAdd whose every call also gives a step reward of 0.5 (its calc_reward stays 1.0 once called)."""

    async def execute(self, instance_id, parameters, **kwargs):
        response, _, metrics = await super().execute(instance_id, parameters, **kwargs)
        return response, 0.5, metrics


def run_rows(tok, n=2):
    runner = ToolRunner({"add": StepAdd({"lifecycle": "trajectory"})}, max_parallel_calls=1, max_tool_response_length=256,
                        tool_response_truncate_side="middle", timeout_s=10)
    loop = AgentLoop(tok, 300, ChatSuffix(tok), runner)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "2+3?"}], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)
    rows, _ = loop.run(ScriptedEngine(tok, calls_per_row=1), [prompt], n, SamplingParams(max_new_tokens=300),
                       [{"split": "test"}])
    return prompt, rows


def test_fields_are_verls_and_sum_to_the_trajectory_reward():
    tok = chatml_tokenizer()
    _, rows = run_rows(tok, n=1)
    f = reward_fields(rows[0])
    assert f["tool_rewards"] == [0.5] and f["turn_scores"] == [] and f["rollout_reward_scores"] == {"add": 1.0}
    assert f["num_turns"] == 4  # assistant, tool, assistant, plus one (verl's count)
    assert [m["role"] for m in f["messages"]] == ["assistant", "tool", "assistant"]
    assert f["messages"][-1]["content"] == "ab #### 6"  # the final answer
    assert rollout_reward(f) == rows[0].reward == 1.5


def test_trained_score_is_rule_reward_plus_tool_rewards_once(tmp_path):
    tok = chatml_tokenizer()
    prompt, rows = run_rows(tok, n=2)
    fields = [reward_fields(r) for r in rows]
    batch = PromptBatch(input_ids=[prompt], ground_truths=["6"], data_sources=["test_agent_rewards"], indices=[0],
                        extra_infos=[{"split": "test"}])
    responses = [r.response for r in rows]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        with RewardPool(num_workers=1) as pool:
            SEEN.clear()
            scorer = RowScorer(pool, tok, RolloutReplicas([[0]], 0), where_defined=False)
            generated = lambda add: Rollout.generated(batch, responses, [], [], row_fields=fields,  # noqa: E731
                                                      add_rewards=add)  # the agent loop's rows
            plain, _ = scorer.rules(batch, generated(False))
            seen = list(SEEN)
            added, _ = scorer.rules(batch, generated(True))
    finally:
        dist.destroy_process_group()
    assert plain == [1.0, 1.0]  # the rule reward alone: the tools' rewards are in extra_info only
    expected = [1.0 + 0.5 + 1.0] * 2  # rule + step reward + calc_reward
    assert all(abs(a - b) <= 1e-12 for a, b in zip(added, expected)), f"scores {added}, expected {expected}"
    # the reward function saw the whole trajectory: every turn's text, the messages and verl's fields
    assert len(seen) == 2 and seen[0]["solution"].endswith("#### 6")
    assert '"name": "add"' in seen[0]["solution"] and "tool\n5" in seen[0]["solution"]  # the call, the tool turn
    assert seen[0]["split"] == "test" and seen[0]["tool_rewards"] == [0.5]
    assert seen[0]["rollout_reward_scores"] == {"add": 1.0} and seen[0]["messages"][-1]["content"] == "ab #### 6"
    assert batch.extra_infos == [{"split": "test"}], "the prompt's extra_info (shared by its rows) was changed"
