"""Per-token KL estimators between policy and reference log-probs: `tripod.kernels.kl`.

Names (aliases share one code): `k1`/`kl` = logp - ref; `abs` = |logp - ref|;
`k2`/`mse` = 0.5 (logp - ref)^2; `k3`/`low_var_kl` = exp(d) - d - 1 with d = ref - logp clamped to
[-20, 20] and the result clamped to [-10, 10] (Schulman's low-variance estimator, as in verl).

Every estimator is a function of x = logp - ref only, so its gradient is one factor g = dkl/dlogp
(and dkl/dref = -g). The forward computes the value and g in one pass and saves g; the backward is
one multiply. Clamp edges follow torch.clamp (the gradient passes at the bounds).
"""
from __future__ import annotations

import torch

from tripod.kernels._triton_dispatch import check_float_tensors, resolve_backend, upcast

KL_K1, KL_ABS, KL_K2, KL_K3 = 0, 1, 2, 3
KL_KINDS = {"k1": KL_K1, "kl": KL_K1, "abs": KL_ABS, "k2": KL_K2, "mse": KL_K2, "k3": KL_K3, "low_var_kl": KL_K3}
LOG_RATIO_BOUND = 20.0  # k3: ref - logp clamped to +-20 so exp() cannot overflow
K3_VALUE_BOUND = 10.0  # k3: result clamped to +-10


def kl_kind_code(kind: str) -> int:
    if kind not in KL_KINDS:
        raise ValueError(f"kind={kind!r} is not a known KL estimator; choose one of {sorted(KL_KINDS)}")
    return KL_KINDS[kind]


def kl_and_grad_torch(logp: torch.Tensor, ref_logp: torch.Tensor, code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kl, dkl/dlogp), elementwise, computed in float32 (float64 for float64 inputs)."""
    logp, ref_logp = upcast(logp, ref_logp)
    x = logp - ref_logp
    if code == KL_K1:
        return x, torch.ones_like(x)
    if code == KL_ABS:
        return x.abs(), x.sign()
    if code == KL_K2:
        return 0.5 * x * x, x
    d = -x
    d_in = (d >= -LOG_RATIO_BOUND) & (d <= LOG_RATIO_BOUND)
    d = d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    exp_d = d.exp()
    raw = exp_d - d - 1.0
    raw_in = (raw >= -K3_VALUE_BOUND) & (raw <= K3_VALUE_BOUND)
    value = raw.clamp(-K3_VALUE_BOUND, K3_VALUE_BOUND)
    grad = torch.where(d_in & raw_in, 1.0 - exp_d, torch.zeros_like(exp_d))  # d/dlogp = -(exp(d) - 1)
    return value, grad


class _KLFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, ref_logp, code: int, backend: str):
        if backend == "triton":
            from tripod.kernels._triton_elementwise import kl_forward_triton

            value, grad = kl_forward_triton(logp, ref_logp, code)
        else:
            value, grad = kl_and_grad_torch(logp, ref_logp, code)
        ctx.save_for_backward(grad)
        return value

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        g = grad_out * grad
        return (g if ctx.needs_input_grad[0] else None), (-g if ctx.needs_input_grad[1] else None), None, None


def kl(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1", *, backend: str = "auto") -> torch.Tensor:
    """Per-token KL estimate of `kind` between policy `logp` and `ref_logp` (same shape, float).

    Differentiable w.r.t. both inputs. Returns float32 (float64 for float64 inputs).
    """
    code = kl_kind_code(kind)
    check_float_tensors(logp=logp, ref_logp=ref_logp)
    return _KLFunction.apply(logp, ref_logp, code, resolve_backend(backend, logp, ref_logp))
