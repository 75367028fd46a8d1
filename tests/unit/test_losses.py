"""tripod.engine.algorithms losses, KL uses and KL controllers against float64 references written from the
formulas: agg_loss (five modes), policy_loss / value_loss / kl_loss / entropy_loss with their
metrics and gradients, apply_kl_penalty, Fixed/Adaptive KL controllers (warm-up, state_dict)."""
from __future__ import annotations

import math

import pytest
import torch

from tripod.engine.algorithms import (
    AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    build_kl_controller,
    entropy_loss,
    kl_loss,
    kl_penalty,
    list_kl_kinds,
    policy_loss,
    value_loss,
)


def agg_reference(loss_mat, mask, agg):
    """Loops over rows and tokens; rows with no counted token are not sequences."""
    rows = [[loss_mat[i, t] for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
    rows = [r for r in rows if r]
    if not rows:
        return loss_mat.sum() * 0
    if agg == "token-mean":
        return sum(x for r in rows for x in r) / sum(len(r) for r in rows)
    if agg == "token-sum":
        return sum(x for r in rows for x in r)
    if agg == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if agg == "seq-mean-token-sum-norm":  # verl's horizon: the mask's width
        return sum(sum(r) for r in rows) / len(rows) / mask.shape[1]
    return sum(sum(r) / len(r) for r in rows) / len(rows)


def batch(seed, B=6, T=9):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) < 0.6
    mask[0] = False
    mask[1, :] = False
    mask[1, 0] = True  # a length-1 response
    old = -torch.rand(B, T, generator=gen) * 4
    logp = old + torch.randn(B, T, generator=gen) * 0.4
    logp[2, :3] = old[2, :3] + torch.tensor([25.0, -25.0, 3.0])  # extreme and dual-clip ratios
    adv = torch.randn(B, T, generator=gen)
    return gen, mask, old, logp, adv


def assert_close64(actual, expected, what, tol=1e-6):
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= tol * max(1.0, expected.double().abs().max().item()), f"{what}: error {err:.3g}"


@pytest.mark.parametrize("agg", AGG_MODES)
def test_agg_loss_matches_loops(agg):
    gen, mask, *_ = batch(1)
    loss_mat = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    assert_close64(agg_loss(loss_mat, mask, agg), agg_reference(loss_mat, mask, agg), agg)
    assert agg_loss(loss_mat, torch.zeros_like(mask), agg).item() == 0.0  # nothing counts -> 0, not nan
    if agg == "token-sum":  # a sum already: no normaliser to replace
        assert_close64(agg_loss(loss_mat, mask, agg, global_norm=7.0), agg_reference(loss_mat, mask, agg), agg)
        return
    local_norm = mask.sum() if agg == "token-mean" else (mask.sum(-1) > 0).sum()
    assert_close64(agg_loss(loss_mat, mask, agg, global_norm=7.0) * 7.0,
                   agg_reference(loss_mat, mask, agg) * local_norm, f"{agg}: global_norm turns the mean into a sum")


@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_value_metrics_and_gradient(agg):
    gen, mask, old, logp, adv = batch(2)
    logp.requires_grad_()
    loss, metrics = policy_loss(old, logp, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0, agg=agg)
    loss.backward()

    logp64 = logp.detach().double().requires_grad_()
    old64, adv64 = old.double(), adv.double()
    ratio = torch.exp(torch.clamp(logp64 - old64, -20, 20))
    loss1, loss2 = -adv64 * ratio, -adv64 * torch.clamp(ratio, 0.8, 1.28)
    clipped = torch.maximum(loss1, loss2)
    per_token = torch.where(adv64 < 0, torch.minimum(clipped, -adv64 * 3.0), clipped)
    expected = agg_reference(per_token, mask, agg)
    expected.backward()
    assert_close64(loss.detach(), expected.detach(), f"policy loss {agg}")
    assert_close64(logp.grad, logp64.grad, f"policy grad {agg}")
    m = mask.double()
    frac = lambda x: (x.double() * m).sum() / m.sum()  # noqa: E731
    assert_close64(metrics["pg_clipfrac"], frac(loss2 > loss1), "pg_clipfrac")
    assert_close64(metrics["pg_clipfrac_lower"], frac((clipped > -adv64 * 3.0) & (adv64 < 0)), "pg_clipfrac_lower")
    assert_close64(metrics["ppo_kl"], frac(torch.clamp(old64 - logp64.detach(), -20, 20)), "ppo_kl")
    assert 0 < metrics["pg_clipfrac"].item() < 1 and metrics["pg_clipfrac_lower"].item() > 0


@pytest.mark.parametrize("agg", AGG_MODES)
def test_value_loss_value_metric_and_gradient(agg):
    gen, mask, *_ = batch(3)
    old = torch.randn(mask.shape, generator=gen)
    values = (old + torch.randn(mask.shape, generator=gen) * 0.8).requires_grad_()
    returns = old + torch.randn(mask.shape, generator=gen)
    loss, metrics = value_loss(values, returns, old, mask, clip=0.5, agg=agg)
    loss.backward()
    v64 = values.detach().double().requires_grad_()
    l1 = (v64 - returns.double()) ** 2
    l2 = (torch.clamp(v64, old.double() - 0.5, old.double() + 0.5) - returns.double()) ** 2
    expected = agg_reference(0.5 * torch.maximum(l1, l2), mask, agg)
    expected.backward()
    assert_close64(loss.detach(), expected.detach(), f"value loss {agg}")
    assert_close64(values.grad, v64.grad, f"value grad {agg}")
    m = mask.double()
    assert_close64(metrics["vf_clipfrac"], ((l2 > l1).double() * m).sum() / m.sum(), "vf_clipfrac")


def test_kl_uses_and_entropy():
    gen, mask, ref, logp, _ = batch(4)
    assert list_kl_kinds() == ["abs", "k1", "k2", "k3", "kl", "low_var_kl", "mse"]
    d = torch.clamp(ref.double() - logp.double(), -20, 20)
    k3 = torch.clamp(torch.exp(d) - d - 1, -10, 10)
    assert_close64(kl_penalty(logp, ref, "low_var_kl"), k3, "k3")
    assert_close64(kl_penalty(logp, ref, "mse"), 0.5 * (logp.double() - ref.double()) ** 2, "mse")

    rewards = torch.randn(mask.shape, generator=gen)
    shaped, mean_kl = apply_kl_penalty(rewards, logp, ref, mask, kl_coef=0.1, kind="k1")
    k1 = logp.double() - ref.double()
    assert_close64(shaped, rewards.double() - 0.1 * k1 * mask, "shaped rewards")
    assert_close64(mean_kl, (k1 * mask).sum() / mask.sum(), "mean kl")

    logp_leaf = logp.clone().requires_grad_()
    loss = kl_loss(logp_leaf, ref, mask, kind="k3", agg="seq-mean-token-mean")
    loss.backward()
    logp64 = logp.double().requires_grad_()
    d = torch.clamp(ref.double() - logp64, -20, 20)
    expected = agg_reference(torch.clamp(torch.exp(d) - d - 1, -10, 10), mask, "seq-mean-token-mean")
    expected.backward()
    assert_close64(loss.detach(), expected.detach(), "kl loss")
    assert_close64(logp_leaf.grad, logp64.grad, "kl loss grad")

    entropy = torch.rand(mask.shape, generator=gen) * 3
    assert_close64(entropy_loss(entropy, mask, "token-mean"), agg_reference(entropy.double(), mask, "token-mean"),
                   "entropy")


def test_fixed_controller_and_warmup():
    ctl = FixedKLController(0.05)
    for _ in range(3):
        ctl.update(current_kl=1.0, n_steps=64)
        assert ctl.value == 0.05
    warm = FixedKLController(0.4, warmup_steps=4)
    seen = []
    for _ in range(6):
        seen.append(warm.value)
        warm.update(current_kl=0.0, n_steps=8)
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])


