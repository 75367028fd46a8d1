"""tripod.kernels.gae / kernels.kl / kernels.policy_loss_per_token / kernels.value_loss_per_token against float64 references
written straight from the formulas (per-token loops for the recurrences), for the torch backend
(fp32, 1e-6 relative to the output's scale) and the Triton kernels (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is imported, 1e-5)."""
from __future__ import annotations

import os
import time

import pytest
import torch

from tripod.kernels.gae_scan import gae
from tripod.kernels.kl_penalty import kl
from tripod.kernels.ppo_losses import policy_loss_per_token, value_loss_per_token

TRITON_RUNNABLE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not TRITON_RUNNABLE, reason="Triton needs CUDA or TRITON_INTERPRET=1"))]
TOL = {"torch": 1e-6, "triton": 1e-5}


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """max |actual - expected| <= tol * max(1, max |expected|): fp32 cannot do better than its ulp."""
    assert actual.shape == expected.shape, what
    err = (actual.double() - expected).abs().max().item() if expected.numel() else 0.0
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol:.0e} * {scale:.3g}"


# ---------------------------------------------------------------- float64 references (formulas)
def gae_reference(rewards, values, mask, gamma, lam, dtype=torch.float64):
    """verl's multi-turn GAE loop: masked tokens carry the next value and running advantage."""
    rewards, values, mask = rewards.to(dtype), values.to(dtype), mask.to(dtype)
    B, T = rewards.shape
    next_value = torch.zeros(B, dtype=dtype)
    running = torch.zeros(B, dtype=dtype)
    advantages = torch.zeros(B, T, dtype=dtype)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        next_value = mask[:, t] * values[:, t] + (1 - mask[:, t]) * next_value
        running = mask[:, t] * candidate + (1 - mask[:, t]) * running
        advantages[:, t] = running
    return advantages, advantages + values


def kl_reference(logp, ref, kind):
    if kind in ("k1", "kl"):
        return logp - ref
    if kind == "abs":
        return (logp - ref).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logp - ref) ** 2
    d = torch.clamp(ref - logp, -20, 20)
    return torch.clamp(torch.exp(d) - d - 1, -10, 10)


def policy_loss_reference(old, logp, adv, clip_low, clip_high, clip_c):
    ratio = torch.exp(torch.clamp(logp - old, -20, 20))
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped_loss = torch.maximum(loss1, loss2)
    loss3 = -adv * clip_c
    loss = torch.where(adv < 0, torch.minimum(loss3, clipped_loss), clipped_loss)
    return loss, loss2 > loss1, (clipped_loss > loss3) & (adv < 0)


def value_loss_reference(values, returns, old, clip):
    clipped = torch.clamp(values, old - clip, old + clip)
    loss1, loss2 = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(loss1, loss2), loss2 > loss1


# ---------------------------------------------------------------- inputs
def random_mask(B, T, gen, p_keep=0.7):
    mask = torch.rand(B, T, generator=gen) < p_keep  # gaps everywhere (multi-turn observations)
    if B > 2:
        mask[0] = False  # an all-masked row
        mask[1, T // 2:] = False  # a right-padded row
    return mask


def random_log_probs(shape, gen):
    """Policy / old log-probs with moderate, clipped-range and extreme (|log ratio| > 20) gaps."""
    old = -torch.rand(shape, generator=gen) * 5
    step = torch.randn(shape, generator=gen) * 0.3
    kind = torch.randint(0, 4, shape, generator=gen)
    step = torch.where(kind == 0, torch.randn(shape, generator=gen) * 30, step)  # extreme ratios
    step = torch.where(kind == 1, torch.randn(shape, generator=gen) * 1.5, step)  # beyond the dual clip
    return old, old + step


# ---------------------------------------------------------------- GAE
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 7, 45])
def test_gae_matches_reference_loop(backend, T, monkeypatch):
    if backend == "triton":  # small blocks: T=45 walks 3 blocks (the last one partial) with carries
        from tripod.kernels import _triton_gae

        monkeypatch.setattr(_triton_gae, "BLOCK_SIZE", 16)
    gen = torch.Generator().manual_seed(T)
    B = 5
    rewards, values = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    mask = random_mask(B, T, gen)
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.5)]:
        adv, ret = gae(rewards, values, mask, gamma, lam, backend=backend)
        ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma, lam)
        assert adv.dtype == torch.float32
        assert_close_scaled(adv, ref_adv, TOL[backend], f"advantages T={T} gamma={gamma} lam={lam}")
        assert_close_scaled(ret, ref_ret, TOL[backend], f"returns T={T} gamma={gamma} lam={lam}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gae_default_blocks(backend):
    """T=300 spans two default-size Triton blocks and three levels of torch scan blocks."""
    gen = torch.Generator().manual_seed(300)
    rewards, values = torch.randn(3, 300, generator=gen), torch.randn(3, 300, generator=gen)
    mask = random_mask(3, 300, gen)
    adv, ret = gae(rewards, values, mask, 0.99, 0.95, backend=backend)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, 0.99, 0.95)
    assert_close_scaled(adv, ref_adv, TOL[backend], "advantages T=300")
    assert_close_scaled(ret, ref_ret, TOL[backend], "returns T=300")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["k1", "abs", "k2", "low_var_kl"])
