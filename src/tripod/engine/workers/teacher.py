"""The distillation teacher: a frozen megatron model on its own layout, scoring the student's rollouts, and the
student's side of the distillation loss inside the actor's update.

The teacher is a `PolicyWorker` (like the reference: trainable=False, no optimizer) built from
`distillation.teacher_models.<name>.model_path` with its own architecture (any size, the student's tokenizer:
engine/config/distillation.py checks it before any model is built) and its own `megatron` layout. After the
reference pass it adds to the step's batch either the log-probs of the sampled tokens ("teacher_log_probs" [N, R],
the estimator modes; `compute_log_probs`, exactly the reference's pass) or its top-k at every response position
("teacher_topk_log_probs" / "teacher_topk_ids" [N, R, k], forward_kl_topk; `compute_topk`, chunked over the vocab
and its TP shards: engine/algorithms/topk_logprobs.py). Its rows come whole to every rank (its DP split is its own),
so the trainer keeps the batch whole when distilling.

`distillation_term` is the block the actor's `_update_mini_batch` calls after its KL-loss term; `reduce_extrema`
turns the per-micro-batch distillation/loss_min|max into the mini-batch's (min / max over micro-batches and DP).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tripod.engine.algorithms.distillation import (
    TopkTerms,
    combine,
    distillation_loss,
    forward_kl_topk,
    per_token_loss,
    topk_metrics,
)
from tripod.engine.algorithms.topk_logprobs import logprobs_at_ids, topk_from_hidden
from tripod.engine.workers.batch import PPOBatch
from tripod.engine.workers.megatron_worker import MegatronWorker
from tripod.engine.workers.ppo_workers import PolicyWorker, _forward_microbatches, _in_row_order

EXTREMA = ("distillation/loss_min", "distillation/loss_max")


def _head(worker: MegatronWorker, output: torch.Tensor, mb: PPOBatch):
    """(hidden [K, H] at the real response positions, their [N, R] mask or None, the LM head weight, tp group,
    whether the hidden gradient still needs its TP reduction) of a last-stage output: as `token_logprobs` reads it."""
    real = mb.tensors.get("response_mask")
    hidden, picked = worker.response_outputs(output, mb, None if real is None else real > 0)
    m = worker.module
    weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight
    tp = worker.layout.tp_group if worker.layout.tp > 1 else None
    return hidden, picked, weight, tp, not m.config.sequence_parallel


def _rows(values: torch.Tensor, picked: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    """[K, k] results at the picked positions -> [N, R, k] (zeros elsewhere)."""
    if picked is None:
        return values.reshape(*shape, values.shape[-1])
    out = values.new_zeros((*shape, values.shape[-1]))
    out[picked.to(values.device)] = values
    return out


class TeacherWorker(PolicyWorker):
    """The frozen teacher (see the module docstring): `compute_log_probs` as the reference, plus `compute_topk`."""

    def compute_topk(self, batch: PPOBatch, micro: int, temperature: float, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, ids) [N, R, k] of the teacher's k most likely tokens at every response position of `batch`,
        on every rank (gathered over the teacher's DP group)."""
        n, r = batch.size, batch["responses"].shape[1]
        mbs, order = _forward_microbatches(self, batch, micro, None)

        def loss_fn(output, mb):
            hidden, picked, weight, tp, _ = _head(self, output, mb)
            logp, ids = topk_from_hidden(hidden.detach(), weight.detach(), k, temperature=temperature, tp_group=tp,
                                         vocab_size=self.arch.vocab_size)
            shape = tuple(mb["responses"].shape)
            return hidden.sum() * 0.0, {"logp": _rows(logp.float(), picked, shape), "ids": _rows(ids, picked, shape)}

        outs = self.run(mbs, loss_fn, forward_only=True)
        logp = _in_row_order(torch.cat([o["logp"] for o in outs]) if outs else None, order)
        ids = _in_row_order(torch.cat([o["ids"] for o in outs]) if outs else None, order)
        return (self.gather_rows(logp, (r, k), n), self.gather_rows(ids, (r, k), n, dtype=torch.long))


def build_teacher(cfg) -> TeacherWorker:
    """The teacher of `cfg.distillation` on its own layout and architecture (frozen, no optimizer)."""
    from tripod.engine.workers.model_options import layout_of, model_options
    from tripod.parallel.arch import arch_from_hf

    name, t = cfg.distillation.teacher()
    arch = arch_from_hf(t.model_path)
    key = f"distillation.teacher_models.{name}"
    layout = layout_of(t.megatron, "teacher", arch)
    return TeacherWorker("teacher", arch, layout, t.model_path, trainable=False, seed=t.megatron.seed,
                         share_prompt_prefix=cfg.actor_rollout_ref.actor.share_prompt_prefix,
                         remove_padding=cfg.actor_rollout_ref.model.use_remove_padding,
                         **model_options(t.megatron, layout, key, arch, False))


