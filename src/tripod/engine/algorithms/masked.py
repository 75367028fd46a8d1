"""Masked statistics over response tokens and per-group (per-prompt) statistics.

`masked_mean` / `masked_whiten` reduce over the tokens a mask marks; `group_ids` turns verl-style
per-sample group ids (a LongTensor, or a list / array of any hashables such as uuid strings) into
dense ids 0..G-1, and `group_mean_std` computes every group's mean and unbiased std at once with
scatter ops (no Python loop over groups).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

WHITEN_EPS = 1e-8


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask.to(x.dtype)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask (0 when nothing counts)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) with mean and unbiased var over the masked tokens.

    Values outside the mask are transformed too (callers mask them). Needs >= 2 counted tokens.
    """
    if mask.shape != x.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)} but x has shape {tuple(x.shape)}; they must match")
    m = mask.to(x.dtype)
    count = m.sum()
    if count.item() < 2:
        raise ValueError(f"masked_whiten needs at least 2 tokens where mask is 1, got {int(count.item())}; "
                         "whitening over fewer tokens has no defined variance")
    mean = (x * m).sum() / count
    var = (((x - mean) ** 2) * m).sum() / (count - 1)
    whitened = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean


def group_ids(index: torch.Tensor | Sequence, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Dense group ids [batch_size] (LongTensor on device) and the number of groups."""
    if isinstance(index, torch.Tensor):
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dim() != 1:
            raise ValueError(f"index must be a 1-D integer tensor or a list of hashables, got a {index.dim()}-D "
                             f"{index.dtype} tensor")
        if len(index) != batch_size:
            raise ValueError(f"index has {len(index)} entries but the batch has {batch_size} samples")
        unique, dense = torch.unique(index.to(device), return_inverse=True)
        return dense, len(unique)
    try:
        labels = list(index)
    except TypeError:
        raise ValueError(f"index must be a LongTensor or a sequence of group ids, got {type(index).__name__}") from None
    if len(labels) != batch_size:
        raise ValueError(f"index has {len(labels)} entries but the batch has {batch_size} samples")
    dense_of: dict = {}
    try:
        dense = [dense_of.setdefault(label, len(dense_of)) for label in labels]
    except TypeError:
        raise ValueError("index entries must be hashable (ints, strings, uuids)") from None
    return torch.tensor(dense, dtype=torch.long, device=device), len(dense_of)


def group_mean_std(scores: torch.Tensor, ids: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, ...]:
    """Per-sample (group mean, group unbiased std, group size); a group of one gets mean 0, std 1."""
    size = torch.bincount(ids, minlength=num_groups).to(scores.dtype)
    total = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, ids, scores)
    mean = total / size
    sq_dev = (scores - mean[ids]) ** 2
    sum_sq = torch.zeros_like(total).index_add_(0, ids, sq_dev)
    std = (sum_sq / (size - 1).clamp(min=1)).sqrt()
    single = size < 2
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[ids], std[ids], size[ids]
