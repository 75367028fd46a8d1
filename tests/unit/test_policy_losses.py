"""Every policy loss of tripod's registry and every aggregation mode against verl 0.9.1's own functions
(verl.trainer.ppo.core_algos, imported as a reference: tests/helpers/verl_reference.py), in float64 on fresh random
inputs: loss, gradient with respect to the log-probs and metrics, with and without rollout-correction IS weights,
with a local and with a global normaliser (verl's global_batch_info). Then split invariance: the loss and gradient of a
global batch equal the sums over 2 DP ranks x 2 micro-batches (trimmed to their own longest row, as use_dynamic_bsz
does) when every part gets the whole batch's `global_batch_info`. And the planted bugs the issue names are caught.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.verl_reference import verl_core_algos
from tripod.engine.algorithms import (
    AGG_MODES,
    agg_loss,
    get_policy_loss_fn,
    global_batch_info,
    list_policy_losses,
    policy_losses,
)
from tripod.engine.algorithms import losses as tripod_losses
from tripod.engine.algorithms.policy_losses import ConfigView

VERL_LOSSES = ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo", "dppo_tv",
               "dppo_kl", "bypass_mode")
SELECT_PER_MICRO_BATCH = ("clip_cov", "kl_cov")  # choose tokens from the micro-batch's statistics (verl's too)
TOL = 1e-9
METRIC_TOL = 1e-7  # verl's masked_mean divides by (count + 1e-8)
KNOBS = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05)
POLICY_KNOBS = dict(clip_cov_ratio=0.1, clip_cov_lb=0.2, clip_cov_ub=5.0, kl_cov_ratio=0.1, ppo_kl_coef=0.1,
                    dro_beta=0.3)


@pytest.fixture(scope="module")
def verl():
    return verl_core_algos()


def problem(seed: int, B: int = 8, T: int = 10):
    """float64 random log-probs near the clip edges, advantages of both signs (token-level), a mask with an empty row
    and a length-1 row, IS weights in (0, 2]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[2] = 0
    lengths[5] = 1
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).clamp(max=-1e-3)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) * 1.5
    weights = torch.rand(B, T, generator=g, dtype=torch.float64) * 2 + 1e-3
    return old, logp, adv, mask, weights


def tripod_config(loss_mode: str, info: dict) -> ConfigView:
    policy = ConfigView({**POLICY_KNOBS, "loss_mode": loss_mode,
                         "rollout_correction": ConfigView({"loss_type": "ppo_clip"})})
    return ConfigView({**KNOBS, "loss_agg_mode": "token-mean", "loss_scale_factor": None, "policy_loss": policy,
                       "global_batch_info": dict(info)})


def verl_config(workers_config, loss_mode: str, info: dict):
    cfg = workers_config.ActorConfig(strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **KNOBS,
                                     policy_loss=workers_config.PolicyLossConfig(loss_mode=loss_mode, **POLICY_KNOBS))
    cfg.global_batch_info.update(info)
    return cfg


