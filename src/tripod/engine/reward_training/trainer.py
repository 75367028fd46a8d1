"""`tripod train-rm`'s loop: a scalar-head GPTModel trained with the Bradley-Terry loss on preference pairs.

The model is the PPO loop's reward model (a critic-shaped GPTModel whose head is HF's `score`), built on any layout
from an HF causal LM (fresh score head) or *ForSequenceClassification checkpoint. Each step takes
data.train_batch_size pairs (`PairSchedule`), splits them over DP ranks and into micro-batches of
data.micro_batch_size_per_gpu pairs (the chosen and the rejected sequences of a pair in one micro-batch), and
minimises the weighted mean of `bradley_terry_loss` over the pairs (`pair_weight`: a ranking's pairs weigh
1/C(N,2) each under reward_model.ranking_weight=per_prompt, 1 under per_pair; accuracy and margin are weighted
alike). Loss scaling follows engine/workers/ppo_workers.py: each micro-batch's loss is its share of the global
(weighted) mean, times num_microbatches x DP to undo megatron's division by the number of micro-batches and its DP
averaging, so every layout computes the same gradient.

Logged (metrics.jsonl, TensorBoard, progress line): train/loss, train/accuracy (share of pairs with r_chosen >
r_rejected), train/margin (mean r_chosen - r_rejected), train/grad_norm, train/lr; per validation val/loss,
val/accuracy and val/margin on the held-out pairs. Checkpoints and resume are `tripod train`'s (CheckpointManager,
model "reward_model" with its optimizer and LR schedule); at the end the model is exported to `<run dir>/hf` as an
HF *ForSequenceClassification directory. Its config.json's `pad_token_id` and its tokenizer's pad token are
`score_pad_token`'s (never the EOS), so transformers scores every sequence, padded or not, at the EOS tripod trained
on; the checkpoints and the export take the tokenizer from `<run dir>/tokenizer`, written with that pad token.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tripod.engine.reward_training.data import Pair, PairSchedule, pair_weight, preference_pairs, score_pad_token
from tripod.engine.supervised_loop import SupervisedLoop
from tripod.engine.workers.batch import split_rows
from tripod.engine.workers.megatron_worker import MegatronWorker
from tripod.engine.workers.reward_model import last_token_scores, score_sequences, sequence_batch

CONSOLE_KEYS = ("train/loss", "train/accuracy", "train/margin", "val/accuracy", "val/margin", "train/lr")


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per-pair Bradley-Terry negative log-likelihood -log sigmoid(r_chosen - r_rejected) (softplus form: exact for
    large margins of either sign)."""
    return F.softplus(rejected - chosen)


def weighted_pair_sums(chosen: torch.Tensor, rejected: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over pairs of scores, each pair times its `weight` (`pair_weight`): the Bradley-Terry loss (differentiable),
    the accuracy (r_chosen > r_rejected) and the margin. Divided by the total weight they are the step's means."""
    weight = weight.to(chosen.dtype)
    return {"loss": (weight * bradley_terry_loss(chosen, rejected)).sum(),
            "accuracy": (weight * (chosen > rejected)).sum(), "margin": (weight * (chosen - rejected)).sum()}


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor, weight: torch.Tensor | None = None) -> dict[str, float]:
    """Loss, pairwise accuracy and margin over pairs of scores: means weighted by `weight` (None: every pair 1)."""
    weight = torch.ones_like(chosen) if weight is None else weight
    return {k: float(v / weight.sum()) for k, v in weighted_pair_sums(chosen, rejected, weight).items()}


