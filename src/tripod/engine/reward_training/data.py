"""Preference data for `tripod train-rm`: parquet rows -> tokenized (chosen, rejected) pairs, checked up front.

A row holds `prompt` and either `chosen` + `rejected`, or `ranking`: N >= 2 responses in preference order, which
gives its N(N-1)/2 ordered pairs (i preferred over j for every i < j; pairwise Bradley-Terry on all pairs, not the
Plackett-Luce likelihood). Each pair remembers its row's N, so `pair_weight` can weight a prompt's comparisons 1/C(N,2)
(`reward_model.ranking_weight: per_prompt`, InstructGPT's weighting) or every pair alike (`per_pair`). A sequence is
prompt tokens + response tokens + EOS, and its score is read at that EOS; `score_pad_token` picks the pad token the
exported model gets, one that is not the EOS, so transformers' rule (the rightmost token that is not padding) reads
that same EOS.

Every problem (a missing column, chosen identical to rejected, a ranking of fewer than two responses or with a
repeated response, a pair longer than data.max_length) raises one ValueError naming the file, the row and the fix,
before any model is built. The order of pairs per epoch is a function of (data.seed, epoch) only, so every rank
and a resumed run see the same batches: `PairSchedule.batch(step)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

RANKING_WEIGHTS = ("per_pair", "per_prompt")


class Pair(NamedTuple):
    """One comparison: the preferred and the dispreferred token sequence, and how many responses its row held (2 for
    a chosen/rejected row, N for a ranking)."""

    chosen: list[int]
    rejected: list[int]
    responses: int = 2


def pair_weight(pair: Pair, ranking_weight: str) -> float:
    """The pair's weight in the loss and metrics: 1 (`per_pair`), or 1/C(N,2) for a row of N responses
    (`per_prompt`: every prompt weighs as much as one chosen/rejected pair, however many responses it ranks)."""
    if ranking_weight == "per_pair":
        return 1.0
    if ranking_weight == "per_prompt":
        return 2.0 / (pair.responses * (pair.responses - 1))
    raise ValueError(f"reward_model.ranking_weight={ranking_weight!r} is not one of {list(RANKING_WEIGHTS)}")


def score_pad_token(tokenizer: Any) -> str:
    """The pad token of a trained reward model: the tokenizer's own when it is not the EOS, else its unknown token, else
    its first other special or added token. transformers' *ForSequenceClassification reads the rightmost token that
    is not `pad_token_id`; a pad equal to the EOS would make it skip the EOS every sequence ends with, where tripod
    reads (and trains) the score."""
    eos = tokenizer.eos_token_id
    added = [t.content for _, t in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())]
    for token in [tokenizer.pad_token, tokenizer.unk_token, *tokenizer.all_special_tokens, *added]:
        if token is not None and tokenizer.convert_tokens_to_ids(token) not in (None, eos):
            return token
    raise ValueError(f"the tokenizer has no token but its EOS {tokenizer.eos_token!r} to pad with, and a reward model "
                     "padded with its EOS is scored at another token by transformers; add a pad_token to its "
                     "tokenizer_config.json (data.tokenizer)")


def _column(table: dict[str, list], key: str) -> list | None:
    return table.get(key)


def preference_pairs(files: list[str], tokenizer: Any, cfg) -> list[Pair]:
    """Every (chosen, rejected) token pair of the parquet `files` (`cfg`: the data section), in file order."""
    import pyarrow.parquet as pq

    pairs: list[Pair] = []
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token; the reward is read at the EOS after each response: set one "
                         "in its tokenizer_config.json (data.tokenizer)")
    for path in files:
        try:
            table = pq.read_table(path).to_pydict()
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable parquet file ({e}); check data.train_files / data.val_files")
        prompts = _column(table, cfg.prompt_key)
        if prompts is None:
            raise ValueError(f"{path}: no '{cfg.prompt_key}' column (data.prompt_key); it has {sorted(table)}")
        chosen, rejected = _column(table, cfg.chosen_key), _column(table, cfg.rejected_key)
        ranking = _column(table, cfg.ranking_key)
        if ranking is None and (chosen is None or rejected is None):
            missing = [k for k, v in ((cfg.chosen_key, chosen), (cfg.rejected_key, rejected)) if v is None]
            raise ValueError(f"{path}: no {' and no '.join(repr(m) for m in missing)} column (data.chosen_key / "
                             f"data.rejected_key), and no '{cfg.ranking_key}' column (data.ranking_key); it has "
                             f"{sorted(table)}: give each row chosen + rejected, or a ranking")
        for i, prompt in enumerate(prompts):
            ordered = _ordered_responses(path, i, cfg, chosen, rejected, ranking)
            prompt_ids = _prompt_tokens(tokenizer, prompt, cfg.apply_chat_template)
            seqs = [prompt_ids + tokenizer(r, add_special_tokens=False)["input_ids"] + [eos] for r in ordered]
            longest = max(len(s) for s in seqs)
            if longest > cfg.max_length:
                raise ValueError(f"{path} row {i}: {longest} tokens (prompt + response + EOS) > data.max_length="
                                 f"{cfg.max_length}; raise data.max_length or drop the row")
            pairs += [Pair(seqs[a], seqs[b], len(seqs)) for a in range(len(seqs)) for b in range(a + 1, len(seqs))]
    return pairs


def _ordered_responses(path: str, i: int, cfg, chosen, rejected, ranking) -> list[str]:
    """The row's responses in preference order, checked."""
    ranked = ranking[i] if ranking is not None else None
    if ranked is not None:
        responses = list(ranked)
        if len(responses) < 2:
            raise ValueError(f"{path} row {i}: '{cfg.ranking_key}' has {len(responses)} response(s); a ranking needs "
                             ">= 2 responses in preference order: add responses or drop the row")
        key = cfg.ranking_key
    else:
        if chosen is None or rejected is None or chosen[i] is None or rejected[i] is None:
            raise ValueError(f"{path} row {i}: neither a '{cfg.ranking_key}' nor both '{cfg.chosen_key}' and "
                             f"'{cfg.rejected_key}'; fill them or drop the row")
        responses, key = [chosen[i], rejected[i]], f"{cfg.chosen_key}/{cfg.rejected_key}"
    if len(set(responses)) < len(responses):
        raise ValueError(f"{path} row {i}: identical responses in '{key}' (a pair that prefers a response over "
                         "itself); drop the row or fix the duplicate")
    return responses


def _prompt_tokens(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


@dataclass
class PairSchedule:
    """Which pairs each optimizer step trains on: epoch e is a permutation of the pairs (seeded by seed and e when
    `shuffle`) cut into `batch_size` pairs per step; a last partial batch is dropped."""

    num_pairs: int
    batch_size: int
    shuffle: bool
    seed: int

    @property
    def steps_per_epoch(self) -> int:
        return self.num_pairs // self.batch_size

    def batch(self, step: int) -> list[int]:
        """Indices of the pairs of optimizer step `step` (0-based)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        order = torch.randperm(self.num_pairs, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch)) \
            if self.shuffle else torch.arange(self.num_pairs)
        return order[k * self.batch_size:(k + 1) * self.batch_size].tolist()