def test_adaptive_controller_follows_the_formula_and_round_trips():
    ctl = AdaptiveKLController(kl_coef=0.2, target_kl=6.0, horizon=10000)
    beta = 0.2
    for current_kl, n in [(9.0, 256), (2.0, 256), (6.6, 128), (100.0, 512)]:
        ctl.update(current_kl, n)
        error = min(max(current_kl / 6.0 - 1, -0.2), 0.2)
        beta *= 1 + error * n / 10000
        assert ctl.value == pytest.approx(beta, rel=1e-12)
    restored = AdaptiveKLController(kl_coef=1.0, target_kl=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value and restored.num_updates == 4
    with pytest.raises(ValueError, match="kind"):
        FixedKLController(0.1).load_state_dict(ctl.state_dict())

    warm = build_kl_controller("adaptive", 0.2, target_kl=1.0, horizon=100, warmup_steps=2)
    assert warm.value == pytest.approx(0.1)
    warm.update(2.0, 50)  # adapts the un-ramped beta: 0.2 * 1.1
    assert warm.value == pytest.approx(0.22)


def test_bad_inputs_name_the_argument():
    _, mask, old, logp, adv = batch(5)
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(old, logp, adv, mask, clip_c=0.5)
    with pytest.raises(ValueError, match="agg"):
        policy_loss(old, logp, adv, mask, agg="token-max")
    with pytest.raises(ValueError, match="mask"):
        policy_loss(old, logp, adv, mask[:, :3])
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(old, logp, adv[:, :3], mask)
    with pytest.raises(ValueError, match="returns"):
        value_loss(logp, adv.long(), old, mask)
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(logp, old, "k5")
    with pytest.raises(ValueError, match="agg"):
        agg_loss(logp, mask, "mean")
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, target_kl=1.0, horizon=0)
    with pytest.raises(ValueError, match="kind"):
        build_kl_controller("pid", 0.1)
    assert math.isfinite(policy_loss(old, logp, adv, mask, clip_c=float("inf"))[0].item())
