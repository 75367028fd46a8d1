"""The actor, critic and reference of PPO, each a `MegatronWorker` with the computations the step needs.

Loss scaling (see engine/algorithms/losses.py): every micro-batch loss is its share of the *global* mini-batch
loss (normalised by the whole mini-batch's token / sequence count, known on every rank: it holds the batch, or a
sharded batch carries every row's lengths), multiplied by num_microbatches * dp to undo megatron's division by the number of micro-batches and
its DP gradient averaging. Metrics are shares of global values too, so summing them over micro-batches and DP ranks
gives the mini-batch value whatever the layout: the actor's pg_loss at TP1xPP1 and TP2xPP2xDP2 agree.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from tripod.engine.algorithms import (
    agg_norm,
    entropy_loss,
    get_policy_loss_fn,
    global_batch_info,
    kl_loss,
    masked_mean,
    value_loss,
    verl_actor_config,
    weighted_policy_metrics,
)
from tripod.engine.algorithms.rollout_correction import GroupReduce, mismatch_metrics
from tripod.engine.data.batching import balanced_partition, split_by_token_budget
from tripod.engine.workers.batch import BatchShard, PPOBatch, RowLengths, split_rows
from tripod.engine.workers.megatron_worker import MegatronWorker
from tripod.engine.workers.moe_shapes import agreed_count


def _microbatches(batch: PPOBatch, micro: int) -> list[PPOBatch]:
    n = batch.size
    micro = min(micro, n)
    if n % micro:
        raise ValueError(f"{n} rows per DP rank are not divisible by the micro-batch size {micro}")
    return [batch.select(s) for s in split_rows(n, n // micro)]


def _budget_units(worker: MegatronWorker, rows: PPOBatch | RowLengths) -> tuple[list[list[int]], list[int]]:
    """What a token budget packs: with shared-prompt packing on, the rows of one prompt (adjacent rows with the same
    `index`) stay together, costing the prompt once plus their responses (each as long as the longest, or at its
    own length without padding); else every row alone, costing its tokens. Reads the rows' lengths only."""
    stats = RowLengths.of(rows)
    lens = stats.seq_lens.tolist()
    if not (worker.share_prompt_prefix and worker.can_pack):
        return [[i] for i in range(len(lens))], lens
    index, prompt = stats.index.tolist(), stats.prompt_lens.tolist()
    response = stats.response_lens.tolist()
    units: list[list[int]] = []
    for i, p in enumerate(index):
        if units and index[units[-1][0]] == p:
            units[-1].append(i)
        else:
            units.append([i])
    if worker.remove_padding:
        return units, [prompt[u[0]] + int(sum(response[i] for i in u)) for u in units]
    return units, [prompt[u[0]] + len(u) * int(max(response[i] for i in u)) for u in units]


