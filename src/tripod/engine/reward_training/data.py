"""Preference data for `tripod train-rm`: parquet rows -> tokenized (chosen, rejected) pairs, checked up front.

A row holds `prompt` and either `chosen` + `rejected`, or `ranking`: N >= 2 responses in preference order, which
gives its N(N-1)/2 ordered pairs (i preferred over j for every i < j; pairwise Bradley-Terry on all pairs, not the
Plackett-Luce likelihood). A sequence is prompt tokens + response tokens + EOS, and its score is read at that EOS.

Every problem (a missing column, chosen identical to rejected, a ranking of fewer than two responses or with a
repeated response, a pair longer than data.max_length) raises one ValueError naming the file, the row and the fix,
before any model is built. The order of pairs per epoch is a function of (data.seed, epoch) only, so every rank
and a resumed run see the same batches: `PairSchedule.batch(step)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

Pair = tuple[list[int], list[int]]  # (chosen tokens, rejected tokens)


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
            pairs += [(seqs[a], seqs[b]) for a in range(len(seqs)) for b in range(a + 1, len(seqs))]
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
