"""Rule rewards scored where the samples are: each rollout replica's first rank scores the rows its replica generated.

The rollout splits a batch's prompts over the rollout replicas (engine/rollout/weight_sync.py `replica_bounds`), so
replica i generated rows [bounds[i] * n, bounds[i + 1] * n). Its first rank decodes those rows and scores them on
its own reward pool (engine/rewards/pool.py; the pool starts its workers on first use, so ranks that never score
start none); then one float64 all_reduce gives every rank every row's score and the summed scorer counts. Each rule
reward depends on its own row only, so the scores are those one pool scoring the whole batch gives. Nothing is
pickled: whether a row has a rule score (`where_defined`, the reward-model path: None where the data source has no
rule function) travels as a second float per row, so a rule that returns NaN stays NaN.

Multi-turn (`generated`: the agent loop's Rollout, engine/agent/rollout.py): each row's extra_info gains its
trajectory's fields and, with multi_turn.add_rollout_rewards, its rollout rewards join its rule score here, on the scoring rank only, before the
all_reduce that sums the replicas' disjoint rows, so they count once (engine/agent/rewards.py).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from tripod.engine.agent.rewards import rollout_reward, with_fields
from tripod.engine.data.dataset import PromptBatch
from tripod.engine.rollout.generators import replica_bounds

# the scorer's counts (RewardPool.score); {} when no row of the batch had a rule function
COUNT_KEYS = ("reward/num_timeouts", "reward/num_errors")


def pool_workers(num_workers: int, n_gpus_per_node: int, rollout_tp: int) -> int:
    """Workers of each scoring rank's pool: reward_model.num_workers per node, shared by the node's rollout replicas."""
    replicas_per_node = max(1, n_gpus_per_node // max(rollout_tp, 1))
    return max(1, num_workers // replicas_per_node)


def rows_of_replica(num_prompts: int, n: int, replicas: int, replica: int) -> range:
    bounds = replica_bounds(num_prompts, replicas)
    return range(bounds[replica] * n, bounds[replica + 1] * n)


def score_replica_rows(pool, tokenizer, prompts: PromptBatch, responses: list[list[int]], n: int,
                       replica_ranks: Sequence[Sequence[int]], mine: int, where_defined: bool,
                       generated=None) -> torch.Tensor:
    """This replica's half of the scoring (no collective, so it may run in a thread while the rank generates):
    this replica's first rank scores the replica's rows in its pool; [scores | 1 where scored | counts | 1 if any
    counts], zeros elsewhere. `generated`: the rows' Rollout (engine/rollout/rows.py), whose `row_fields` (multi-turn) join the rows'
    extra_info."""
    from tripod.engine.workers.reward_model import rule_rewards_where_defined

    total = len(responses)
    if total != len(prompts.input_ids) * n:
        raise ValueError(f"{total} responses for {len(prompts.input_ids)} prompts x n={n}")
    # [scores | 1 where scored | counts | 1 if any counts]
    out = torch.zeros(2 * total + len(COUNT_KEYS) + 1, dtype=torch.float64)
    rows = rows_of_replica(len(prompts.input_ids), n, len(replica_ranks), mine)
    if dist.get_rank() == int(replica_ranks[mine][0]) and len(rows):
        per_row = lambda xs: [xs[g // n] for g in rows]  # noqa: E731  prompt-major like the rollout
        texts = tokenizer.batch_decode([responses[g] for g in rows], skip_special_tokens=True)
        fields = getattr(generated, "row_fields", None)
        if fields is not None and len(fields) != len(rows):
            raise RuntimeError(f"the agent's last batch has {len(fields)} rows on this replica, not {len(rows)}")
        infos = per_row(prompts.extra_infos) if prompts.extra_infos else [None] * len(rows)
        if fields is not None:
            infos = [with_fields(info, f) for info, f in zip(infos, fields)]
        args = (texts, per_row(prompts.ground_truths), per_row(prompts.data_sources),
                infos if prompts.extra_infos or fields is not None else None)
        scores, counts = rule_rewards_where_defined(pool, *args) if where_defined else pool.score(*args)
        if fields is not None and generated.add_rewards:
            scores = [s if s is None else s + rollout_reward(f) for s, f in zip(scores, fields)]
        out[rows.start:rows.stop] = torch.tensor([0.0 if s is None else float(s) for s in scores], dtype=torch.float64)
        out[total + rows.start: total + rows.stop] = torch.tensor([float(s is not None) for s in scores],
                                                                  dtype=torch.float64)
        if counts:
            out[2 * total: 2 * total + len(COUNT_KEYS)] = torch.tensor([float(counts[k]) for k in COUNT_KEYS],
                                                                        dtype=torch.float64)
            out[-1] = 1.0
    return out


def share_replica_scores(out: torch.Tensor, total: int, where_defined: bool, group=None
                         ) -> tuple[list, dict[str, float]]:
    """The collective half: every replica's `score_replica_rows` summed on every rank (of
    `group`, default the world)."""
    from tripod.runtime.device import current_device

    out = out.to(current_device())  # NCCL reduces CUDA tensors only; a no-op on gloo's CPU runs
    dist.all_reduce(out, group=group)
    out = out.cpu()
    scored = out[total: 2 * total].tolist()
    scores = [s if has else None for s, has in zip(out[:total].tolist(), scored)]
    if not where_defined and not all(scored):
        raise RuntimeError(f"rows {[g for g, has in enumerate(scored) if not has][:8]} were not scored")
    counts = dict(zip(COUNT_KEYS, out[2 * total: 2 * total + len(COUNT_KEYS)].tolist())) if out[-1] > 0 else {}
    return scores, counts
