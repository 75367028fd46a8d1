"""The step's rows kept on the DP rank that updates them (issue 17 item 5): the assignment and the batch statistics.

One assignment per step (`ppo_workers.update_rows`: every row a DP rank's update gives it, over all mini-batches) is
used by the forward passes too, so the old / reference log-probs and the values never leave the DP rank that
computed them: the batch holds them in place and NaN in the other ranks' rows. What reads the whole batch then
reduces over the actor's DP group (one rank per shard): GAE's advantage whitening, the KL-in-reward mean, rollout
correction's mismatch metrics and `batch_metrics`. `plan_row_shards` returns None (the all-gather path, every row everywhere) where the assignment
is not fixed over the step (shuffled mini-batches over several epochs), where actor, critic and reference split
the rows differently on a rank, or where the caller says the step reads other ranks' rows (an active rollout
correction: IS weights or rejection; KL-in-reward ahead of a group estimator).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tripod.engine.algorithms.masked import WHITEN_EPS
from tripod.engine.workers.batch import PPOBatch
from tripod.engine.workers.megatron_worker import MegatronWorker
from tripod.engine.workers.ppo_workers import update_rows


class RowShards:
    """This rank's `rows` of an `n`-row batch; statistics over every rank's rows by sums over `group`."""

    def __init__(self, rows: list[int], n: int, group, dp: int, device: torch.device) -> None:
        self.rows, self.n, self.group, self.dp = rows, n, group, dp
        self.owned = torch.zeros(n, dtype=torch.bool, device=device)
        self.owned[torch.tensor(rows, dtype=torch.long, device=device)] = True

    def _sums(self, *parts: torch.Tensor) -> torch.Tensor:
        t = torch.stack([p.to(torch.float64) for p in parts])
        if self.dp > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def _mask(self, mask: torch.Tensor) -> torch.Tensor:
        return mask.bool() & self.owned.view(-1, *([1] * (mask.dim() - 1)))

    def masked_mean(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`masked.masked_mean` over every rank's rows (0 when nothing counts)."""
        m = self._mask(mask)
        total, count = self._sums(torch.where(m, x, 0).sum(), m.sum())
        return (total / count.clamp(min=1)).to(x.dtype)

    def masked_max(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        """Largest x over every rank's counted tokens (0.0 when nothing counts)."""
        m = self._mask(mask)
        t = torch.where(m, x, float("-inf")).max().to(torch.float64).reshape(1)
        if self.dp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t) if torch.isfinite(t).all() else 0.0

    def row_mean(self, x: torch.Tensor) -> torch.Tensor:
        """Mean of a per-row [N] tensor over every rank's rows."""
        total, count = self._sums(torch.where(self.owned, x, 0).sum(), self.owned.sum())
        return (total / count).to(x.dtype)

    def masked_whiten(self, x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
        """`masked.masked_whiten` with mean and unbiased variance over every rank's rows."""
        m = self._mask(mask)
        total, count = self._sums(torch.where(m, x, 0).sum(), m.sum())
        if count.item() < 2:
            raise ValueError(f"masked_whiten needs at least 2 tokens where mask is 1, got {int(count.item())}")
        mean = (total / count).to(x.dtype)
        (sq,) = self._sums(torch.where(m, (x - mean) ** 2, 0).sum())
        var = (sq / (count - 1)).to(x.dtype)
        whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
        return whitened if shift_mean else whitened + mean


def plan_row_shards(batch: PPOBatch, algo, bypass: bool, n_samples: int, actor: MegatronWorker, actor_cfg,
                    critic: MegatronWorker | None, critic_cfg, ref: MegatronWorker | None) -> RowShards | None:
    """The step's `RowShards`, or None where some rank cannot keep its rows (decided alike on every rank). Rows stay
    apart only where nothing reads other DP ranks' model outputs: no active rollout correction (its IS weights and
    rejection are not reduced over ranks; `bypass` needs none), the KL-in-reward penalty (per token) only ahead of
    GAE, whose whitening reduces over the ranks, and a critic only with GAE."""
    gae = algo.adv_estimator == "gae"
    allowed = ((bypass or not algo.rollout_correction.active) and (gae or not algo.use_kl_in_reward)
               and (gae or critic is None))
    lay = actor.layout
    if lay.dp == 1:  # one DP rank holds every row: nothing to keep apart (and the one-rank path stays as it was)
        return None
    rows = update_rows(actor, batch, actor_cfg, n_samples) if allowed else None
    ok = rows is not None
    if ok and critic is not None:
        ok = (critic.layout.dp, critic.layout.dp_rank) == (lay.dp, lay.dp_rank) and \
            update_rows(critic, batch, critic_cfg, n_samples) == rows
    if ok and ref is not None:
        ok = (ref.layout.dp, ref.layout.dp_rank) == (lay.dp, lay.dp_rank)
    flag = torch.tensor([int(ok)], device=actor.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return RowShards(rows, batch.size, lay.dp_group, lay.dp, actor.device) if int(flag) else None
