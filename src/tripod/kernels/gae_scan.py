"""Generalized advantage estimation as a reverse associative scan: `tripod.kernels.gae`.

GAE is the linear recurrence A_t = a_t + b_t * A_{t+1} (A_T = 0) with
    (a_t, b_t) = (delta_t, gamma * lam)  at counted tokens (mask 1),
    (a_t, b_t) = (0, 1)                  at masked tokens, which pass the running advantage through,
    delta_t = r_t + gamma * V_next(t) - V_t,  V_next(t) = value of the next counted token (0 if none).
So tool/observation tokens inside a multi-turn response do not break the chain, and rewards placed
on masked tokens are ignored. returns = A + V at every position; advantages at masked positions
hold the carried value (callers mask them). This is verl's multi-turn GAE, unwhitened.

Torch twin (CPU and reference): GAE's pairs have b_t in {gamma*lam, 1}, so `scan_counted` turns each block of the
recurrence into one float64 suffix sum weighted by powers of gamma*lam, with a carry between blocks (the fast path);
`reverse_linear_scan` solves the general recurrence (any b, including b = 0) as a blocked scan with no per-token
Python loop. Inside a block of
C tokens, A = L a + tail * carry with L[t, s] = prod_{k=t}^{s-1} b_k built by a cumulative
*product* (never a quotient of prefix products, so b = 0 and long spans of gamma*lam < 1 neither
divide by zero nor overflow; they underflow to 0 exactly as the true product does). The block
carries form the same recurrence one level up, solved recursively: O(log_C T) levels.
Triton (CUDA): one program per row walks the row back to front in blocks, each block one
`tl.associative_scan` with the carry from the block after it (kernels/_triton_gae.py).
Optional KL reward shaping r_t - kl_coef * kl(logp_t, ref_logp_t) is fused into the same pass.
"""
from __future__ import annotations

import math

import torch

from tripod.kernels._triton_dispatch import check_float_tensors, check_mask, compute_dtype, resolve_backend
from tripod.kernels.kl_penalty import kl_and_grad_torch, kl_kind_code

SCAN_BLOCK = 8


def _block_transfer(b: torch.Tensor) -> torch.Tensor:
    """For blocks b [..., C]: L [..., C, C+1] with L[t, s] = prod_{k=t}^{s-1} b_k (s >= t), 0 for s < t."""
    C = b.shape[-1]
    step = torch.cat([torch.ones_like(b[..., :1]), b], dim=-1)  # step[s] = b_{s-1} multiplies in at column s
    s_idx = torch.arange(C + 1, device=b.device)
    t_idx = torch.arange(C, device=b.device).unsqueeze(-1)
    factors = torch.where(s_idx > t_idx, step.unsqueeze(-2), torch.ones((), dtype=b.dtype, device=b.device))
    return torch.cumprod(factors, dim=-1) * (s_idx >= t_idx).to(b.dtype)


