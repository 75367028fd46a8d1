"""The reward model in the PPO loop: a frozen critic-shaped GPTModel that scores whole sequences, and how its score
combines with the rule rewards.

`RewardModelWorker` is a `MegatronWorker` built from an HF `*ForSequenceClassification` checkpoint (one label):
parallel/model.py gives it the critic's scalar head, loaded from HF's `score.weight` through the family table, on its
own layout (`reward_model.megatron.*`). Its score of a prompt + response is the head's output at the sequence's last
token (the last response token), which is where HF's `*ForSequenceClassification` reads it (the last non-pad token).
Like the reference it frees the device between phases when `reward_model.offload` is on (`resident()`).

`combine_rewards` applies `reward_model.combine`: `fallback` (the rule reward where the row's data source has a rule
function, the weighted model score elsewhere) or `sum` (rule reward, 0 where none, + weighted model score), and logs
reward/model_mean, reward/rule_mean and reward/rule_frac. `reward_model_problems` holds the reward model's files
against the run (score head, tokenizer) before any model is built.
"""
from __future__ import annotations

import contextlib
import os
from typing import Sequence

import torch

from tripod.engine.workers.batch import PPOBatch, split_rows
from tripod.engine.workers.megatron_worker import MegatronWorker
from tripod.engine.workers.model_options import layout_of, model_options
from tripod.parallel.arch import ModelArch, arch_from_hf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


