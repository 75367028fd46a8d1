"""Triton GAE: one program per row, walking the row back to front in blocks of BLOCK tokens.

Each block is loaded in reversed order so that a *forward* `tl.associative_scan` composes the
affine maps A -> a_t + b_t * A from the end of the row towards its start; the composed map of the
block is applied to the carry from the block after it. Two scans per block, same combine:
  1. V_next(t) = m_{t+1} v_{t+1} + (1 - m_{t+1}) V_next(t+1): the next counted value, from the
     inputs shifted by one (loaded at t + 1),
  2. A_t = delta_t + gamma*lam A_{t+1} at counted tokens, A_t = A_{t+1} at masked ones.
Lanes past the row start are (0, 1) pairs, so the block's last lane holds the next carry.
See kernels/gae_scan.py for the math and the torch twin.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tripod.kernels._triton_dispatch import compute_dtype
from tripod.kernels._triton_elementwise import kl_value_and_grad

BLOCK_SIZE = 256


@triton.jit
def _compose_affine(a_first, b_first, a_then, b_then):
    # apply (a_first, b_first) to the carry, then (a_then, b_then): x -> a_then + b_then * (a_first + b_first * x)
    return a_then + b_then * a_first, b_first * b_then


@triton.jit
def _gae_kernel(rewards_ptr, values_ptr, mask_ptr, logp_ptr, ref_ptr, adv_ptr, returns_ptr, T,
                gamma, lam, kl_coef, FUSE_KL: tl.constexpr, KL_KIND: tl.constexpr, BLOCK: tl.constexpr):
    row_start = tl.program_id(0).to(tl.int64) * T
    dtype = adv_ptr.dtype.element_ty
    lane = tl.arange(0, BLOCK)
    advantage_carry = tl.zeros((), dtype)
    next_value_carry = tl.zeros((), dtype)
    for block_end in range(0, T, BLOCK):
        t = T - 1 - block_end - lane  # reversed positions
        inside = t >= 0
        nxt = t + 1
        nxt_inside = inside & (nxt < T)
        counted_next = tl.load(mask_ptr + row_start + nxt, mask=nxt_inside, other=0).to(dtype)
        value_next = tl.load(values_ptr + row_start + nxt, mask=nxt_inside, other=0.0).to(dtype)
        next_a, next_b = tl.associative_scan((counted_next * value_next, 1.0 - counted_next), 0, _compose_affine)
        next_value = next_a + next_b * next_value_carry

        counted = tl.load(mask_ptr + row_start + t, mask=inside, other=0).to(dtype)
        value = tl.load(values_ptr + row_start + t, mask=inside, other=0.0).to(dtype)
        reward = tl.load(rewards_ptr + row_start + t, mask=inside, other=0.0).to(dtype)
        if FUSE_KL:
            logp = tl.load(logp_ptr + row_start + t, mask=inside, other=0.0).to(dtype)
            ref = tl.load(ref_ptr + row_start + t, mask=inside, other=0.0).to(dtype)
            kl, _ = kl_value_and_grad(logp, ref, KL_KIND)
            reward = reward - kl_coef * kl
        delta = reward + gamma * next_value - value
        is_counted = counted != 0
        a = tl.where(is_counted, delta, 0.0).to(dtype)
        b = tl.where(is_counted, gamma * lam, 1.0).to(dtype)
        adv_a, adv_b = tl.associative_scan((a, b), 0, _compose_affine)
        advantage = adv_a + adv_b * advantage_carry
        tl.store(adv_ptr + row_start + t, advantage, mask=inside)
        tl.store(returns_ptr + row_start + t, advantage + value, mask=inside)

        last_lane = lane == BLOCK - 1
        advantage_carry = tl.sum(tl.where(last_lane, advantage, 0.0), axis=0).to(dtype)
        next_value_carry = tl.sum(tl.where(last_lane, next_value, 0.0), axis=0).to(dtype)


def gae_triton(token_rewards, values, mask, gamma: float, lam: float, logp, ref_logp, kl_coef: float, kl_code: int):
    B, T = token_rewards.shape
    dtype = compute_dtype(token_rewards, values)
    advantages = torch.empty((B, T), dtype=dtype, device=values.device)
    returns = torch.empty_like(advantages)
    if B == 0 or T == 0:
        return advantages, returns
    fuse_kl = logp is not None
    rewards_c, values_c = token_rewards.contiguous(), values.contiguous()
    mask_c = (mask != 0).to(torch.int8).contiguous()
    logp_c = logp.contiguous() if fuse_kl else values_c  # placeholders are never read when FUSE_KL is off
    ref_c = ref_logp.contiguous() if fuse_kl else values_c
    block = min(BLOCK_SIZE, triton.next_power_of_2(T))
    _gae_kernel[(B,)](rewards_c, values_c, mask_c, logp_c, ref_c, advantages, returns, T, gamma, lam, kl_coef,
                      FUSE_KL=fuse_kl, KL_KIND=kl_code, BLOCK=block)
    return advantages, returns
