"""The step's batch sharded by DP rank: which rows each rank holds, and the whole-batch statistics.

One assignment per step (`ppo_workers.update_rows`: every row a DP rank's update gives it, over all mini-batches),
computed from every row's lengths and prompt id (`RowLengths`) before any row moves, so the rollout exchange
(engine/rollout/exchange.py) delivers each rank only its rows and its `PPOBatch` holds only them (`PPOBatch.shard`:
their global ids and every row's lengths). The old / reference log-probs and the values are computed on those rows
and stay there. What reads the whole batch reduces over the actor's DP group (one rank per shard): GAE's and
reinforce_plus_plus's advantage whitening, the KL-in-reward mean, rollout correction's metrics and `batch_metrics`
(`RowShards`); GRPO's, RLOO's and reinforce_plus_plus_baseline's group advantages are per-row functions of the
scores, which every rank holds (`outcome_advantages`; the last then whitened over the ranks). Rollout
correction's IS weights and rejection are per row; a rejection's new counted tokens are shared (`RowShards.recount`).

`plan_row_shards` returns None (the whole batch on every rank) where the assignment is not fixed over the step
(shuffled mini-batches over several epochs, or a rejection under a DP split that reads the counted tokens), where
actor, critic and reference split the rows differently on a rank, where the step reads other ranks' rows
(KL-in-reward ahead of a group estimator), or at DP1. The trainer also keeps the whole batch with dynamic sampling
(the kept rows are known only after scoring) and with a reward model (it scores every row on every rank). The
trainer's glue:
`StepRows` runs the plan inside the rollout exchange and gives the arrived rows' `RowShards`, which travel with them in
the step's `Rollout`; `step_batch` builds the rows, `step_advantages` runs the estimator on either batch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from tripod.engine.algorithms import OUTCOME_GROUP_ESTIMATORS, compute_advantage, estimator_options
from tripod.engine.algorithms.masked import WHITEN_EPS
from tripod.engine.workers.batch import BatchShard, PPOBatch, RowLengths, build_ppo_batch
from tripod.engine.workers.megatron_worker import MegatronWorker
from tripod.engine.workers.ppo_workers import assignment_reads_counted_tokens, update_rows

if TYPE_CHECKING:
    from tripod.engine.data import PromptBatch

# estimators whose advantages a sharded batch computes: per-token ones whose only batch statistic is a whitening
# (reduced over the ranks), and the group ones, functions of every row's score (`outcome_advantages`)
TOKEN_ESTIMATORS = ("gae", "reinforce_plus_plus")
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
SHARDED_ESTIMATORS = TOKEN_ESTIMATORS + GROUP_ESTIMATORS


class RowShards:
    """This rank's `rows` (global ids, ascending) of the step's rows (`lengths`: every row's); statistics of per-row
    tensors that hold only those rows, over every rank's rows, by sums over `group` (the actor's DP group)."""

    def __init__(self, rows: list[int], lengths: RowLengths, group, dp: int) -> None:
        self.rows, self.lengths, self.group, self.dp = rows, lengths, group, dp
        self.n = lengths.size
        # rows with a response: scored in their groups, whatever a rejection later does to their counted tokens
        self.responded = lengths.response_lens > 0

    @property
    def batch_shard(self) -> BatchShard:
        return BatchShard(self.rows, self.lengths)

    def _sums(self, *parts: torch.Tensor) -> torch.Tensor:
        t = torch.stack([p.to(torch.float64) for p in parts])
        if self.dp > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def masked_mean(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`masked.masked_mean` over every rank's rows (0 when nothing counts)."""
        m = mask.bool()
        total, count = self._sums(torch.where(m, x, 0).sum(), m.sum())
        return (total / count.clamp(min=1)).to(x.dtype)

    def masked_max(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        """Largest x over every rank's counted tokens (0.0 when nothing counts)."""
        t = torch.where(mask.bool(), x, float("-inf")).max().to(torch.float64).reshape(1) if x.numel() else \
            torch.full((1,), float("-inf"), dtype=torch.float64, device=x.device)
        if self.dp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t) if torch.isfinite(t).all() else 0.0

    def row_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Mean of a per-row [rows] tensor over every rank's rows."""
        total, count = self._sums(x.sum(), torch.tensor(x.shape[0], device=x.device))
        return (total / count).to(x.dtype)

    def masked_whiten(self, x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
        """`masked.masked_whiten` with mean and unbiased variance over every rank's rows."""
        m = mask.bool()
        total, count = self._sums(torch.where(m, x, 0).sum(), m.sum())
        if count.item() < 2:
            raise ValueError(f"masked_whiten needs at least 2 tokens where mask is 1, got {int(count.item())}")
        mean = (total / count).to(x.dtype)
        (sq,) = self._sums(torch.where(m, (x - mean) ** 2, 0).sum())
        var = (sq / (count - 1)).to(x.dtype)
        whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
        return whitened if shift_mean else whitened + mean

    def recount(self, response_mask: torch.Tensor) -> int:
        """Every row's counted response tokens after this rank's rows' `response_mask` changed (rollout correction's
        rejection zeroes rows): this rank's rows' sums, summed over the DP group (each row is on one rank of it; an
        int a row), become `lengths.response_lens`, which the update's loss normalisers and token counts and the
        group estimators read. Returns the count over every row."""
        counted = torch.zeros(self.n, dtype=torch.int64, device=response_mask.device)
        counted[torch.tensor(self.rows, dtype=torch.long, device=response_mask.device)] = \
            response_mask.sum(-1).round().to(torch.int64)
        if self.dp > 1:
            dist.all_reduce(counted, group=self.group)
        every = self.lengths
        self.lengths = RowLengths(every.prompt_lens, counted.cpu(), every.seq_lens, every.index)
        return int(self.lengths.response_lens.sum())

    def outcome_advantages(self, name: str, scores: list[float], mask: torch.Tensor, **options
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns) of this rank's rows (`mask`: their response mask) under a group estimator (grpo,
        rloo, reinforce_plus_plus_baseline) from every row's score: the estimator run on one token per row (the score
        where the row has a response), whose per-row result is what the whole batch's broadcasts over each row's
        tokens; reinforce_plus_plus_baseline's (score minus group mean: Dr.GRPO's) then whitened over the ranks. A row
        rollout correction rejected keeps its score in its group (`responded`) and gets no advantage (`mask`)."""
        if name not in GROUP_ESTIMATORS:
            raise ValueError(f"outcome_advantages: {name!r} is not a group estimator a sharded batch computes")
        if name == "reinforce_plus_plus_baseline":
            centred, _ = self.outcome_advantages("grpo", scores, mask, norm_by_std=False)
            adv = self.masked_whiten(centred, mask) * mask.to(centred.dtype)
            return adv, adv
        has = self.responded.to(torch.float32)[:, None]
        rewards = torch.tensor(scores, dtype=torch.float32)[:, None] * has
        adv, ret = compute_advantage(name, rewards, has, index=self.lengths.index, **options)
        pick = torch.tensor(self.rows, dtype=torch.long)
        return ((adv[pick].to(mask.device) * mask).to(adv.dtype), (ret[pick].to(mask.device) * mask).to(ret.dtype))


def plan_row_shards(lengths: RowLengths, algo, bypass: bool, n_samples: int, actor: MegatronWorker, actor_cfg,
                    critic: MegatronWorker | None, critic_cfg, ref: MegatronWorker | None) -> RowShards | None:
    """The step's `RowShards` from every row's `lengths`, or None where some rank cannot keep its rows (decided alike
    on every rank: one all_reduce over the world). Rows stay apart only where nothing reads other DP ranks' rows: the
    KL-in-reward penalty (per token) only ahead of a TOKEN_ESTIMATORS one (their whitening reduces over the ranks;
    a group estimator would read other rows' penalties), a critic only with GAE, and an estimator of
    SHARDED_ESTIMATORS. Rollout correction's IS weights are per row; its rejection changes
    rows' counted tokens after the rows have moved (`RowShards.recount` shares them), so it keeps the rows apart unless
    an update's DP split reads those counts (`assignment_reads_counted_tokens`)."""
    gae, token = algo.adv_estimator == "gae", algo.adv_estimator in TOKEN_ESTIMATORS
    rejects = not bypass and algo.rollout_correction.rollout_rs is not None
    split_moves = rejects and any(assignment_reads_counted_tokens(w, c)
                                  for w, c in ((actor, actor_cfg), (critic, critic_cfg)) if w is not None)
    allowed = ((token or not algo.use_kl_in_reward) and (gae or critic is None)
               and algo.adv_estimator in SHARDED_ESTIMATORS and not split_moves)
    lay = actor.layout
    if lay.dp == 1:  # one DP rank holds every row: nothing to keep apart (and the one-rank path stays as it was)
        return None
    rows = update_rows(actor, lengths, actor_cfg, n_samples) if allowed else None
    ok = rows is not None
    if ok and critic is not None:
        ok = (critic.layout.dp, critic.layout.dp_rank) == (lay.dp, lay.dp_rank) and \
            update_rows(critic, lengths, critic_cfg, n_samples) == rows
    if ok and ref is not None:
        ok = (ref.layout.dp, ref.layout.dp_rank) == (lay.dp, lay.dp_rank)
    flag = torch.tensor([int(ok)], device=actor.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return RowShards(rows, lengths, lay.dp_group, lay.dp) if int(flag) else None


class StepRows:
    """Where one step's rows live: `needs(prompts)` is the rollout exchange's callback for a generation batch of
    `prompts` (every row's response length -> the rows this rank's batch holds, or None: every row), which runs
    `plan_row_shards` (`plan`: its arguments but the lengths); `shards_of(rollout)` is the `RowShards` of the rows
    that arrived (none: the whole batch). `enabled` False keeps the whole batch (the step plan's `shard_rows`)."""

    def __init__(self, enabled: bool, n_samples: int, **plan) -> None:
        self.enabled, self.n, self.plan = enabled, n_samples, plan

    def lengths(self, prompts: PromptBatch, response_lens: list[int]) -> RowLengths:
        n = self.n
        return RowLengths.of_rollout([len(x) for x in prompts.input_ids for _ in range(n)], response_lens,
                                     [i for i in prompts.indices for _ in range(n)])

    def needs(self, prompts: PromptBatch) -> Callable[[list[int]], list[int] | None] | None:
        if not self.enabled:
            return None

        def rows(response_lens: list[int]) -> list[int] | None:
            shards = plan_row_shards(self.lengths(prompts, response_lens), n_samples=self.n, **self.plan)
            return None if shards is None else shards.rows
        return rows

    def shards_of(self, rollout) -> RowShards | None:
        """The shards of a rollout whose exchange named this rank's rows (`rollout.held_rows`), else None."""
        if rollout.held_rows is None:
            return None
        actor = self.plan["actor"]
        return RowShards(list(rollout.held_rows), self.lengths(rollout.prompts, rollout.response_lens),
                         actor.layout.dp_group, actor.layout.dp)


def step_advantages(algo, token_rewards: torch.Tensor, mask: torch.Tensor, batch: PPOBatch, scores: list[float],
                    shards: RowShards | None, score_mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's (advantages, returns) under algorithm.adv_estimator: of every row, or of a sharded batch's rows
    (GAE and reinforce_plus_plus whitened over the ranks; a group estimator from every row's score, as a group's rows
    may sit on other ranks: `RowShards.outcome_advantages`). `scores`: every row's sequence reward; `score_mask`: the
    response mask before rollout correction's rejection (a group estimator scores the rejected rows by it)."""
    options = estimator_options(algo)  # norm_adv_by_std_in_grpo where the estimator reads it
    if shards is not None and algo.adv_estimator in GROUP_ESTIMATORS:
        return shards.outcome_advantages(algo.adv_estimator, scores, mask, **options)
    if score_mask is not None and algo.adv_estimator in OUTCOME_GROUP_ESTIMATORS:  # verl's group ones too
        options["score_mask"] = score_mask
    return compute_advantage(algo.adv_estimator, token_rewards, mask, index=batch["index"],
                             values=batch.tensors.get("values"), gamma=algo.gamma, lam=algo.lam, **options,
                             **({"whiten": shards.masked_whiten} if shards is not None else {}))


def step_batch(input_ids: list[list[int]], indices: list[int], n: int, responses: list, log_probs: list | None,
               finish_reasons: list | None, rewards: list[float], response_length: int, pad_id: int,
               shards: RowShards | None, token_codes: list | None = None) -> tuple[PPOBatch, list[float]]:
    """(the step's `PPOBatch`, the sequence reward of each of its rows) from the prompts (n rows each) and their
    rollout: every row, or with `shards` this rank's rows only (laid out as wide as the whole batch, with
    `PPOBatch.shard` set). `token_codes` (multi-turn, engine/agent/loop.py): the response mask is 1 on the model's
    tokens only, and a sharded batch's counted tokens become the masks' sums (`RowShards.recount`)."""
    rows = shards.rows if shards is not None else range(len(responses))
    pick = lambda xs: None if xs is None else [xs[g] for g in rows]  # noqa: E731
    prompts = [input_ids[g // n] for g in rows]
    width = None
    if shards is not None:
        every = shards.lengths
        width = int((every.prompt_lens + every.response_lens.clamp(min=1)).max())
    masks = None
    if token_codes is not None:
        from tripod.engine.agent.loop import MODEL

        masks = [(torch.as_tensor(c) == MODEL).float() for c in pick(token_codes)]
    batch = build_ppo_batch(prompts, pick(responses), response_length, pad_id, [indices[g // n] for g in rows],
                            pick(log_probs), pick(finish_reasons), seq_len=width, response_masks=masks)
    if shards is not None and masks is not None:
        shards.recount(batch["response_mask"])
    batch.shard = shards.batch_shard if shards is not None else None
    return batch, pick(rewards)
