"""A step's rows, one type from the rollout engine to the PPO batch.

    generator.generate_rows(prompts, ...)   -> Rollout: responses, the engine's log-probs and finish reasons, token
                                               codes (multi-turn), routing records (R3), which rows this rank holds
    scorer / DynamicSampler.scored          -> its scores, sequence rewards and overlong penalties
    rollout source (async_rollout/source.py) -> its DP shards (RowShards); the trainer builds the PPOBatch from it

Row i*n + j is sample j of prompt i. Where the rollout exchange left this rank only the rows it updates (a batch
sharded by DP rank, engine/workers/row_shards.py) the other rows are None, except those its own rollout replica
generated. The rollout's own ranks send it to the trainer as engine/async_rollout/messages.py's ScoredBatch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from tripod.engine.data.dataset import PromptBatch


@dataclass
class Rollout:
    """A step's rows from the rollout engine to the PPO batch (see the module docstring)."""
    prompts: PromptBatch
    responses: list[list[int] | None]  # n per prompt, prompt-major
    scores: list[float]           # the rule reward of each response
    rewards: list[float]          # its sequence reward: score + overlong penalty
    penalties: list[float]        # the overlong penalty (0 when shaping is off)
    reward_metrics: dict[str, float]  # the scorer's counts (reward/num_timeouts, reward/num_errors)
    # the rollout engine's log-prob of each response token (a float32 tensor per response) and each finish reason;
    # None when the generator gave responses only
    rollout_log_probs: list | None = None
    finish_reasons: list[str] | None = None
    # multi-turn: each response token's code (engine/agent/loop.py: the model's, a tool's, a user's); None: all model
    token_codes: list | None = None
    # MoE routing replay (R3): each row's experts per token from the rollout engine (engine/rollout/routing_record.py)
    routed_experts: list | None = None
    # every row's response length, and the rows this rank holds where the rollout exchange named them (a batch sharded
    # by DP rank; None: every row), and their RowShards (engine/workers/row_shards.py), set by the rollout source
    response_lens: list[int] | None = None
    held_rows: list[int] | None = None
    shards: Any = None
    # multi-turn: this replica's rows' trajectory fields (engine/agent/rewards.py), which its scorer reads; with
    # `add_rewards` their rollout rewards join the rule score
    row_fields: list[dict] | None = None
    add_rewards: bool = False

    @classmethod
    def generated(cls, prompts: PromptBatch, responses: list, log_probs: list, finish_reasons: list,
                  response_lens: list[int] | None = None, held_rows: list[int] | None = None, **fields) -> "Rollout":
        """A batch as the rollout engine left it, before scoring (the score fields empty)."""
        return cls(prompts, responses, [], [], [], {}, log_probs, finish_reasons, response_lens=response_lens,
                   held_rows=held_rows, **fields)

    def groups(self, keep: Sequence[int], n: int) -> "Rollout":
        """The rollout of the prompts at positions `keep`, each with its n responses (the scorer's counts stay
        those of the whole rollout: every response was scored)."""
        p, rows = self.prompts, [g * n + j for g in keep for j in range(n)]
        prompts = PromptBatch(input_ids=[p.input_ids[g] for g in keep], ground_truths=[p.ground_truths[g] for g in keep],
                              data_sources=[p.data_sources[g] for g in keep], indices=[p.indices[g] for g in keep],
                              extra_infos=[p.extra_infos[g] for g in keep] if p.extra_infos else [],
                              raw_prompts=None if p.raw_prompts is None else [p.raw_prompts[g] for g in keep])
        pick = lambda xs: None if xs is None else [xs[i] for i in rows]  # noqa: E731
        return Rollout(prompts, pick(self.responses), pick(self.scores), pick(self.rewards), pick(self.penalties),
                       dict(self.reward_metrics), pick(self.rollout_log_probs), pick(self.finish_reasons),
                       pick(self.token_codes), pick(self.routed_experts))


def concat(rollouts: Sequence[Rollout]) -> Rollout:
    """The rollouts one after another; the scorer's counts are summed."""
    join = lambda parts: [x for part in parts for x in part]  # noqa: E731
    ps = [r.prompts for r in rollouts]
    prompts = PromptBatch(input_ids=join(p.input_ids for p in ps), ground_truths=join(p.ground_truths for p in ps),
                          data_sources=join(p.data_sources for p in ps), indices=join(p.indices for p in ps),
                          extra_infos=join(p.extra_infos for p in ps),
                          raw_prompts=None if any(p.raw_prompts is None for p in ps) else join(p.raw_prompts for p in ps))
    counts: dict[str, float] = {}
    for r in rollouts:
        for key, value in r.reward_metrics.items():
            counts[key] = counts.get(key, 0.0) + value
    carried = lambda field: (None if any(getattr(r, field) is None for r in rollouts)  # noqa: E731
                             else join(getattr(r, field) for r in rollouts))
    return Rollout(prompts, join(r.responses for r in rollouts), join(r.scores for r in rollouts),
                   join(r.rewards for r in rollouts), join(r.penalties for r in rollouts), counts,
                   carried("rollout_log_probs"), carried("finish_reasons"), carried("token_codes"),
                   carried("routed_experts"))