def _token_budget_microbatches(worker: MegatronWorker, rows: PPOBatch, budget: int
                               ) -> tuple[list[PPOBatch], torch.Tensor]:
    """`rows` cut into micro-batches of at most `budget` tokens each (`_budget_units`; a prompt's rows that together
    exceed it run as single rows), balanced by tokens and trimmed to their own longest row (use_dynamic_bsz), and the
    order of the rows they hold (to put per-row results back in place). With virtual pipeline stages the count is
    rounded up to a multiple of PP (interleaved 1F1B's micro-batch group)."""
    lens = rows["attention_mask"].sum(-1).tolist()
    units, costs = [], []
    for unit, cost in zip(*_budget_units(worker, rows)):
        if cost <= budget or len(unit) == 1:
            units.append(unit)
            costs.append(cost)
        else:
            units += [[i] for i in unit]
            costs += [lens[i] for i in unit]
    groups = split_by_token_budget(costs, budget)
    multiple = worker.layout.pp if len(worker.model) > 1 else 1
    while len(groups) % multiple and len(groups) < len(costs):
        groups = split_by_token_budget(costs, budget, min(len(costs), -(-len(groups) // multiple) * multiple))
    count = agreed_count(worker.layout, bool(worker.module.config.num_moe_experts), len(groups), worker.device)
    if count > len(groups):  # MoE layers exchanging tokens: every rank of the group runs the same count
        if count > len(costs):  # fewer units than micro-batches: the rows alone
            units, costs = [[i] for i in range(rows.size)], lens
        groups = split_by_token_budget(costs, budget, min(count, len(costs)))
    row_groups = [sorted(i for u in g for i in units[u]) for g in groups]
    return [rows.select(g).trimmed() for g in row_groups], torch.tensor([i for g in row_groups for i in g])


def _forward_microbatches(worker: MegatronWorker, batch: PPOBatch, micro: int, budget: int | None
                          ) -> tuple[list[PPOBatch], torch.Tensor | None]:
    """This DP rank's rows of a forward-only pass (log-probs, values) as micro-batches: `micro` rows each, or under a
    token `budget` (then also the row order, see `_token_budget_microbatches`): every row of a sharded batch (it
    holds this rank's rows only: engine/workers/row_shards.py), else the rank's contiguous share."""
    mine = batch if batch.shard is not None else batch.select(worker.dp_rows(batch.size))
    if budget:
        return _token_budget_microbatches(worker, mine, budget)
    return _microbatches(mine, micro), None


def _in_row_order(per_row: torch.Tensor | None, order: torch.Tensor | None) -> torch.Tensor | None:
    if per_row is None or order is None:
        return per_row
    out = torch.empty_like(per_row)
    out[order.to(per_row.device)] = per_row
    return out


def _mini_batch_rows(batch: PPOBatch | RowLengths, mini_rows: int, shuffle: bool, epoch: int) -> list:
    """Row sets of the mini-batches of one PPO epoch; with `shuffle`, a permutation every rank derives alike
    (seeded by the batch's prompt ids and the epoch, so a resumed run shuffles the same way)."""
    slices = split_rows(batch.size, batch.size // mini_rows)
    if not shuffle:
        return slices
    seed = int(batch.index.sum() if isinstance(batch, RowLengths) else batch["index"].sum()) * 1009 + epoch
    order = torch.randperm(batch.size, generator=torch.Generator().manual_seed(seed))
    return [order[s] for s in slices]


def run_ppo_epochs(worker: MegatronWorker, batch: PPOBatch, cfg, n_samples: int,
                   update_mini_batch: Callable[[PPOBatch], dict[str, float]], prefix: str,
                   stop: Callable[[dict[str, float]], bool] | None = None) -> tuple[dict[str, float], bool, int]:
    """The PPO update loop of the actor and the critic: `cfg.ppo_epochs` epochs over mini-batches of
    `cfg.ppo_mini_batch_size * n_samples` rows (verl semantics), `update_mini_batch` (forward + backward) then one
    optimizer step per mini-batch; `stop(metrics)` true after a mini-batch ends the update early. A sharded batch
    (engine/workers/row_shards.py) walks the whole step's mini-batches by every row's lengths, each as the rows of it
    this rank holds (`_sharded_mini_batch`). Returns (metrics averaged over the optimizer steps with
    `{prefix}/grad_norm` and `{prefix}/lr`, stopped early, number of optimizer steps)."""
    mini_rows = cfg.ppo_mini_batch_size * n_samples
    per_step, grad_norms = [], []
    for epoch in range(cfg.ppo_epochs):
        for rows in _mini_batch_rows(batch if batch.shard is None else batch.shard.lengths, mini_rows, cfg.shuffle,
                                     epoch):
            metrics = update_mini_batch(batch.select(rows) if batch.shard is None else _sharded_mini_batch(batch, rows))
            grad_norms.append(worker.step())
            per_step.append(metrics)
            if stop is not None and stop(metrics):
                return _epoch_metrics(worker, per_step, grad_norms, prefix), True, len(grad_norms)
    return _epoch_metrics(worker, per_step, grad_norms, prefix), False, len(grad_norms)


def _epoch_metrics(worker: MegatronWorker, per_step: list[dict[str, float]], grad_norms: list[float],
                   prefix: str) -> dict[str, float]:
    out = _mean_dicts(per_step)
    out[f"{prefix}/grad_norm"] = sum(grad_norms) / len(grad_norms)
    out[f"{prefix}/lr"] = worker.last_lr  # of this step's last optimizer update
    return out


def _sharded_mini_batch(batch: PPOBatch, rows) -> PPOBatch:
    """Mini-batch `rows` (global row ids, or a slice of them) of a sharded batch: the rows of it this batch holds, in
    mini-batch order, with a shard whose `lengths` are the whole mini-batch's and whose `rows` are the held rows'
    positions in it."""
    every = batch.shard.lengths
    ids = list(range(every.size))[rows] if isinstance(rows, slice) else [int(g) for g in rows]
    held = [k for k, g in enumerate(ids) if g in batch.shard]
    mini = batch.select(batch.shard.local([ids[k] for k in held]))
    mini.shard = BatchShard(held, every.select(ids))
    return mini


def _split_mini_batch(worker: MegatronWorker, mini: PPOBatch, cfg):
    """(this rank's micro-batches, global loss normaliser, global token count, loss scale) of a mini-batch.

    With use_dynamic_bsz the DP ranks get equal row counts (whole prompt groups where packing shares prompts) of
    balanced token sums and cut them under the token budget,
    so ranks may run different numbers of micro-batches: the loss scale uses this rank's count (megatron divides by
    it), and the normaliser is the whole mini-batch's, so the gradient is the same whatever the split. A sharded
    mini-batch (`_sharded_mini_batch`) takes them from every row's counted tokens (its mask's sums: after rollout
    correction's rejection, `RowShards.recount`'s)."""
    if mini.shard is None:
        mask = mini["response_mask"]
        mine = mini.select(_dp_choice(worker, mini, cfg))
        norm, tokens = agg_norm(mask, cfg.loss_agg_mode), mask.sum().clamp(min=1)
    else:
        mine = mini.select(mini.shard.local(_dp_choice(worker, mini.shard.lengths, cfg)))
        counted, dev = mini.shard.lengths.response_lens, mini["response_mask"].device
        norm = (counted.sum() if cfg.loss_agg_mode == "token-mean" else (counted > 0).sum()).to(dev, torch.float32)
        tokens = counted.sum().to(dev, torch.float32).clamp(min=1)
    if cfg.use_dynamic_bsz:
        micro, _ = _token_budget_microbatches(worker, mine, cfg.ppo_max_token_len_per_gpu)
    else:
        micro = _microbatches(mine, cfg.ppo_micro_batch_size_per_gpu or mine.size)
    return micro, norm, tokens, len(micro) * worker.layout.dp


def _dp_choice(worker: MegatronWorker, mini: PPOBatch | RowLengths, cfg) -> list[int]:
    """The rows of mini-batch `mini` (its own indices) this DP rank updates: with use_dynamic_bsz equal row counts
    (whole prompt groups where packing shares prompts) of balanced token sums, else its contiguous share. Reads the
    rows' lengths only."""
    lay = worker.layout
    if not cfg.use_dynamic_bsz:
        return list(range(mini.size))[worker.dp_rows(mini.size)]
    units, costs = _budget_units(worker, mini)
    if len(units) % lay.dp or len({len(u) for u in units}) > 1:  # a prompt's rows would straddle DP ranks
        units, costs = [[i] for i in range(mini.size)], RowLengths.of(mini).seq_lens.tolist()
    return sorted(i for u in balanced_partition(costs, lay.dp)[lay.dp_rank] for i in units[u])


def assignment_reads_counted_tokens(worker: MegatronWorker, cfg) -> bool:
    """Whether `_dp_choice` reads the rows' counted response tokens (a token budget over prompt groups packed behind
    their shared prompt: `_budget_units`), which rollout correction's rejection changes after the rows have moved."""
    return bool(cfg.use_dynamic_bsz and worker.share_prompt_prefix and worker.can_pack)


def update_rows(worker: MegatronWorker, batch: PPOBatch | RowLengths, cfg, n_samples: int) -> list[int] | None:
    """Every row (global index, ascending) this DP rank updates over the step's mini-batches, when that set is the
    same in every epoch (no shuffle, or one epoch); else None. A function of the rows' lengths and prompt ids
    only (`RowLengths`), so every rank derives every rank's set alike, before any row has reached it."""
    if cfg.shuffle and cfg.ppo_epochs > 1:
        return None
    batch = RowLengths.of(batch)
    out: list[int] = []
    for rows in _mini_batch_rows(batch, cfg.ppo_mini_batch_size * n_samples, cfg.shuffle, 0):
        ids = list(range(batch.size))[rows] if isinstance(rows, slice) else rows.tolist()
        out += [ids[i] for i in _dp_choice(worker, batch.select(rows), cfg)]
    return sorted(out)


def _mean_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = dicts[0].keys() if dicts else []
    return {k: sum(d[k] for d in dicts) / len(dicts) for k in keys}


def _sum_metrics(outs: list[dict]) -> dict[str, float]:
    total: dict[str, float] = {}
    for d in outs:
        for k, v in d.items():
            total[k] = total.get(k, 0.0) + float(v)
    return total


class PolicyWorker(MegatronWorker):
    """Actor (trainable) or reference (frozen): log-probs of response tokens, and the PPO actor update."""

    distillation = None  # the actor's `distillation` config section when distilling (set by the trainer)

    def compute_log_probs(self, batch: PPOBatch, micro: int, temperature: float, with_entropy: bool = False,
                          token_budget: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) of every response token of `batch`, on every rank of the layout; micro-batches of
        `micro` rows, or of at most `token_budget` tokens (log_prob_use_dynamic_bsz). A sharded batch's rows (this DP
        rank's, engine/workers/row_shards.py) stay on this DP rank; a whole batch's are gathered over DP."""
        n, r = batch.size, batch["responses"].shape[1]
        mbs, order = _forward_microbatches(self, batch, micro, token_budget)

        def loss_fn(output, mb):
            logp, ent = self.token_logprobs(output, mb, temperature, with_entropy)
            out = {"logp": logp.detach()}
            if ent is not None:
                out["entropy"] = ent.detach()
            return logp.sum() * 0.0, out

        outs = self.run(mbs, loss_fn, forward_only=True)
        if self.routing is not None and self.routing.mode == "record":  # R2: the ids this pass routed to, per row
            from tripod.parallel.router_replay import recorded_rows
            self.recorded_routing = recorded_rows(self, sum(mb.size for mb in mbs), order,
                                                  batch["input_ids"].shape[1], batch.shard is not None)
        logp = _in_row_order(torch.cat([o["logp"] for o in outs]) if outs else None, order)
        ent = _in_row_order(torch.cat([o["entropy"] for o in outs]) if outs and with_entropy else None, order)
        sharded = batch.shard is not None
        logp = self.rows_of_stages(logp, (r,), n) if sharded else self.gather_rows(logp, (r,), n)
        if with_entropy:
            ent = self.rows_of_stages(ent, (r,), n) if sharded else self.gather_rows(ent, (r,), n)
        return logp, ent

    def update(self, batch: PPOBatch, cfg, temperature: float, n_samples: int,
               rollout_gap: bool = False) -> dict[str, float]:
        """The PPO actor update (`run_ppo_epochs`), stopped early once a mini-batch's actor/ppo_kl > target_kl (rank 0
        says so, with the numbers). `rollout_gap`: also log rollout_corr/* (`mismatch_metrics`) of the first
        mini-batch's forward (the weights the step began with) against the batch's "rollout_log_probs": the gap
        where no old log-probs were recomputed (an exactly on-policy step: every row; bypass_mode)."""
        last: dict[str, float] = {}
        first: list | None = [] if rollout_gap else None
        gap: dict[str, float] = {}

        def stop(metrics: dict[str, float]) -> bool:
            last.update(metrics)
            return metrics["actor/ppo_kl"] > cfg.target_kl

        def mini_batch(mini: PPOBatch) -> dict[str, float]:
            nonlocal first
            metrics = self._update_mini_batch(mini, cfg, temperature, first)
            if first is not None:
                gap.update(self._rollout_gap(first))
                first = None
            return metrics

        out, stopped, updates = run_ppo_epochs(self, batch, cfg, n_samples, mini_batch, "actor",
                                               None if cfg.target_kl is None else stop)
        out.update(gap)
        if stopped and dist.get_rank() == 0:
            print(f"actor: PPO epochs stopped early after {updates} of {cfg.ppo_epochs} x "
                  f"{batch.lengths.size // (cfg.ppo_mini_batch_size * n_samples)} optimizer steps: "
                  f"actor/ppo_kl={last['actor/ppo_kl']:.4g} > actor.target_kl={cfg.target_kl}", flush=True)
        out["actor/early_stopped"] = float(stopped)
        out["actor/num_updates"] = float(updates)
        return out

    def _rollout_gap(self, parts: list[tuple[torch.Tensor, ...]]) -> dict[str, float]:
        """`mismatch_metrics` of the (log-probs, rollout log-probs, mask) micro-batches the last pipeline stage kept,
        over the DP ranks, on every rank of the layout."""
        lay = self.layout
        src = lay.group_ranks("pp")[-1]
        box: list = [None]
        if dist.get_rank() == src:
            if parts:
                old, rollout, mask = (torch.cat(p) for p in zip(*parts))
            else:  # no row of this mini-batch on this DP rank: it still joins the reductions
                old = rollout = mask = torch.zeros(0, 1, device=self.device)
            reduce = GroupReduce(lay.dp_group, lay.dp)
            box[0] = mismatch_metrics(old, rollout, mask, reduce.mean, reduce.max_of)
        if lay.pp > 1:
            dist.broadcast_object_list(box, src=src, group=lay.pp_group)
        return box[0]

    def _update_mini_batch(self, mini: PPOBatch, cfg, temperature: float,
                           first: list | None = None) -> dict[str, float]:
        agg = cfg.loss_agg_mode
        micro, norm, tokens, scale = _split_mini_batch(self, mini, cfg)
        need_entropy = True  # logged always; cheap next to the forward
        loss_of = get_policy_loss_fn(cfg.policy_loss.loss_mode)
        batch_info = global_batch_info(mini["response_mask"].sum(-1) if mini.shard is None
                                       else mini.shard.lengths.response_lens, mini["response_mask"].shape[1],
                                       cfg.loss_scale_factor)  # the whole mini-batch's (a sharded one's too)
        loss_cfg, horizon = verl_actor_config(cfg, batch_info), batch_info["loss_scale_factor"]

        def loss_fn(output, mb):
            mask = mb["response_mask"]
            logp, ent = self.token_logprobs(output, mb, temperature, need_entropy)
            # exactly on-policy (the trainer skipped the recompute): old log-probs are this forward's, detached
            old = mb["old_log_probs"] if mb.recomputed_old_log_probs else logp.detach()
            if first is not None:  # the rollout / train gap of this forward (`update`'s rollout_gap)
                first.append((logp.detach(), mb["rollout_log_probs"], mask))
            # the policy loss (engine/algorithms/policy_losses.py: verl's registry and call, loss_mode)
            pg, m = loss_of(old, logp, mb["advantages"], mask, agg, loss_cfg,
                            mb.tensors.get("rollout_is_weights"))  # rollout correction's IS weights
            loss = pg
            share = mask.sum() / tokens
            metrics = {"actor/pg_loss": pg.detach(), **weighted_policy_metrics(m, old, logp, mask, share),
                       "actor/entropy": masked_mean(ent.detach(), mask) * share}
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * entropy_loss(ent, mask, agg, global_norm=norm,
                                                               loss_scale_factor=horizon)
            if cfg.use_kl_loss:
                kl = kl_loss(logp, mb["ref_log_probs"], mask, cfg.kl_loss_type, agg, global_norm=norm,
                             loss_scale_factor=horizon)
                loss = loss + cfg.kl_loss_coef * kl
                metrics["actor/kl_loss"] = kl.detach()
            # on-policy distillation (engine/workers/teacher.py): added to, or replacing, the loss
            if self.distillation is not None:
                from tripod.engine.workers.teacher import distillation_term

                loss, dm = distillation_term(self, output, mb, loss, logp, old, norm, share, cfg, self.distillation,
                                             temperature, extrema)
                metrics.update(dm)
            return loss * scale, metrics

        extrema: list = []  # distillation/loss_min|max per micro-batch (reduced below)
        outs = self.run(micro, loss_fn, forward_only=False)
        out = self.sum_over_dp(_sum_metrics(outs))
        if self.distillation is not None:  # distillation: min / max, not sums, over micro-batches and DP
            from tripod.engine.workers.teacher import reduce_extrema

            out.update(reduce_extrema(self, extrema))
        aux = self.moe_aux_loss(len(micro))
        if aux is not None:
            out["actor/moe_aux_loss"] = aux
        return out


class CriticWorker(MegatronWorker):
    """Value model: values of response positions, and the clipped value-loss update."""

    def compute_values(self, batch: PPOBatch, micro: int, token_budget: int | None = None) -> torch.Tensor:
        """Values of every response position of `batch`; as `PolicyWorker.compute_log_probs`."""
        n, r = batch.size, batch["responses"].shape[1]
        mbs, order = _forward_microbatches(self, batch, micro, token_budget)

        def loss_fn(output, mb):
            v = self.token_values(output, mb)
            return v.sum() * 0.0, {"values": v.detach()}

        outs = self.run(mbs, loss_fn, forward_only=True)
        values = _in_row_order(torch.cat([o["values"] for o in outs]) if outs else None, order)
        return self.rows_of_stages(values, (r,), n) if batch.shard is not None else self.gather_rows(values, (r,), n)

    def update(self, batch: PPOBatch, cfg, n_samples: int) -> dict[str, float]:
        """The clipped value-loss update over the PPO epochs and mini-batches (`run_ppo_epochs`)."""
        out, _, _ = run_ppo_epochs(self, batch, cfg, n_samples, lambda mini: self._update_mini_batch(mini, cfg),
                                   "critic")
        return out

    def _update_mini_batch(self, mini: PPOBatch, cfg) -> dict[str, float]:
        agg = cfg.loss_agg_mode
        micro, norm, tokens, scale = _split_mini_batch(self, mini, cfg)

        def loss_fn(output, mb):
            mask = mb["response_mask"]
            v = self.token_values(output, mb)
            vf, m = value_loss(v, mb["returns"], mb["values"], mask, cfg.cliprange_value, agg, global_norm=norm)
            share = mask.sum() / tokens
            return vf * scale, {"critic/vf_loss": vf.detach(), "critic/vf_clipfrac": m["vf_clipfrac"] * share,
                                "critic/vpred_mean": masked_mean(v.detach(), mask) * share}

        outs = self.run(micro, loss_fn, forward_only=False)
        out = self.sum_over_dp(_sum_metrics(outs))
        aux = self.moe_aux_loss(len(micro))
        if aux is not None:
            out["critic/moe_aux_loss"] = aux
        return out