def teacher_pass(teacher: TeacherWorker, batch: PPOBatch, cfg, temperature: float) -> None:
    """The teacher's scores of the step's rows into `batch` (see the module docstring)."""
    dcfg = cfg.distillation
    _, t = dcfg.teacher()
    micro = t.log_prob_micro_batch_size_per_gpu or batch.size
    if dcfg.distillation_loss.use_topk:
        logp, ids = teacher.compute_topk(batch, micro, temperature, int(dcfg.distillation_loss.topk))
        batch["teacher_topk_log_probs"], batch["teacher_topk_ids"] = logp, ids
    else:
        batch["teacher_log_probs"], _ = teacher.compute_log_probs(batch, micro, temperature)


def student_topk_terms(worker: MegatronWorker, output: torch.Tensor, mb: PPOBatch, temperature: float,
                       loss_cfg) -> TopkTerms:
    """forward_kl_topk's per-token terms of the student's forward `output` against the teacher's top-k in `mb`
    (differentiable through the student's log-probs at the teacher's ids), with the top-k overlap diagnostics."""
    hidden, picked, weight, tp, reduce_grad = _head(worker, output, mb)
    ids = mb["teacher_topk_ids"].to(hidden.device)
    k = ids.shape[-1]
    flat_ids = ids.reshape(-1, k) if picked is None else ids[picked.to(ids.device)]
    at_ids = logprobs_at_ids(hidden, weight, flat_ids, temperature=temperature, tp_group=tp,
                             vocab_size=worker.arch.vocab_size, reduce_hidden_grad=reduce_grad)
    _, own = topk_from_hidden(hidden.detach(), weight.detach(), k, temperature=temperature, tp_group=tp,
                              vocab_size=worker.arch.vocab_size)
    shape = tuple(mb["responses"].shape)
    return forward_kl_topk(_rows(at_ids.float(), picked, shape), mb["teacher_topk_log_probs"], ids,
                           loss_cfg.log_prob_min_clamp, _rows(own, picked, shape))


def distillation_term(worker: MegatronWorker, output: torch.Tensor, mb: PPOBatch, task_loss: torch.Tensor,
                      logp: torch.Tensor, old: torch.Tensor, norm, share: torch.Tensor, actor_cfg, dcfg,
                      temperature: float, extrema: list) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the actor's micro-batch loss with distillation, its distillation/* metrics as shares of the mini-batch):
    verl's distillation_ppo_loss on one micro-batch. `extrema` collects the loss_min / loss_max of each."""
    loss_cfg, mask = dcfg.distillation_loss, mb["response_mask"]
    terms = student_topk_terms(worker, output, mb, temperature, loss_cfg) if loss_cfg.use_topk else None
    losses = per_token_loss(loss_cfg.loss_mode, logp, mb.tensors.get("teacher_log_probs"), terms)
    distill, m = distillation_loss(losses, mask, loss_cfg, actor_cfg.loss_agg_mode, norm, logp, old,
                                   mb.tensors.get("rollout_is_weights"))
    extrema.append({k: m.pop(k) for k in EXTREMA if k in m})
    if terms is not None:
        m.update(topk_metrics(terms, mask, int(loss_cfg.topk)))
    metrics = {k: v * share for k, v in m.items()}  # token means over this micro-batch -> shares of the mini-batch
    metrics["distillation/loss"] = distill.detach()  # a share already (global normaliser)
    return combine(task_loss, distill, loss_cfg), metrics


def reduce_extrema(worker: MegatronWorker, extrema: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """distillation/loss_min|max of the mini-batch: min / max over this rank's micro-batches (the last pipeline
    stage's), then over the DP group; on every rank of the layout."""
    lay = worker.layout
    lo = min((float(e[EXTREMA[0]]) for e in extrema if e), default=float("inf"))
    hi = max((float(e[EXTREMA[1]]) for e in extrema if e), default=float("-inf"))
    t = torch.tensor([-lo, hi], dtype=torch.float64, device=worker.device)
    if lay.pp > 1:
        dist.broadcast(t, src=lay.group_ranks("pp")[-1], group=lay.pp_group)
    if lay.dp > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=lay.dp_group)
    if not torch.isfinite(t).all():  # no counted token in the mini-batch: keep the keys (metrics average per key)
        return {EXTREMA[0]: 0.0, EXTREMA[1]: 0.0}
    return {EXTREMA[0]: -float(t[0]), EXTREMA[1]: float(t[1])}


def describe_teacher(teacher: TeacherWorker, dcfg) -> str:
    """The one line printed at start: the teacher, its layout and the loss."""
    name, t = dcfg.teacher()
    lc, lay = dcfg.distillation_loss, teacher.layout
    mode = lc.loss_mode + (f" (top-{lc.topk})" if lc.use_topk else "")
    how = "as advantages of a clipped policy loss" if lc.use_policy_gradient else "backpropagated"
    task = f"plus the task loss (coef {lc.distillation_loss_coef:g})" if lc.use_task_rewards else "replacing the task loss"
    return (f"distillation: teacher {name} = {t.model_path} ({teacher.arch.num_layers} layers) at TP{lay.tp} PP{lay.pp} "
            f"DP{lay.dp}; loss {mode}, {how}, {task}")