def reverse_linear_scan(a: torch.Tensor, b: torch.Tensor, block: int = SCAN_BLOCK) -> torch.Tensor:
    """Solve A_t = a_t + b_t * A_{t+1} along the last dim with A_T = 0, for a, b of shape [B, T]."""
    B, T = a.shape
    n_blocks = -(-T // block)
    pad = n_blocks * block - T
    if pad:  # (0, 1) pairs after the end leave the zero carry unchanged
        a = torch.cat([a, a.new_zeros(B, pad)], dim=-1)
        b = torch.cat([b, b.new_ones(B, pad)], dim=-1)
    a_blocks = a.view(B, n_blocks, block)
    transfer = _block_transfer(b.view(B, n_blocks, block))  # [B, n, C, C+1]
    local = (transfer[..., :block] @ a_blocks.unsqueeze(-1)).squeeze(-1)  # A with a zero carry-in
    tail = transfer[..., block]  # prod of b from t to the block end: how the carry-in enters
    if n_blocks > 1:
        block_starts = reverse_linear_scan(local[..., 0], tail[..., 0], block)
        carry_in = torch.cat([block_starts[:, 1:], block_starts.new_zeros(B, 1)], dim=-1)
        local = local + tail * carry_in.unsqueeze(-1)
    return local.reshape(B, n_blocks * block)[:, :T]


def scan_counted(a: torch.Tensor, counted: torch.Tensor, c: float, block: int = 256) -> torch.Tensor:
    """`reverse_linear_scan` for GAE's pairs: b_t = c at counted tokens, 1 elsewhere (where a_t = 0).

    Inside a block, prod_{k=t}^{s-1} b_k = c^(k_s - k_t) with k_t the counted tokens before t, so
    A_t = c^-k_t * sum_{s>=t} a_s c^k_s: one suffix sum in float64, blocks short enough that c^k stays far from
    float64's range (c^-k_t <= 1e260), then a carry from block to block (T / block steps).
    """
    B, T = a.shape
    if not c > 0.0:  # gamma*lam == 0: no powers to take; the general scan handles b = 0 exactly
        b = torch.where(counted, torch.full_like(a, c), torch.ones_like(a))
        return reverse_linear_scan(a, b)
    log_c = math.log(c)
    if log_c != 0.0:
        block = max(1, min(block, int(600.0 / abs(log_c))))
    a64, cnt = a.to(torch.float64), counted.to(torch.float64)
    out = torch.empty_like(a64)
    carry = a64.new_zeros(B, 1)
    for end in range(T, 0, -block):
        start = max(0, end - block)
        cb = cnt[:, start:end]
        k = torch.cumsum(cb, 1) - cb
        w = torch.exp(k * log_c)
        suffix = torch.flip(torch.cumsum(torch.flip(a64[:, start:end] * w, [1]), 1), [1])
        local = suffix / w + torch.exp((cb.sum(1, keepdim=True) - k) * log_c) * carry
        out[:, start:end] = local
        carry = local[:, :1]
    return out.to(a.dtype)


def next_counted_values(values: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """V_next(t): the value at the first counted position strictly after t (0 if there is none)."""
    B, T = values.shape
    positions = torch.arange(T, device=values.device).expand(B, T)
    counted_pos = torch.where(counted, positions, torch.full_like(positions, T))
    first_at_or_after = counted_pos.flip(-1).cummin(-1).values.flip(-1)
    first_after = torch.cat([first_at_or_after[:, 1:], torch.full_like(first_at_or_after[:, :1], T)], dim=-1)
    values_padded = torch.cat([values, values.new_zeros(B, 1)], dim=-1)
    return values_padded.gather(1, first_after)


def gae_torch(token_rewards, values, mask, gamma, lam, logp=None, ref_logp=None, kl_coef=0.0, kl_code=0):
    dtype = compute_dtype(token_rewards, values)
    rewards, values = token_rewards.to(dtype), values.to(dtype)
    if logp is not None:
        rewards = rewards - kl_coef * kl_and_grad_torch(logp, ref_logp, kl_code)[0].to(dtype)
    counted = mask.bool()
    delta = rewards + gamma * next_counted_values(values, counted) - values
    a = torch.where(counted, delta, torch.zeros_like(delta))
    advantages = scan_counted(a, counted, gamma * lam)
    return advantages, advantages + values


@torch.no_grad()
def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    *,
    backend: str = "auto",
    logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unwhitened GAE -> (advantages, returns), each [B, T] in float32 (float64 for float64 inputs).

    token_rewards, values: [B, T] float; mask: [B, T] bool/int/float, 1 where a token counts.
    With `logp` and `ref_logp` given, rewards are shaped as r - kl_coef * kl(logp, ref_logp, kl_kind)
    in the same pass. Not differentiable (advantages are targets).
    """
    shape = check_float_tensors(token_rewards=token_rewards, values=values, logp=logp, ref_logp=ref_logp)
    if len(shape) != 2:
        raise ValueError(f"token_rewards must be [batch, response_len], got shape {tuple(shape)}")
    check_mask(mask, shape)
    if (logp is None) != (ref_logp is None):
        raise ValueError("logp and ref_logp must be given together (for fused KL reward shaping) or not at all")
    kl_code = kl_kind_code(kl_kind)
    gamma, lam, kl_coef = float(gamma), float(lam), float(kl_coef)
    if resolve_backend(backend, token_rewards, values, mask) == "triton":
        from tripod.kernels._triton_gae import gae_triton

        return gae_triton(token_rewards, values, mask, gamma, lam, logp, ref_logp, kl_coef, kl_code)
    return gae_torch(token_rewards, values, mask, gamma, lam, logp, ref_logp, kl_coef, kl_code)
