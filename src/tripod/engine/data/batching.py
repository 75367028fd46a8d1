"""Token-level batching helpers: dynamic micro-batches by token budget, padding, and remove/restore padding.

- `split_by_token_budget`: partition sequences into micro-batches whose token sums stay within a budget
  (`use_dynamic_bsz` / `ppo_max_token_len_per_gpu`), balanced by longest-processing-time-first greedy.
- `balanced_partition`: rows split into equal-count parts of balanced token sums (the DP ranks of a token-budget
  update).
- `pad_sequences`: ragged token lists -> a padded [b, s] tensor + attention mask (left padding for prompts).
- `unpad_input` / `pad_input`: a padded [b, s, ...] batch <-> one packed [1, total, ...] sequence with `cu_seqlens`
  (flash-attention's varlen convention; works for left or right padding since the mask defines the tokens).
"""
from __future__ import annotations

import heapq
import math
from typing import Sequence

import torch


def split_by_token_budget(seq_lens: Sequence[int], max_tokens_per_micro_batch: int,
                          min_num_micro_batches: int = 1) -> list[list[int]]:
    """Partition sequence indices into micro-batches of at most `max_tokens_per_micro_batch` tokens each.

    Uses the fewest micro-batches k >= max(min_num_micro_batches, ceil(total / budget)) for which the LPT greedy
    (longest first, into the lightest micro-batch) fits the budget, so loads are balanced: the heaviest and lightest
    micro-batch differ by at most the longest sequence. Pipeline-parallel training needs the same number of
    micro-batches on every DP rank: all-reduce(max) k across DP and pass it as `min_num_micro_batches`.
    Each micro-batch lists indices in ascending order; micro-batches are ordered by their first index.
    """
    lens = [int(n) for n in seq_lens]
    if max_tokens_per_micro_batch < 1:
        raise ValueError(f"max_tokens_per_micro_batch={max_tokens_per_micro_batch} must be >= 1 "
                         "(ppo_max_token_len_per_gpu)")
    if not lens:
        return []
    too_long = [(i, n) for i, n in enumerate(lens) if n > max_tokens_per_micro_batch]
    if too_long:
        i, n = max(too_long, key=lambda t: t[1])
        raise ValueError(f"sequence {i} has {n} tokens, more than the micro-batch budget "
                         f"max_tokens_per_micro_batch={max_tokens_per_micro_batch} ({len(too_long)} such "
                         "sequences); raise ppo_max_token_len_per_gpu to at least max_prompt_length + response_length")
    if min_num_micro_batches > len(lens):
        raise ValueError(f"min_num_micro_batches={min_num_micro_batches} exceeds the {len(lens)} sequences; "
                         "some micro-batches would be empty")
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    k = max(min_num_micro_batches, math.ceil(sum(lens) / max_tokens_per_micro_batch))
    while True:
        heap = [(0, b) for b in range(k)]  # (tokens, micro-batch id); ties go to the lower id
        groups: list[list[int]] = [[] for _ in range(k)]
        loads = [0] * k
        for i in order:
            load, b = heapq.heappop(heap)
            groups[b].append(i)
            loads[b] = load + lens[i]
            heapq.heappush(heap, (loads[b], b))
        if max(loads) <= max_tokens_per_micro_batch and all(groups):
            return sorted((sorted(g) for g in groups), key=lambda g: g[0])
        k += 1  # terminates: at k == len(lens) every sequence is alone and fits


def balanced_partition(seq_lens: Sequence[int], parts: int) -> list[list[int]]:
    """Split sequence indices into `parts` lists of equal count (n must divide by parts) whose token sums are balanced:
    longest first, each into the lightest part that still has room. Deterministic; each list ascending."""
    lens = [int(n) for n in seq_lens]
    if parts < 1 or len(lens) % parts:
        raise ValueError(f"cannot split {len(lens)} sequences into {parts} equal parts")
    room = len(lens) // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        b = min((b for b in range(parts) if len(groups[b]) < room), key=lambda b: (loads[b], b))
        groups[b].append(i)
        loads[b] += lens[i]
    return [sorted(g) for g in groups]


def pad_sequences(seqs: Sequence[Sequence[int]], pad_value: int, side: str = "left",
                  length: int | None = None, dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged lists -> (padded [b, s] tensor, attention_mask [b, s] of 0/1 int64); `length` defaults to the longest."""
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r} must be 'left' or 'right'")
    longest = max((len(s) for s in seqs), default=0)
    length = longest if length is None else length
    if longest > length:
        raise ValueError(f"a sequence has {longest} tokens, more than length={length}")
    out = torch.full((len(seqs), length), pad_value, dtype=dtype)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for row, s in enumerate(seqs):
        if not len(s):
            continue
        cols = slice(length - len(s), length) if side == "left" else slice(0, len(s))
        out[row, cols] = torch.as_tensor(list(s), dtype=dtype)
        mask[row, cols] = 1
    return out, mask


def unpad_input(x: torch.Tensor, attention_mask: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Pack the real tokens of a padded batch into one sequence.

    x: [b, s, ...]; attention_mask: [b, s] (nonzero = real token). Returns (packed [1, total, ...], indices [total]
    into the flattened [b*s] positions, cu_seqlens int32 [b+1], max_seqlen). Row order and token order are kept.
    """
    if x.shape[:2] != attention_mask.shape:
        raise ValueError(f"x has shape {tuple(x.shape)} but attention_mask has {tuple(attention_mask.shape)}; "
                         "their first two dims ([batch, seq]) must match")
    mask = attention_mask.bool()
    seqlens = mask.sum(dim=1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    packed = x.reshape(-1, *x.shape[2:])[indices].unsqueeze(0)
    return packed, indices, cu_seqlens, int(seqlens.max().item()) if seqlens.numel() else 0


def pad_input(packed: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int,
              pad_value: float = 0) -> torch.Tensor:
    """Inverse of `unpad_input`: packed [1, total, ...] or [total, ...] -> [batch, seqlen, ...], pads = pad_value."""
    flat = packed.squeeze(0) if packed.dim() > 1 and packed.shape[0] == 1 and packed.shape[1] == indices.numel() \
        else packed
    if flat.shape[0] != indices.numel():
        raise ValueError(f"packed has {flat.shape[0]} tokens but indices has {indices.numel()}")
    out = flat.new_full((batch * seqlen, *flat.shape[1:]), pad_value)
    out[indices] = flat
    return out.reshape(batch, seqlen, *flat.shape[1:])


def packed_position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Position ids [1, total] restarting at 0 for each packed sequence."""
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), seqlens)
    return (torch.arange(int(cu_seqlens[-1]), dtype=torch.long) - starts).unsqueeze(0)