def run_loss(fn, config, old, logp, adv, mask, agg, weights, seed=0):
    """(loss, d loss / d logp, metrics as floats) of one call; the torch RNG seeded first (clip_cov draws)."""
    leaf = logp.clone().requires_grad_()
    torch.manual_seed(seed)
    loss, metrics = fn(old, leaf, adv, mask, agg, config, weights)
    (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
    return loss.detach(), torch.zeros_like(logp) if grad is None else grad, {k: float(v) for k, v in metrics.items()}


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def verl_gaps(verl, loss_mode, agg, seed, with_weights, info) -> dict[str, float]:
    """The relative differences of loss, gradient and each shared metric between tripod's and verl's loss."""
    core_algos, workers_config = verl
    old, logp, adv, mask, weights = problem(seed)
    weights = weights if with_weights else None
    ours = run_loss(get_policy_loss_fn(loss_mode), tripod_config(loss_mode, info), old, logp, adv, mask, agg, weights)
    theirs = run_loss(core_algos.get_policy_loss_fn(loss_mode), verl_config(workers_config, loss_mode, info), old,
                      logp, adv, mask.bool(), agg, weights)
    out = {"loss": gap(ours[0], theirs[0]), "grad": gap(ours[1], theirs[1])}
    for key, value in ours[2].items():
        out[key] = abs(value - theirs[2][key])
    return out


def test_the_registry_holds_verls_losses(verl):
    core_algos, _ = verl
    assert set(VERL_LOSSES) == set(core_algos.POLICY_LOSS_REGISTRY), "verl's registry changed: update VERL_LOSSES"
    assert set(VERL_LOSSES) <= set(list_policy_losses())
    with pytest.raises(ValueError, match="choose one of"):
        get_policy_loss_fn("no_such_loss")


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss_mode", VERL_LOSSES)
def test_loss_matches_verl(verl, loss_mode, agg):
    """Local normaliser, with and without IS weights; then verl's global_batch_info (geo_mean: verl's mean over the
    micro-batch's rows ignores it, so it is compared locally only)."""
    infos = [{}] + ([] if loss_mode == "geo_mean" else
                    [{"dp_size": 2, "batch_num_tokens": 97.0, "global_batch_size": 13.0, "loss_scale_factor": 7.0}])
    for seed, (info, with_weights) in enumerate((i, w) for i in infos for w in (False, True)):
        gaps = verl_gaps(verl, loss_mode, agg, 100 + seed, with_weights, info)
        bad = {k: v for k, v in gaps.items() if not v <= (TOL if k in ("loss", "grad") else METRIC_TOL)}
        assert not bad, f"{loss_mode}/{agg} weights={with_weights} info={info}: {bad}"


@pytest.mark.parametrize("agg", AGG_MODES)
def test_agg_loss_matches_verl(verl, agg):
    core_algos, _ = verl
    old, logp, adv, mask, _ = problem(7)
    for info in ({}, {"dp_size": 4, "batch_num_tokens": 50, "global_batch_size": 9, "loss_scale_factor": 3}):
        ours = agg_loss(adv, mask, agg, **info)
        theirs = core_algos.agg_loss(adv, mask, agg, **info)
        assert gap(ours, theirs) <= TOL, f"{agg} {info}: {float(ours)} vs verl {float(theirs)}"


def split_sum(loss_mode: str, agg: str, seed: int, with_weights: bool, part_info=None):
    """(whole-batch loss, its grad, loss summed over 2 ranks x 2 micro-batches, that grad), each part trimmed to its
    own longest row and given the whole batch's global_batch_info, as the actor does (`part_info(mask)`: the info a
    part gets instead, for the planted bugs)."""
    old, logp, adv, mask, weights = problem(seed)
    weights = weights if with_weights else None
    info = global_batch_info(mask.sum(-1), mask.shape[1], None)
    fn, config = get_policy_loss_fn(loss_mode), tripod_config(loss_mode, info)
    whole_loss, whole_grad, _ = run_loss(fn, config, old, logp, adv, mask, agg, weights)
    parts_loss, parts_grad = torch.zeros(()), torch.zeros_like(logp)
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)):  # rank 0: 2 micro-batches, rank 1: 2
        width = max(int(mask[rows].sum(-1).max()), 1)
        cut = (rows, slice(0, width))
        part_config = config if part_info is None else tripod_config(loss_mode, part_info(mask[cut]))
        loss, grad, _ = run_loss(fn, part_config, old[cut], logp[cut], adv[cut], mask[cut], agg,
                                 None if weights is None else weights[cut])
        parts_loss = parts_loss + loss
        parts_grad[cut] += grad
    return whole_loss, whole_grad, parts_loss, parts_grad


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("loss_mode", [m for m in VERL_LOSSES if m not in SELECT_PER_MICRO_BATCH])
def test_loss_is_split_invariant(loss_mode, agg):
    for seed, with_weights in ((1, False), (2, True)):
        whole_loss, whole_grad, parts_loss, parts_grad = split_sum(loss_mode, agg, seed, with_weights)
        assert gap(parts_loss, whole_loss) <= TOL and gap(parts_grad, whole_grad) <= TOL, \
            f"{loss_mode}/{agg}: whole {float(whole_loss)} vs parts {float(parts_loss)}"


def _whole_info_without_horizon(mask):
    whole_mask = problem(1)[3]
    return {**global_batch_info(whole_mask.sum(-1), whole_mask.shape[1], None), "loss_scale_factor": None}


@pytest.mark.parametrize("plant,agg,part_info", [
    ("local normaliser per micro-batch", "token-mean", lambda mask: {}),
    ("horizon of the trimmed micro-batch", "seq-mean-token-sum-norm", _whole_info_without_horizon),
])
def test_split_invariance_catches_a_planted_bug(plant, agg, part_info):
    whole_loss, whole_grad, parts_loss, parts_grad = split_sum("gspo", agg, 1, False, part_info)
    assert max(gap(parts_loss, whole_loss), gap(parts_grad, whole_grad)) > 1e-3, f"planted {plant} went unnoticed"


# ---- planted bugs: each must break the comparison that guards it ----
def _gspo_ratio_per_token(log_ratio, response_mask):
    return log_ratio


def _cispo_weight_not_detached(ratio, low, high):
    return torch.clamp(ratio, 1 - low, 1 + high)


PLANTS = {
    "gspo_sequence_ratio_per_token": (policy_losses, "sequence_log_ratio", _gspo_ratio_per_token, "gspo"),
    "cispo_weight_not_detached": (policy_losses, "cispo_weight", _cispo_weight_not_detached, "cispo"),
    "norm_without_horizon": (tripod_losses, "horizon", lambda loss_mask, loss_scale_factor: 1.0, "vanilla"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_bug_is_caught(verl, plant, monkeypatch):
    module, attr, bug, loss_mode = PLANTS[plant]
    monkeypatch.setattr(module, attr, bug)
    gaps = verl_gaps(verl, loss_mode, "seq-mean-token-sum-norm", 100, False, {})
    assert max(gaps.values()) > 1e-3, f"planted {plant} went unnoticed: {gaps}"