class RewardModelWorker(MegatronWorker):
    """A frozen reward model on its own layout: `score(sequences)` -> one float per sequence on every rank."""

    def __init__(self, arch: ModelArch, layout, hf_dir: str, *, pad_token_id: int, offload: bool = False,
                 retokenize: tuple | None = None, **options) -> None:
        """`retokenize`: (the actor's tokenizer, the reward model's) to re-encode every sequence as text; None when
        both share one tokenizer. `options`: MegatronWorker's (seed, precision, sequence_parallel, ...)."""
        if not arch.score_head:
            raise ValueError(f"{hf_dir}: not a *ForSequenceClassification checkpoint (no score head)")
        super().__init__("reward_model", arch, layout, hf_dir, value_head=True, trainable=False,
                         share_prompt_prefix=False, **options)
        self.pad_token_id, self.retokenize, self.offload = pad_token_id, retokenize, offload
        if offload:
            self._move_params(torch.device("cpu"))

    @contextlib.contextmanager
    def resident(self):
        """Parameters on the compute device while it scores, on the host between scorings with `offload` (the
        reward model sits outside the PPO phases that runtime/offload.py moves)."""
        if self.offload:
            self._move_params(self._device)
        try:
            yield
        finally:
            if self.offload:
                self._move_params(torch.device("cpu"))

    def score(self, sequences: Sequence[Sequence[int]], micro: int | None) -> list[float]:
        """The reward model's score of each token sequence (prompt + response, actor token ids), on every rank."""
        if self.retokenize is not None:
            actor_tok, rm_tok = self.retokenize
            texts = actor_tok.batch_decode([list(s) for s in sequences], skip_special_tokens=False)
            sequences = [rm_tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        with self.resident():
            return score_sequences(self, sequences, micro, self.pad_token_id)


def sequence_batch(sequences: Sequence[Sequence[int]], pad_token_id: int) -> PPOBatch:
    """Token sequences right-padded into one batch, with `last`: the index of each row's last token."""
    ids = torch.full((len(sequences), max(len(s) for s in sequences)), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, :len(s)] = 1
    return PPOBatch({"input_ids": ids, "attention_mask": mask, "last": mask.sum(-1) - 1})


def last_token_scores(output: torch.Tensor, mb: PPOBatch) -> torch.Tensor:
    """[b] scores of a scalar-head model's output [b, s, 1] at each row's last token (`sequence_batch`'s `last`)."""
    return output[torch.arange(mb.size, device=output.device), mb["last"], 0].float()


def score_sequences(worker: MegatronWorker, sequences: Sequence[Sequence[int]], micro: int | None,
                    pad_token_id: int) -> list[float]:
    """Forward-only scores of a scalar-head worker (a reward model, trained or frozen) for every sequence, on every
    rank of its layout. Rows are split over its DP ranks in `micro`-row micro-batches (None: all of a rank's rows);
    the batch is padded with copies of its first row up to a multiple of DP x micro, and those scores dropped."""
    n, dp = len(sequences), worker.layout.dp
    per_rank = -(-n // dp)
    micro = min(micro or per_rank, per_rank)
    per_rank = -(-per_rank // micro) * micro
    rows = list(sequences) + [sequences[0]] * (per_rank * dp - n)
    mine = sequence_batch(rows, pad_token_id).select(worker.dp_rows(len(rows)))
    micro_batches = [mine.select(s) for s in split_rows(mine.size, mine.size // micro)]

    def loss_fn(output, mb):
        s = last_token_scores(output, mb)
        return s.sum() * 0.0, {"scores": s.detach()}

    outs = worker.run(micro_batches, loss_fn, forward_only=True)
    local = torch.cat([o["scores"] for o in outs]) if outs else None
    return worker.gather_rows(local, (), len(rows))[:n].tolist()


def combine_rewards(rule: Sequence[float | None], model: Sequence[float], combine: str,
                    weight: float) -> tuple[list[float], dict[str, float]]:
    """Each row's reward from its rule reward (None: its data source has no rule function) and the reward model's
    score, as `reward_model.combine` says (module docstring); with the metrics of both."""
    if len(rule) != len(model):
        raise ValueError(f"{len(rule)} rule rewards but {len(model)} reward-model scores")
    if combine == "fallback":
        out = [r if r is not None else weight * m for r, m in zip(rule, model)]
    elif combine == "sum":
        out = [(r or 0.0) + weight * m for r, m in zip(rule, model)]
    else:
        raise ValueError(f"reward_model.combine={combine!r} is not one of ['fallback', 'sum']")
    ruled = [r for r in rule if r is not None]
    metrics = {"reward/model_mean": sum(model) / len(model), "reward/rule_frac": len(ruled) / len(rule)}
    if ruled:
        metrics["reward/rule_mean"] = sum(ruled) / len(ruled)
    return out, metrics


def rule_rewards_where_defined(pool, texts: list[str], ground_truths: list, data_sources: list[str],
                               extra_infos: list | None) -> tuple[list[float | None], dict[str, float]]:
    """The rule pool's rewards of the rows whose data source has a rule function, None for the others."""
    from tripod.engine.rewards import registered_data_sources

    known = set(registered_data_sources())
    rows = [i for i, s in enumerate(data_sources) if s in known]
    out: list[float | None] = [None] * len(texts)
    if not rows:
        return out, {}
    pick = lambda xs: [xs[i] for i in rows]  # noqa: E731
    scores, metrics = pool.score(pick(texts), pick(ground_truths), pick(data_sources),
                                 pick(extra_infos) if extra_infos else None)
    for i, s in zip(rows, scores):
        out[i] = s
    return out, metrics


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def reward_model_problems(cfg, actor_tokenizer) -> list[str]:
    """What is wrong with `reward_model.*` for this run, each one line naming the key and the fix (nothing is built):
    the checkpoint must be a *ForSequenceClassification with its score head, and share the actor's tokenizer unless
    `reward_model.retokenize`."""
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.convert import SafetensorsReader

    rm = cfg.reward_model
    path, key = rm.model.path, "reward_model.model.path"
    try:
        arch = arch_from_hf(path)
    except (OSError, ValueError) as e:
        return [f"{key}={path}: {e}"]
    if not arch.score_head:
        return [f"{key}={path}: config.json architectures={arch.hf_config.get('architectures')} has no score head; "
                "point it at an HF *ForSequenceClassification checkpoint with num_labels=1 (tripod train-rm exports "
                "one)"]
    if "score.weight" not in SafetensorsReader(path).names():
        return [f"{key}={path}: its weights have no score.weight (the score head of the *ForSequenceClassification "
                "model its config.json names); re-save the reward model with save_pretrained"]
    actor_arch = arch_from_hf(cfg.actor_rollout_ref.model.path)
    if not _has_tokenizer(path):
        if rm.retokenize:
            return [f"reward_model.retokenize=true but {key}={path} has no tokenizer files ({', '.join(TOKENIZER_FILES)})"
                    "; save the reward model's tokenizer beside it"]
        if arch.vocab_size != actor_arch.vocab_size:
            return [f"{key}={path}: vocab_size={arch.vocab_size} differs from the actor's {actor_arch.vocab_size} and "
                    "it has no tokenizer files to re-tokenize with; use a reward model with the actor's tokenizer"]
        return []
    if rm.retokenize:
        return []
    from transformers import AutoTokenizer

    mine, theirs = AutoTokenizer.from_pretrained(path).get_vocab(), actor_tokenizer.get_vocab()
    if mine != theirs:
        differ = len(set(mine.items()) ^ set(theirs.items()))
        return [f"{key}={path}: its tokenizer differs from the actor's ({len(mine)} vs {len(theirs)} tokens, {differ} "
                "token ids differ); set reward_model.retokenize=true to decode the actor's text and re-encode it for "
                "the reward model, or use a reward model trained on the actor's tokenizer"]
    return []


def build_reward_model(rm, pad_token_id: int, actor_tokenizer) -> RewardModelWorker:
    """The PPO loop's reward model from the `reward_model` config section, on its own layout (`reward_model.megatron`)."""
    from transformers import AutoTokenizer

    arch = arch_from_hf(rm.model.path)
    layout = layout_of(rm.megatron, "reward_model", arch)
    retokenize = (actor_tokenizer, AutoTokenizer.from_pretrained(rm.model.path)) if rm.retokenize else None
    return RewardModelWorker(arch, layout, rm.model.path, pad_token_id=pad_token_id,
                             offload=any((rm.offload, rm.megatron.param_offload)), seed=rm.megatron.seed,
                             retokenize=retokenize, **model_options(rm.megatron, layout, "reward_model", arch, False))