def test_gae_fused_kl_shaping(backend, kind):
    gen = torch.Generator().manual_seed(11)
    B, T, coef = 3, 45, 0.3
    rewards, values = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    mask = random_mask(B, T, gen)
    ref_logp, logp = random_log_probs((B, T), gen)
    adv, ret = gae(rewards, values, mask, 0.97, 0.9, backend=backend, logp=logp, ref_logp=ref_logp,
                   kl_coef=coef, kl_kind=kind)
    shaped = rewards.double() - coef * kl_reference(logp.double(), ref_logp.double(), kind)
    ref_adv, ref_ret = gae_reference(shaped, values, mask, 0.97, 0.9)
    assert_close_scaled(adv, ref_adv, TOL[backend], f"fused-kl {kind} advantages")
    assert_close_scaled(ret, ref_ret, TOL[backend], f"fused-kl {kind} returns")


def test_gae_long_response_is_stable():
    """8k tokens: products of gamma*lam underflow to 0 the way the true products do; no inf / nan."""
    gen = torch.Generator().manual_seed(3)
    B, T = 2, 8192
    rewards, values = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    mask = torch.rand(B, T, generator=gen) < 0.9
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95)]:
        adv, ret = gae(rewards, values, mask, gamma, lam, backend="torch")
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
        ref_adv, _ = gae_reference(rewards, values, mask, gamma, lam)
        assert_close_scaled(adv, ref_adv, 1e-6, f"T={T} gamma={gamma} lam={lam}")


def test_gae_accepts_bf16_and_float_masks():
    gen = torch.Generator().manual_seed(5)
    rewards, values = torch.randn(3, 20, generator=gen), torch.randn(3, 20, generator=gen)
    mask = random_mask(3, 20, gen)
    adv, _ = gae(rewards.bfloat16(), values.bfloat16(), mask.float(), 0.99, 0.95)
    ref_adv, _ = gae_reference(rewards.bfloat16(), values.bfloat16(), mask, 0.99, 0.95)
    assert adv.dtype == torch.float32
    assert_close_scaled(adv, ref_adv, 1e-6, "bf16 inputs")


def test_gae_bad_inputs():
    r, v, m = torch.randn(2, 4), torch.randn(2, 4), torch.ones(2, 4)
    with pytest.raises(ValueError, match="values"):
        gae(r, torch.randn(2, 5), m)
    with pytest.raises(ValueError, match="token_rewards"):
        gae(r.long(), v, m)
    with pytest.raises(ValueError, match="mask"):
        gae(r, v, torch.ones(2, 3))
    with pytest.raises(ValueError, match="kind"):
        gae(r, v, m, logp=r, ref_logp=v, kl_kind="k9")
    with pytest.raises(ValueError, match="ref_logp"):
        gae(r, v, m, logp=r)
    with pytest.raises(ValueError, match="backend"):
        gae(r, v, m, backend="cuda")


