"""`tripod train-sft`'s loop: a causal LM on any Megatron layout trained on chat rows, loss on assistant tokens only.

Each step takes data.train_batch_size conversations (`PairSchedule`: a permutation per epoch seeded by data.seed,
so every rank and a resumed run see the same batches), splits them over DP ranks and into micro-batches of
data.micro_batch_size_per_gpu rows, and minimises the token-mean negative log-likelihood of the assistant tokens over
the whole step (verl's SFT normalisation: the sum over the step's assistant tokens divided by their global count;
what transformers' causal-LM loss gives with labels -100 outside them). A conversation is laid out as the PPO batch's
`prompt | response` with its first token as the prompt and the rest as the response, so the PPO workers' machinery
reads it: padding-free packing (model.use_remove_padding, engine/workers/packing.py), the log-probs straight from the
hidden state (no [tokens, vocab] logits), every layout. Loss scaling is engine/workers/ppo_workers.py's: each
micro-batch's loss is its share of the global sum, times num_microbatches x DP (megatron divides by both).

Logged: train/loss, train/tokens (assistant tokens of the step), train/grad_norm, train/lr; val/loss (token-mean over
every held-out conversation) per validation. Checkpoints are `tripod train`'s (CheckpointManager: atomic, model part
`actor` with its optimizer and LR schedule, rng, step; trainer.max_ckpt_to_keep), resume is exact, and the end exports
`<run dir>/hf` (an HF causal LM with the tokenizer) for `tripod train`'s actor_rollout_ref.model.path.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tripod.engine.reward_training.data import PairSchedule
from tripod.engine.sft.data import ChatRow, chat_rows
from tripod.engine.supervised_loop import SupervisedLoop
from tripod.engine.workers.batch import PPOBatch, build_ppo_batch, split_rows
from tripod.engine.workers.megatron_worker import MegatronWorker

CONSOLE_KEYS = ("train/loss", "val/loss", "train/lr")
MODEL = "actor"  # the checkpoint part's name: what `tripod export` and tripod train's checkpoints call a causal LM


def sft_batch(rows: list[ChatRow], pad_id: int) -> PPOBatch:
    """Conversations as a PPO batch: prompt = the first token, response = the rest (`response_mask` 1 on every real
    token, which the packing reads), and `loss_mask` [N, R]: 1 where the response token is an assistant token."""
    width = max(len(r.ids) for r in rows) - 1
    batch = build_ppo_batch([r.ids[:1] for r in rows], [r.ids[1:] for r in rows], max(width, 1), pad_id,
                            list(range(len(rows))))
    loss_mask = torch.zeros_like(batch["response_mask"])
    for i, r in enumerate(rows):
        loss_mask[i, :len(r.ids) - 1] = torch.tensor(r.mask[1:], dtype=loss_mask.dtype)
    batch["loss_mask"] = loss_mask
    return batch


def assistant_nll(worker: MegatronWorker, output: torch.Tensor, mb: PPOBatch) -> torch.Tensor:
    """Sum over the micro-batch's assistant tokens of -log p(token | everything before it)."""
    logp, _ = worker.token_logprobs(output, mb, 1.0, False)
    return -(logp * mb["loss_mask"].to(logp.device)).sum()


def token_count(rows: list[ChatRow]) -> int:
    """Assistant tokens the loss covers in `rows` (a conversation's first token is never predicted)."""
    return sum(sum(r.mask[1:]) for r in rows)


