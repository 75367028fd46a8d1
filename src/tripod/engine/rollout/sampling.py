"""Next-token selection from full-vocabulary logits: greedy, temperature, top-k, top-p, seeded.

`sample_next_token` is used by the embedded engine on every TP rank with identical logits and an
identically seeded torch.Generator; the engine then broadcasts TP rank 0's choice so the ranks can
never diverge. The returned log-prob follows the convention in engine/rollout/base.py:
log_softmax(logits / temperature) before truncation (temperature 1 when greedy).

A token is drawn by the inverse CDF (`draw`): one uniform number per row and a cumulative sum, where
torch.multinomial draws an exponential variate per vocabulary entry (~50 ms per step for 32 rows of a 49k
vocabulary on a CPU core, a tenth of a SmolLM2-135M decode step).
"""
from __future__ import annotations

from typing import Union

import torch

from tripod.engine.rollout.base import SamplingParams


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """True where a logit is NOT among the k largest of its row (ties at the k-th value are kept)."""
    if k < 1 or k >= logits.shape[-1]:
        return torch.zeros_like(logits, dtype=torch.bool)
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits < kth_largest


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """True outside the nucleus: the smallest set of most likely tokens whose mass reaches p.

    A token is kept when the mass of the tokens strictly more likely than it is < p, so the most
    likely token is always kept (same rule as HF's TopPLogitsWarper up to ties).
    """
    if p >= 1.0:
        return torch.zeros_like(logits, dtype=torch.bool)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def sampling_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits actually sampled from: /temperature, then -inf outside top-k and top-p."""
    scaled = logits.float() / params.temperature
    drop = top_k_mask(scaled, params.top_k) | top_p_mask(scaled, params.top_p)
    return scaled.masked_fill(drop, float("-inf"))


Generators = Union[torch.Generator, list[torch.Generator], None]


def uniforms(rows: int, generator: Generators, device: torch.device) -> torch.Tensor:
    """[rows, 1] float64 draws from U[0, 1): from one generator for the batch, or row r's from `generator[r]` (per-row
    streams: a row's draws then do not depend on which other rows share the batch, engine/agent/turns.py)."""
    if isinstance(generator, list):
        if len(generator) != rows:
            raise ValueError(f"{len(generator)} per-row generators for {rows} rows")
        return torch.stack([torch.rand(1, generator=g, dtype=torch.float64, device=g.device) for g in generator]
                           ).to(device) if rows else torch.zeros(0, 1, dtype=torch.float64, device=device)
    return torch.rand((rows, 1), generator=generator, dtype=torch.float64, device=device)


def draw(probs: torch.Tensor, generator: Generators) -> torch.Tensor:
    """One index per row of `probs` [N, V] (non-negative, rows need not sum to 1), index i with probability
    probs[row, i] / probs[row].sum(): the first i whose cumulative mass exceeds u * total for u ~ U[0, 1).
    An index of zero probability is never drawn (its cumulative mass equals the one before it)."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    u = uniforms(total.shape[0], generator, probs.device)
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # < total: an index exists
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)


def sample_next_token(logits: torch.Tensor, params: SamplingParams,
                      generator: Generators) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [N] int64, their log-probs [N] float32) for logits [N, V] of the real vocabulary; `generator`: one
    for the batch or one per row (`uniforms`)."""
    logits = logits.float()
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
        reported = torch.log_softmax(logits, dim=-1)
    else:
        probs = torch.softmax(sampling_logits(logits, params), dim=-1)
        tokens = draw(probs, generator)
        reported = torch.log_softmax(logits / params.temperature, dim=-1)
    return tokens, reported.gather(-1, tokens[:, None]).squeeze(-1)