# ---------------------------------------------------------------- KL
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_kl_value_and_gradients(backend, kind):
    gen = torch.Generator().manual_seed(len(kind))
    ref_logp, logp = random_log_probs((4, 33), gen)
    weight = torch.randn(4, 33, generator=gen)
    logp, ref_logp = logp.requires_grad_(), ref_logp.requires_grad_()
    value = kl(logp, ref_logp, kind, backend=backend)
    (value * weight).sum().backward()
    logp64 = logp.detach().double().requires_grad_()
    ref64 = ref_logp.detach().double().requires_grad_()
    expected = kl_reference(logp64, ref64, kind)
    (expected * weight.double()).sum().backward()
    tol = TOL[backend]
    assert_close_scaled(value.detach(), expected.detach(), tol, f"kl {kind}")
    assert_close_scaled(logp.grad, logp64.grad, tol, f"kl {kind} d/dlogp")
    assert_close_scaled(ref_logp.grad, ref64.grad, tol, f"kl {kind} d/dref_logp")


# ---------------------------------------------------------------- PPO losses
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clips", [(0.2, 0.2, 3.0), (0.1, 0.28, 2.0)])
def test_policy_loss_value_indicators_and_gradient(backend, clips):
    gen = torch.Generator().manual_seed(int(clips[1] * 100))
    shape = (6, 41)
    old, logp = random_log_probs(shape, gen)
    adv = torch.randn(shape, generator=gen) * 2
    weight = torch.randn(shape, generator=gen)
    logp.requires_grad_()
    loss, clipped, clipped_lower = policy_loss_per_token(old, logp, adv, *clips, backend=backend)
    (loss * weight).sum().backward()
    logp64 = logp.detach().double().requires_grad_()
    ref_loss, ref_clipped, ref_lower = policy_loss_reference(old.double(), logp64, adv.double(), *clips)
    (ref_loss * weight.double()).sum().backward()
    tol = TOL[backend]
    assert_close_scaled(loss.detach(), ref_loss.detach(), tol, "policy loss")
    assert_close_scaled(logp.grad, logp64.grad, tol, "policy loss d/dlogp")
    assert torch.equal(clipped, ref_clipped) and torch.equal(clipped_lower, ref_lower)
    assert clipped.any() and clipped_lower.any() and not clipped.all()  # the inputs reach every branch


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_loss_value_indicators_and_gradient(backend):
    gen = torch.Generator().manual_seed(21)
    shape, clip = (5, 37), 0.4
    old = torch.randn(shape, generator=gen)
    values = (old + torch.randn(shape, generator=gen) * 0.6).requires_grad_()
    returns = old + torch.randn(shape, generator=gen)
    weight = torch.randn(shape, generator=gen)
    loss, clipped = value_loss_per_token(values, returns, old, clip, backend=backend)
    (loss * weight).sum().backward()
    values64 = values.detach().double().requires_grad_()
    ref_loss, ref_clipped = value_loss_reference(values64, returns.double(), old.double(), clip)
    (ref_loss * weight.double()).sum().backward()
    tol = TOL[backend]
    assert_close_scaled(loss.detach(), ref_loss.detach(), tol, "value loss")
    assert_close_scaled(values.grad, values64.grad, tol, "value loss d/dvalues")
    assert torch.equal(clipped, ref_clipped) and clipped.any() and not clipped.all()


def test_losses_bad_inputs():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss_per_token(x, x, x, clip_c=1.0)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss_per_token(x, x, torch.randn(2, 4))
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss_per_token(x.int(), x, x)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss_per_token(x.clone().requires_grad_(), x, x)
    with pytest.raises(ValueError, match="old_values"):
        value_loss_per_token(x, x, torch.randn(3, 2))
    with pytest.raises(ValueError, match="clip"):
        value_loss_per_token(x, x, x, clip=-1.0)
    with pytest.raises(ValueError, match="kind"):
        kl(x, x, "k4")


if __name__ == "__main__":  # quick timing of the torch GAE against a per-token loop (not a test)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    for B, T in [(1, 4096), (16, 4096)]:
        r, v = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
        m = torch.rand(B, T, generator=gen) < 0.9
        gae(r, v, m, 0.99, 0.95, backend="torch")
        t0 = time.perf_counter()
        for _ in range(5):
            gae(r, v, m, 0.99, 0.95, backend="torch")
        scan = (time.perf_counter() - t0) / 5
        t0 = time.perf_counter()
        gae_reference(r, v, m, 0.99, 0.95, dtype=torch.float32)
        loop = time.perf_counter() - t0
        print(f"B={B} T={T}: blocked scan {scan * 1e3:.1f} ms, per-token loop {loop * 1e3:.1f} ms, "
              f"speed-up {loop / scan:.1f}x")
