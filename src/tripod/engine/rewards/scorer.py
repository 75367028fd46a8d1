"""Each row's reward, one object for the trainer's ranks and the rollout's own: rule rewards scored where the rows
were generated (replica_scoring.py), combined with the reward model's scores where there is one.

The reward model is a megatron model on the trainer's layout, so it scores on the trainer's ranks. A colocated
rollout is scored whole there (`__call__`). With the rollout on its own ranks, those ranks score the rules while they
generate the next batch (None where a data source has no rule function: the model scores it) and the trainer adds the
model's scores when the batch arrives (`add_model_scores`): the rows reach the trainer anyway, the model is already
there, and the rollout ranks hold only the inference engine. Overlong shaping is added after the combination in both.
"""
from __future__ import annotations

from typing import Any

import torch

from tripod.engine.data.dataset import PromptBatch
from tripod.engine.rewards.replica_scoring import score_replica_rows, share_replica_scores
from tripod.engine.rollout.generators import RolloutReplicas
from tripod.engine.rollout.rows import Rollout
from tripod.engine.workers.reward_model import combine_rewards


class RowScorer:
    """Scores generated rows (see the module docstring). `where_defined`: reward_model.enable (rows whose data source
    has no rule function get None from the rules); `reward_model`: the model itself on the trainer's ranks, None on
    the rollout's own ranks; `group`: the process group the scores are summed over (None: the world)."""

    def __init__(self, pool: Any, tokenizer: Any, replicas: RolloutReplicas, where_defined: bool,
                 reward_model: Any = None, rm_cfg: Any = None, group: Any = None) -> None:
        self.pool, self.tokenizer, self.replicas, self.where_defined = pool, tokenizer, replicas, where_defined
        self.reward_model, self.rm_cfg, self.group = reward_model, rm_cfg, group

    def local(self, prompts: PromptBatch, generated: Any) -> torch.Tensor:
        """This replica's rule scores (no collective: the rollout ranks run it in their scorer thread)."""
        responses = _responses(generated)
        return score_replica_rows(self.pool, self.tokenizer, prompts, responses, len(responses) // len(prompts),
                                  self.replicas.ranks, self.replicas.mine, self.where_defined, generated)

    def shared(self, local: torch.Tensor, rows: int, on_world: bool = False) -> tuple[list, dict[str, float]]:
        """Every replica's `local` scores on every rank of `group` (or of the world: `on_world`; collective)."""
        return share_replica_scores(local, rows, self.where_defined, None if on_world else self.group)

    def rules(self, prompts: PromptBatch, generated: Any, on_world: bool = False) -> tuple[list, dict[str, float]]:
        return self.shared(self.local(prompts, generated), len(_responses(generated)), on_world)

    def __call__(self, prompts: PromptBatch, generated: Any) -> tuple[list, dict[str, float]]:
        """(each row's score, the scorer's metrics): rules, combined with the reward model's where it is on."""
        scores, metrics = self.rules(prompts, generated)
        if self.reward_model is None:
            return scores, metrics
        combined, model_metrics = self._combine(prompts, _responses(generated), scores)
        return combined, {**metrics, **model_metrics}

    def add_model_scores(self, rollout: Rollout) -> tuple[Rollout, dict[str, float]]:
        """A rollout the rollout's own ranks scored by the rules alone, with the reward model's scores combined in and
        its sequence rewards (score + overlong penalty) made again."""
        if self.reward_model is None:
            return rollout, {}
        scores, metrics = self._combine(rollout.prompts, rollout.responses, rollout.scores)
        rollout.scores = scores
        rollout.rewards = [s + p for s, p in zip(scores, rollout.penalties)]
        return rollout, metrics

    def _combine(self, prompts: PromptBatch, responses: list, rule: list) -> tuple[list[float], dict[str, float]]:
        n = len(responses) // len(prompts.input_ids)
        rows = [prompts.input_ids[i // n] + list(r) for i, r in enumerate(responses)]
        model = self.reward_model.score(rows, self.rm_cfg.micro_batch_size_per_gpu)
        return combine_rewards(rule, model, self.rm_cfg.combine, self.rm_cfg.reward_weight)


def _responses(generated: Any) -> list:
    return generated if isinstance(generated, list) else generated.responses