class RewardModelTrainer(SupervisedLoop):
    part, command, console_keys = "reward_model", "tripod train-rm", CONSOLE_KEYS

    def __init__(self, cfg) -> None:
        from transformers import AutoTokenizer

        from tripod.engine.checkpoints import CheckpointManager
        from tripod.engine.workers.model_options import layout_of
        from tripod.engine.workers.moe_config import moe_config_overrides
        from tripod.parallel.arch import arch_from_hf, with_score_head
        from tripod.parallel.precision import resolve_precision

        self.cfg, self.rank, self.world = cfg, dist.get_rank(), dist.get_world_size()
        path, d, m = cfg.model.path, cfg.data, cfg.megatron
        self.run_dir = cfg.trainer.default_local_dir
        self.tokenizer = AutoTokenizer.from_pretrained(d.tokenizer or path)
        self.tokenizer.pad_token = score_pad_token(self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id
        self.tokenizer_dir = os.path.join(self.run_dir, "tokenizer")
        if self.rank == 0:
            self.tokenizer.save_pretrained(self.tokenizer_dir)
        self.train_pairs = preference_pairs(d.train_files, self.tokenizer, d)
        self.val_pairs = preference_pairs(d.val_files, self.tokenizer, d) if d.val_files else []
        self.schedule = PairSchedule(len(self.train_pairs), d.train_batch_size, d.shuffle, d.seed)
        if self.schedule.steps_per_epoch < 1:
            raise ValueError(f"data.train_files hold {len(self.train_pairs)} pairs < data.train_batch_size="
                             f"{d.train_batch_size}; lower the batch size or add pairs")
        t = cfg.trainer
        self.total_steps = t.total_training_steps or t.total_epochs * self.schedule.steps_per_epoch
        source = arch_from_hf(path)
        scored = with_score_head(source)  # config.json's pad_token_id: the exported tokenizer's (never the EOS)
        self.arch = dataclasses.replace(scored, hf_config={**scored.hf_config, "pad_token_id": self.pad_id})
        layout = layout_of(m, "reward_model", self.arch)
        self.worker = MegatronWorker(
            "reward_model", self.arch, layout, path, value_head=True, trainable=True, optim=cfg.optim,
            grad_clip=cfg.grad_clip, total_steps=self.total_steps, seed=m.seed, share_prompt_prefix=False,
            load_arch=None if source.score_head else source, sequence_parallel=m.sequence_parallel,
            virtual_pipeline_size=m.virtual_pipeline_model_parallel_size,
            precision=resolve_precision(m, layout.dp, True, cfg.optim.optimizer), use_te=m.use_te,
            config_overrides=moe_config_overrides(m, self.arch, "megatron"))
        self.ckpt = CheckpointManager(os.path.join(self.run_dir, "checkpoints"), self.arch, self.tokenizer_dir)
        self.ranking_weight = cfg.reward_model.ranking_weight
        dist.barrier()  # the tokenizer directory is written before any checkpoint copies it
        self.step = 0

    def has_validation(self) -> bool:
        return bool(self.val_pairs)

    # ---- one step ---------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        w, d = self.worker, self.cfg.data
        pairs = [self.train_pairs[i] for i in self.schedule.batch(self.step)]
        total = sum(pair_weight(p, self.ranking_weight) for p in pairs)  # every rank: the whole step's weight
        mine = pairs[w.dp_rows(len(pairs))]
        micro = d.micro_batch_size_per_gpu
        batches = [_pair_batch(mine[s], self.pad_id, self.ranking_weight)
                   for s in split_rows(len(mine), len(mine) // micro)]
        scale = len(batches) * w.layout.dp

        def loss_fn(output, mb):
            scores = last_token_scores(output, mb)
            chosen, rejected = scores.chunk(2)
            sums = weighted_pair_sums(chosen, rejected, mb["weight"].chunk(2)[0])
            return sums["loss"] / total * scale, {f"train/{k}": v.detach() / total for k, v in sums.items()}

        outs = w.run(batches, loss_fn, forward_only=False)
        summed: dict[str, float] = {}
        for o in outs:
            for k, v in o.items():
                summed[k] = summed.get(k, 0.0) + float(v)
        metrics = w.sum_over_dp(summed)
        metrics["train/lr"] = w.lr
        metrics["train/grad_norm"] = w.step()
        return metrics

    def validate(self) -> dict[str, float]:
        """Held-out pairwise accuracy, margin and loss (forward only, every rank)."""
        if not self.val_pairs:
            return {}
        seqs = [p.chosen for p in self.val_pairs] + [p.rejected for p in self.val_pairs]
        scores = torch.tensor(score_sequences(self.worker, seqs, self.cfg.data.micro_batch_size_per_gpu * 2,
                                              self.pad_id), dtype=torch.float64)
        chosen, rejected = scores.chunk(2)
        weight = torch.tensor([pair_weight(p, self.ranking_weight) for p in self.val_pairs], dtype=torch.float64)
        return {f"val/{k}": v for k, v in pair_metrics(chosen, rejected, weight).items()}


def _pair_batch(pairs: list[Pair], pad_id: int, ranking_weight: str):
    """A micro-batch of m pairs: rows 0..m-1 the chosen sequences, rows m..2m-1 the rejected ones; `weight` holds
    each pair's `pair_weight` on both of its rows."""
    batch = sequence_batch([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id)
    batch["weight"] = torch.tensor([pair_weight(p, ranking_weight) for p in pairs] * 2, dtype=torch.float64)
    return batch