class SFTTrainer(SupervisedLoop):
    part, command, console_keys = MODEL, "tripod train-sft", CONSOLE_KEYS

    def __init__(self, cfg) -> None:
        from transformers import AutoTokenizer

        from tripod.engine.checkpoints import CheckpointManager
        from tripod.engine.workers.model_options import layout_of, model_options
        from tripod.parallel.arch import arch_from_hf

        self.cfg, self.rank, self.world = cfg, dist.get_rank(), dist.get_world_size()
        path, d, m = cfg.model.path, cfg.data, cfg.megatron
        self.run_dir = cfg.trainer.default_local_dir
        self.tokenizer = AutoTokenizer.from_pretrained(d.tokenizer or path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.tokenizer_dir = os.path.join(self.run_dir, "tokenizer")
        if self.rank == 0:
            self.tokenizer.save_pretrained(self.tokenizer_dir)
        self.train_rows = chat_rows(d.train_files, self.tokenizer, d)
        self.val_rows = chat_rows(d.val_files, self.tokenizer, d) if d.val_files else []
        self.schedule = PairSchedule(len(self.train_rows), d.train_batch_size, d.shuffle, d.seed)
        if self.schedule.steps_per_epoch < 1:
            raise ValueError(f"data.train_files hold {len(self.train_rows)} rows < data.train_batch_size="
                             f"{d.train_batch_size}; lower the batch size or add rows")
        t = cfg.trainer
        self.total_steps = t.total_training_steps or t.total_epochs * self.schedule.steps_per_epoch
        self.arch = arch_from_hf(path)
        layout = layout_of(m, MODEL, self.arch)
        self.worker = MegatronWorker(
            MODEL, self.arch, layout, path, trainable=True, optim=cfg.optim, grad_clip=cfg.grad_clip,
            total_steps=self.total_steps, seed=m.seed, share_prompt_prefix=False,
            remove_padding=cfg.model.use_remove_padding,
            **model_options(m, layout, "megatron", self.arch, True, cfg.optim.optimizer))
        self.ckpt = CheckpointManager(os.path.join(self.run_dir, "checkpoints"), self.arch, self.tokenizer_dir,
                                      keep={MODEL: t.max_ckpt_to_keep})
        dist.barrier()  # the tokenizer directory is written before any checkpoint copies it
        self.step = 0

    def has_validation(self) -> bool:
        return bool(self.val_rows)

    # ---- one step ---------------------------------------------------------------------------------
    def _micro_batches(self, rows: list[ChatRow]) -> list[PPOBatch]:
        micro = self.cfg.data.micro_batch_size_per_gpu
        return [sft_batch(rows[s], self.pad_id) for s in split_rows(len(rows), len(rows) // micro)]

    def train_step(self) -> dict[str, float]:
        w = self.worker
        rows = [self.train_rows[i] for i in self.schedule.batch(self.step)]
        total = token_count(rows)  # every rank: the whole step's assistant tokens
        batches = self._micro_batches(rows[w.dp_rows(len(rows))])
        scale = len(batches) * w.layout.dp

        def loss_fn(output, mb):
            nll = assistant_nll(w, output, mb)
            return nll / total * scale, {"train/loss": nll.detach() / total}

        outs = w.run(batches, loss_fn, forward_only=False)
        metrics = w.sum_over_dp({"train/loss": sum(float(o["train/loss"]) for o in outs)})
        metrics.update({"train/tokens": float(total), "train/lr": w.lr})
        metrics["train/grad_norm"] = w.step()
        return metrics

    def validate(self) -> dict[str, float]:
        """Token-mean NLL of the assistant tokens of every held-out conversation (forward only, every rank). The rows
        are padded to a multiple of DP x micro-batch with copies of the first whose loss mask is zero."""
        if not self.val_rows:
            return {}
        w, micro = self.worker, self.cfg.data.micro_batch_size_per_gpu
        n, dp = len(self.val_rows), w.layout.dp
        padded = -(-n // (dp * micro)) * dp * micro
        filler = ChatRow(self.val_rows[0].ids, [0] * len(self.val_rows[0].ids))
        rows = self.val_rows + [filler] * (padded - n)
        outs = w.run(self._micro_batches(rows[w.dp_rows(len(rows))]),
                     lambda output, mb: (output.sum() * 0.0, {"nll": assistant_nll(w, output, mb).detach()}),
                     forward_only=True)
        nll = w.sum_over_dp({"nll": sum(float(o["nll"]) for o in outs)})["nll"]
        return {"val/loss": nll / token_count(self.val_rows)}

