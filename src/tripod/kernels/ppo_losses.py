"""Per-token PPO losses with their clip indicators: `tripod.kernels.policy_loss_per_token`, `tripod.kernels.value_loss_per_token`.

Both are custom autograd Functions whose forward computes the loss, the clip indicators and the
elementwise gradient factor d(loss)/d(input) in one pass (Triton kernel on CUDA, torch ops on CPU)
and saves only that factor; the backward is one multiply. Gradients reach `logp` (policy) and
`values` (value loss) only: old log-probs, advantages, returns and old values are data.

The factors reproduce torch autograd of the textbook expressions exactly, including its
conventions at edges: clamp passes the gradient at its bounds, and max/min give each side half
of the gradient where both sides are equal (which is what keeps an unclipped ratio's gradient
whole).

Policy loss (PPO clip with separate low/high clip and dual clip for negative advantages):
    r = exp(clamp(logp - old_logp, -20, 20))
    l1 = -A r,  l2 = -A clamp(r, 1 - clip_low, 1 + clip_high),  m = max(l1, l2)
    loss = min(m, -A clip_c) if A < 0 else m
    clipped = l2 > l1;  clipped_lower = A < 0 and m > -A clip_c
Value loss:
    loss = 0.5 max((v - R)^2, (clamp(v, v_old - clip, v_old + clip) - R)^2);  clipped = second > first
"""
from __future__ import annotations

import math

import torch

from tripod.kernels._triton_dispatch import check_float_tensors, resolve_backend, upcast

LOG_RATIO_BOUND = 20.0


def _max_grad(x: torch.Tensor, y: torch.Tensor, gx: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """Gradient of max(x, y) given the gradients of x and y (ties split evenly, as torch does)."""
    return torch.where(x > y, gx, torch.where(y > x, gy, 0.5 * (gx + gy)))


def policy_loss_torch(old_logp, logp, advantages, clip_low: float, clip_high: float, clip_c: float):
    """(loss, clipped, clipped_lower, dloss/dlogp) elementwise, in float32 (or float64)."""
    old_logp, logp, advantages = upcast(old_logp, logp, advantages)
    log_ratio = logp - old_logp
    in_bounds = (log_ratio >= -LOG_RATIO_BOUND) & (log_ratio <= LOG_RATIO_BOUND)
    ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    zero = torch.zeros_like(ratio)
    d_ratio = torch.where(in_bounds, ratio, zero)  # d ratio / d logp
    in_clip = (ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    grad1 = -advantages * d_ratio
    grad2 = torch.where(in_clip, grad1, zero)
    clipped_loss = torch.maximum(loss1, loss2)
    clipped_grad = _max_grad(loss1, loss2, grad1, grad2)
    loss3 = -advantages * clip_c  # constant in logp
    negative = advantages < 0
    dual_loss = torch.minimum(clipped_loss, loss3)
    dual_grad = _max_grad(-clipped_loss, -loss3, clipped_grad, zero)  # min(a, b) = -max(-a, -b)
    loss = torch.where(negative, dual_loss, clipped_loss)
    grad = torch.where(negative, dual_grad, clipped_grad)
    return loss, loss2 > loss1, negative & (clipped_loss > loss3), grad


def value_loss_torch(values, returns, old_values, clip: float):
    """(loss, clipped, dloss/dvalues) elementwise, in float32 (or float64)."""
    values, returns, old_values = upcast(values, returns, old_values)
    low, high = old_values - clip, old_values + clip
    clipped_values = torch.maximum(torch.minimum(values, high), low)
    in_clip = (values >= low) & (values <= high)
    err1 = values - returns
    err2 = clipped_values - returns
    loss1, loss2 = err1 * err1, err2 * err2
    grad2 = torch.where(in_clip, err2, torch.zeros_like(err2))
    return 0.5 * torch.maximum(loss1, loss2), loss2 > loss1, _max_grad(loss1, loss2, err1, grad2)


class _PolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, old_logp, logp, advantages, clip_low, clip_high, clip_c, backend):
        if backend == "triton":
            from tripod.kernels._triton_elementwise import policy_loss_forward_triton as forward
        else:
            forward = policy_loss_torch
        loss, clipped, clipped_lower, grad = forward(old_logp, logp, advantages, clip_low, clip_high, clip_c)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(clipped, clipped_lower)
        return loss, clipped, clipped_lower

    @staticmethod
    def backward(ctx, grad_loss, _grad_clipped, _grad_clipped_lower):
        (grad,) = ctx.saved_tensors
        return None, grad_loss * grad, None, None, None, None, None


class _ValueLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, returns, old_values, clip, backend):
        if backend == "triton":
            from tripod.kernels._triton_elementwise import value_loss_forward_triton as forward
        else:
            forward = value_loss_torch
        loss, clipped, grad = forward(values, returns, old_values, clip)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(clipped)
        return loss, clipped

    @staticmethod
    def backward(ctx, grad_loss, _grad_clipped):
        (grad,) = ctx.saved_tensors
        return grad_loss * grad, None, None, None, None


def _check_no_grad(**named: torch.Tensor) -> None:
    for name, t in named.items():
        if t.requires_grad:
            raise ValueError(f"{name} requires grad but is treated as data by this loss; pass {name}.detach()")


def policy_loss_per_token(
    old_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped PPO policy loss -> (loss, clipped, clipped_lower); bool indicators.

    `clip_c` (dual clip) must be > 1; float("inf") turns dual clipping off.
    """
    check_float_tensors(old_logp=old_logp, logp=logp, advantages=advantages)
    _check_no_grad(old_logp=old_logp, advantages=advantages)
    if not (clip_low >= 0 and clip_high >= 0):
        raise ValueError(f"clip_low={clip_low} and clip_high={clip_high} must be >= 0")
    if not clip_c > 1.0:
        raise ValueError(f"clip_c={clip_c} must be > 1 (dual clip bounds the loss at -A*clip_c for A < 0)")
    return _PolicyLossFunction.apply(old_logp, logp, advantages, float(clip_low), float(clip_high),
                                     float(clip_c), resolve_backend(backend, old_logp, logp, advantages))


def value_loss_per_token(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    clip: float | None = 0.5,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped value loss -> (loss, clipped); `clip=None` means no clipping."""
    check_float_tensors(values=values, returns=returns, old_values=old_values)
    _check_no_grad(returns=returns, old_values=old_values)
    clip = math.inf if clip is None else float(clip)
    if not clip >= 0:
        raise ValueError(f"clip={clip} must be >= 0 (or None for no value clipping)")
    return _ValueLossFunction.apply(values, returns, old_values, clip,
                                    resolve_backend(backend, values, returns, old_values))
