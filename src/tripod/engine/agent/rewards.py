"""What the reward function sees of a multi-turn trajectory, and the rollout's own rewards added to its score.

verl's way: the reward function (`fn(solution_str, ground_truth, extra_info)`) scores the decoded response, which for
a multi-turn row is every turn's text (tool and user turns included) ending with the model's final answer, and its
`extra_info` (the row's own, copied) gains the trajectory's fields under verl's names:

    num_turns              model, tool and user turns after the prompt, plus one (verl: user + assistant turns + 1)
    tool_rewards           each tool call's step reward (execute's second value), in order
    turn_scores            each interaction reply's turn score, in order
    rollout_reward_scores  each tool's calc_reward by tool name, and the interaction's final score as "interaction"
    messages               the conversation after the prompt ({role, content}); the last one is the final answer

A reward function may add those itself. With actor_rollout_ref.rollout.multi_turn.add_rollout_rewards, tripod adds
their sum (`rollout_reward`: the loop's `Trajectory.reward`) to the rule score, once, on the rank that scores the row:
the reward function should then not add them too, and a tool whose calc_reward re-scores the final answer against the
ground truth (verl's GSM8K tool) counts that answer twice, once in the rule score and once in its calc_reward.
"""
from __future__ import annotations

from typing import Any

from tripod.engine.agent.loop import Trajectory

FIELDS = ("num_turns", "tool_rewards", "turn_scores", "rollout_reward_scores", "messages")


def reward_fields(r: Trajectory) -> dict[str, Any]:
    """The trajectory's fields for the reward function's extra_info (module docstring; the rendering rank's row)."""
    return {"num_turns": r.assistant_turns + r.user_turns + 1, "tool_rewards": list(r.tool_rewards),
            "turn_scores": list(r.turn_scores), "rollout_reward_scores": dict(r.reward_scores),
            "messages": [dict(m) for m in r.history]}


def rollout_reward(fields: dict[str, Any]) -> float:
    """The rewards the rollout itself gave a row: its tool step rewards, turn scores and final scores, summed."""
    return float(sum(fields["tool_rewards"]) + sum(fields["turn_scores"])
                 + sum(fields["rollout_reward_scores"].values()))


def with_fields(extra_info: dict | None, fields: dict[str, Any] | None) -> dict | None:
    """A copy of a row's extra_info with the trajectory's fields (the prompt's extra_info is shared by its n rows)."""
    return extra_info if fields is None else {**(extra_info or {}), **fields}
