"""Triton kernels for the elementwise RL ops: KL estimators, PPO policy loss, clipped value loss.

Each kernel reads its inputs once and writes the value(s), the clip indicators and the gradient
factor that the autograd Functions in kernels/kl_penalty.py and kernels/ppo_losses.py save. The
math mirrors the torch twins there line by line (same clamp / tie conventions). Inputs are
flattened (made contiguous); all arithmetic is in float32, or float64 for float64 inputs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tripod.kernels._triton_dispatch import compute_dtype

BLOCK_SIZE = 1024


@triton.jit
def kl_value_and_grad(logp, ref_logp, KIND: tl.constexpr):
    """KL estimate of kind KIND (0=k1, 1=abs, 2=k2, 3=k3) and its derivative w.r.t. logp."""
    x = logp - ref_logp
    if KIND == 0:
        value = x
        grad = tl.full(x.shape, 1.0, x.dtype)
    elif KIND == 1:
        value = tl.abs(x)
        grad = tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0)).to(x.dtype)
    elif KIND == 2:
        value = 0.5 * x * x
        grad = x
    else:
        d = -x
        d_in = (d >= -20.0) & (d <= 20.0)
        d = tl.minimum(tl.maximum(d, -20.0), 20.0)
        exp_d = tl.exp(d)
        raw = exp_d - d - 1.0
        raw_in = (raw >= -10.0) & (raw <= 10.0)
        value = tl.minimum(tl.maximum(raw, -10.0), 10.0)
        grad = tl.where(d_in & raw_in, 1.0 - exp_d, 0.0).to(x.dtype)
    return value, grad


@triton.jit
def _max_grad(x, y, gx, gy):
    return tl.where(x > y, gx, tl.where(y > x, gy, 0.5 * (gx + gy)))


@triton.jit
def _kl_kernel(logp_ptr, ref_ptr, value_ptr, grad_ptr, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    dtype = value_ptr.dtype.element_ty
    logp = tl.load(logp_ptr + offs, mask=inside, other=0.0).to(dtype)
    ref = tl.load(ref_ptr + offs, mask=inside, other=0.0).to(dtype)
    value, grad = kl_value_and_grad(logp, ref, KIND)
    tl.store(value_ptr + offs, value, mask=inside)
    tl.store(grad_ptr + offs, grad, mask=inside)


@triton.jit
def _policy_loss_kernel(old_ptr, logp_ptr, adv_ptr, loss_ptr, clipped_ptr, lower_ptr, grad_ptr, n,
                        clip_low, clip_high, clip_c, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    dtype = loss_ptr.dtype.element_ty
    old = tl.load(old_ptr + offs, mask=inside, other=0.0).to(dtype)
    logp = tl.load(logp_ptr + offs, mask=inside, other=0.0).to(dtype)
    adv = tl.load(adv_ptr + offs, mask=inside, other=0.0).to(dtype)

    log_ratio = logp - old
    in_bounds = (log_ratio >= -20.0) & (log_ratio <= 20.0)
    ratio = tl.exp(tl.minimum(tl.maximum(log_ratio, -20.0), 20.0))
    low = 1.0 - clip_low
    high = 1.0 + clip_high
    in_clip = (ratio >= low) & (ratio <= high)
    loss1 = -adv * ratio
    loss2 = -adv * tl.minimum(tl.maximum(ratio, low), high)
    grad1 = tl.where(in_bounds, -adv * ratio, 0.0)
    grad2 = tl.where(in_clip, grad1, 0.0)
    clipped_loss = tl.maximum(loss1, loss2)
    clipped_grad = _max_grad(loss1, loss2, grad1, grad2)
    loss3 = -adv * clip_c
    negative = adv < 0
    dual_loss = tl.minimum(clipped_loss, loss3)
    dual_grad = _max_grad(-clipped_loss, -loss3, clipped_grad, 0.0)
    tl.store(loss_ptr + offs, tl.where(negative, dual_loss, clipped_loss), mask=inside)
    tl.store(grad_ptr + offs, tl.where(negative, dual_grad, clipped_grad), mask=inside)
    tl.store(clipped_ptr + offs, loss2 > loss1, mask=inside)
    tl.store(lower_ptr + offs, negative & (clipped_loss > loss3), mask=inside)


@triton.jit
def _value_loss_kernel(values_ptr, returns_ptr, old_ptr, loss_ptr, clipped_ptr, grad_ptr, n, clip,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    dtype = loss_ptr.dtype.element_ty
    values = tl.load(values_ptr + offs, mask=inside, other=0.0).to(dtype)
    returns = tl.load(returns_ptr + offs, mask=inside, other=0.0).to(dtype)
    old = tl.load(old_ptr + offs, mask=inside, other=0.0).to(dtype)
    low = old - clip
    high = old + clip
    clipped_values = tl.maximum(tl.minimum(values, high), low)
    in_clip = (values >= low) & (values <= high)
    err1 = values - returns
    err2 = clipped_values - returns
    loss1 = err1 * err1
    loss2 = err2 * err2
    tl.store(loss_ptr + offs, 0.5 * tl.maximum(loss1, loss2), mask=inside)
    tl.store(grad_ptr + offs, _max_grad(loss1, loss2, err1, tl.where(in_clip, err2, 0.0)), mask=inside)
    tl.store(clipped_ptr + offs, loss2 > loss1, mask=inside)


def _grid(n: int):
    return (triton.cdiv(n, BLOCK_SIZE),)


def kl_forward_triton(logp: torch.Tensor, ref_logp: torch.Tensor, code: int):
    logp_c, ref_c = logp.contiguous(), ref_logp.contiguous()
    dtype = compute_dtype(logp, ref_logp)
    value = torch.empty(logp.shape, dtype=dtype, device=logp.device)
    grad = torch.empty_like(value)
    n = value.numel()
    if n:
        _kl_kernel[_grid(n)](logp_c, ref_c, value, grad, n, KIND=code, BLOCK=BLOCK_SIZE)
    return value, grad


def policy_loss_forward_triton(old_logp, logp, advantages, clip_low: float, clip_high: float, clip_c: float):
    inputs = [t.contiguous() for t in (old_logp, logp, advantages)]
    loss = torch.empty(logp.shape, dtype=compute_dtype(*inputs), device=logp.device)
    grad = torch.empty_like(loss)
    clipped = torch.empty(logp.shape, dtype=torch.bool, device=logp.device)
    clipped_lower = torch.empty_like(clipped)
    n = loss.numel()
    if n:
        _policy_loss_kernel[_grid(n)](*inputs, loss, clipped, clipped_lower, grad, n,
                                      clip_low, clip_high, clip_c, BLOCK=BLOCK_SIZE)
    return loss, clipped, clipped_lower, grad


def value_loss_forward_triton(values, returns, old_values, clip: float):
    inputs = [t.contiguous() for t in (values, returns, old_values)]
    loss = torch.empty(values.shape, dtype=compute_dtype(*inputs), device=values.device)
    grad = torch.empty_like(loss)
    clipped = torch.empty(values.shape, dtype=torch.bool, device=values.device)
    n = loss.numel()
    if n:
        _value_loss_kernel[_grid(n)](*inputs, loss, clipped, grad, n, clip, BLOCK=BLOCK_SIZE)
    return loss, clipped, grad
