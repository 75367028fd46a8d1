"""verl 0.9.1's policy-loss registry with verl's call, so a loss written for verl runs here unchanged.

    @register_policy_loss("name")
    def fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
        -> (loss, metrics)

`actor_rollout_ref.actor.policy_loss.loss_mode` picks one by name (`get_policy_loss_fn`). `config` carries verl's
attribute names (`verl_actor_config`): clip_ratio, clip_ratio_low / high, clip_ratio_c, tau_pos, tau_neg,
loss_agg_mode, loss_scale_factor, policy_loss.{loss_mode, clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio,
ppo_kl_coef, dro_beta, rollout_correction}, global_batch_info, and `.get(name, default)` as verl's configs have.
`global_batch_info` holds the whole mini-batch's normalisers (batch_num_tokens, global_batch_size), the
seq-mean-token-sum-norm horizon (loss_scale_factor) and dp_size 1 (engine/algorithms/losses.py says why), so every
loss that aggregates with `agg_loss(..., **config.global_batch_info)` is exact under DP, TP, PP and micro-batching.

The losses follow verl's formulas (verl/trainer/ppo/core_algos.py); `vanilla` runs on the fused kernel
(kernels/ppo_losses.py), the others in plain torch. Where tripod differs from verl, it says so at the loss:
geo_mean divides by the global batch's sequences (verl: torch.mean over the micro-batch's rows), clip_cov and kl_cov
choose their tokens from the micro-batch's statistics as verl does (so the chosen set depends on the split; their
aggregation is global), bypass_mode takes verl's ppo_clip loss_type only. Metrics are means over the micro-batch's
mask under verl's names ("actor/pg_clipfrac", ...); the actor weights them into mini-batch means.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tripod.engine.algorithms.losses import agg_loss
from tripod.engine.algorithms.masked import masked_mean
from tripod.kernels.ppo_losses import policy_loss_per_token

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]
_LOSSES: dict[str, PolicyLossFn] = {}
LOG_RATIO_BOUND = 20.0


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering `fn` under `name` (verl's `register_policy_loss`; a later registration replaces an
    earlier one, as in verl)."""
    def register(fn: PolicyLossFn) -> PolicyLossFn:
        _LOSSES[name] = fn
        return fn
    return register


def list_policy_losses() -> list[str]:
    return sorted(_LOSSES)


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    if name not in _LOSSES:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.loss_mode={name!r} is not a registered policy loss; "
                         f"choose one of {list_policy_losses()}")
    return _LOSSES[name]


class ConfigView(Mapping):
    """A read-only mapping with attribute access and `.get` (what verl's DictConfig / BaseConfig offer a loss)."""

    def __init__(self, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"the policy-loss config has no {name!r}; it has {sorted(self._values)}") from None

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def verl_actor_config(actor_cfg, global_batch_info: dict[str, Any]) -> ConfigView:
    """verl's actor config as a loss sees it, from tripod's ActorConfig (engine/config/models.py) and the
    mini-batch's `global_batch_info` (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)."""
    pl = actor_cfg.policy_loss
    policy_loss = ConfigView({
        "loss_mode": pl.loss_mode, "clip_cov_ratio": pl.clip_cov_ratio, "clip_cov_lb": pl.clip_cov_lb,
        "clip_cov_ub": pl.clip_cov_ub, "kl_cov_ratio": pl.kl_cov_ratio, "ppo_kl_coef": pl.ppo_kl_coef,
        "dro_beta": pl.dro_beta, "rollout_correction": ConfigView({"loss_type": "ppo_clip"}),
    })
    return ConfigView({
        "clip_ratio": actor_cfg.clip_ratio, "clip_ratio_low": actor_cfg.clip_ratio_low,
        "clip_ratio_high": actor_cfg.clip_ratio_high, "clip_ratio_c": actor_cfg.clip_ratio_c,
        "loss_agg_mode": actor_cfg.loss_agg_mode, "loss_scale_factor": actor_cfg.loss_scale_factor,
        "tau_pos": actor_cfg.tau_pos, "tau_neg": actor_cfg.tau_neg, "entropy_coeff": actor_cfg.entropy_coeff,
        "use_kl_loss": actor_cfg.use_kl_loss, "kl_loss_coef": actor_cfg.kl_loss_coef,
        "kl_loss_type": actor_cfg.kl_loss_type, "ppo_epochs": actor_cfg.ppo_epochs,
        "policy_loss": policy_loss, "global_batch_info": dict(global_batch_info),
    })


def global_batch_info(counted_per_row: torch.Tensor, width: int, loss_scale_factor: float | None
                      ) -> dict[str, float]:
    """verl's `global_batch_info` of a mini-batch from every row's counted response tokens (all DP ranks' rows):
    batch_num_tokens, global_batch_size (non-empty rows), the seq-mean-token-sum-norm horizon (loss_scale_factor,
    else the batch's response `width`, which trimmed micro-batches do not change) and dp_size 1 (the actor's loss
    scale undoes megatron's DP averaging itself: engine/algorithms/losses.py)."""
    horizon = loss_scale_factor if loss_scale_factor is not None else width
    return {"dp_size": 1, "batch_num_tokens": float(counted_per_row.sum()),
            "global_batch_size": float((counted_per_row > 0).sum()), "loss_scale_factor": float(horizon)}


def weighted_policy_metrics(metrics: dict, old: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor,
                            share: torch.Tensor) -> dict[str, torch.Tensor]:
    """A loss's metrics (means over the micro-batch's mask, verl's names with or without "actor/"; floats or tensors)
    times the micro-batch's `share` of the mini-batch's tokens, so that summing them over micro-batches and DP ranks
    gives mini-batch means; actor/ppo_kl computed where the loss logs none (gpg): target_kl and the divergence guard
    read it."""
    out = {(k if k.startswith("actor/") else f"actor/{k}"):
           torch.as_tensor(v, dtype=torch.float32, device=share.device).detach() * share for k, v in metrics.items()}
    if "actor/ppo_kl" not in out:
        out["actor/ppo_kl"] = masked_mean((old - logp).detach().float(), mask) * share
    return out


def _clip_bounds(config) -> tuple[float, float]:
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return low, high


def _weighted(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights.detach().to(pg_losses.dtype)


def _agg(pg_losses, response_mask, loss_agg_mode, config) -> torch.Tensor:
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **config.global_batch_info)


def _metrics(**values: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"actor/{k}": v.detach() for k, v in values.items()}


def _log_ratio(old_log_prob, log_prob, clamp: bool = True) -> torch.Tensor:
    log_ratio = log_prob - old_log_prob
    return log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND) if clamp else log_ratio


@register_policy_loss("vanilla")
def vanilla_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                 rollout_is_weights=None):
    """PPO clip with clip-higher and dual clip (A < 0), on the fused kernel."""
    low, high = _clip_bounds(config)
    pg_losses, clipped, clipped_lower = policy_loss_per_token(old_log_prob, log_prob, advantages, low, high,
                                                              config.get("clip_ratio_c", 3.0))
    loss = _agg(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    with torch.no_grad():
        ppo_kl = masked_mean(-_log_ratio(old_log_prob, log_prob), response_mask)
        return loss, _metrics(pg_clipfrac=masked_mean(clipped.float(), response_mask), ppo_kl=ppo_kl,
                              pg_clipfrac_lower=masked_mean(clipped_lower.float(), response_mask))


def _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
               divergence: str):
    """DPPO (arXiv 2602.04879): -A sg(min(r, clip_ratio_c)) log pi on tokens whose divergence from the old policy
    stays inside the trust region (total variation of the token's probability, or its binary KL)."""
    low, high = _clip_bounds(config)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    clip_c = config.get("clip_ratio_c", 20.0)
    truncated = torch.clamp(ratio, max=clip_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if divergence == "tv":
        positive_ok, negative_ok = (prob - old_prob) <= high, (prob - old_prob) >= -low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        positive_ok = (binary_kl <= high) | (prob <= old_prob)
        negative_ok = (binary_kl <= low) | (prob >= old_prob)
    valid = torch.where(advantages > 0, positive_ok, negative_ok).detach().float()
    pg_losses = -advantages * truncated * log_prob * valid
    loss = _agg(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    with torch.no_grad():
        return loss, _metrics(pg_clipfrac=masked_mean(1.0 - valid, response_mask),
                              ppo_kl=masked_mean(-log_ratio, response_mask),
                              pg_clipfrac_lower=masked_mean((ratio > clip_c).float() * valid, response_mask))


@register_policy_loss("dppo_tv")
def dppo_tv_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                 rollout_is_weights=None):
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                      "tv")


@register_policy_loss("dppo_kl")
def dppo_kl_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                 rollout_is_weights=None):
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                      "kl")


def sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """GSPO's log s_i = mean over the sequence's counted tokens of log(pi / pi_old), [B, 1]."""
    m = response_mask.to(log_ratio.dtype)
    return ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)).unsqueeze(-1)


@register_policy_loss("gspo")
def gspo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean", config=None,
              rollout_is_weights=None):
    """GSPO (arXiv 2507.18071): the clipped objective on the sequence ratio s_i = exp(mean log-ratio), with each
    token's gradient log pi (s_it = sg(s_i) pi / sg(pi)); log s_it clamped at 10 as verl."""
    low, high = _clip_bounds(config)
    log_ratio = log_prob - old_log_prob
    log_seq = log_prob - log_prob.detach() + sequence_log_ratio(log_ratio, response_mask).detach()
    seq_ratio = torch.exp(torch.clamp(log_seq, max=10.0))
    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - low, 1 + high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    loss = _agg(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    with torch.no_grad():
        return loss, _metrics(pg_clipfrac=masked_mean((pg_losses2 > pg_losses1).float(), response_mask),
                              ppo_kl=masked_mean(-log_ratio, response_mask),
                              pg_clipfrac_lower=torch.zeros((), device=loss.device))


@register_policy_loss("sapo")
def sapo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean", config=None,
              rollout_is_weights=None):
    """SAPO (arXiv 2511.20347): a smooth gate sigmoid(tau (r - 1)) 4 / tau instead of the clip (tau_pos for A > 0,
    tau_neg otherwise); always aggregated seq-mean-token-mean, as verl does whatever loss_agg_mode says."""
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    tau_pos = torch.as_tensor(config.tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(config.tau_neg, dtype=advantages.dtype, device=advantages.device)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = -gates * advantages
    loss = _agg(_weighted(pg_losses, rollout_is_weights), response_mask, "seq-mean-token-mean", config)
    zero = torch.zeros((), device=loss.device)
    with torch.no_grad():
        return loss, _metrics(pg_clipfrac=zero, ppo_kl=masked_mean(-log_ratio, response_mask), pg_clipfrac_lower=zero)


@register_policy_loss("gpg")
def gpg_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
             rollout_is_weights=None):
    """GPG: the plain policy gradient -A log pi (no ratio, no clip); verl logs no metric of it."""
    pg_losses = -log_prob * advantages
    return _agg(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config), {}


@register_policy_loss("clip_cov")
def clip_cov_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                  rollout_is_weights=None):
    """Clip-Cov (arXiv 2505.22617): PPO clip, plus the gradient of up to clip_cov_ratio of the micro-batch's
    unclipped tokens whose centred covariance (A - mean A)(log pi - mean log pi) lies in (clip_cov_lb, clip_cov_ub),
    drawn at random, stopped. Token choice over the micro-batch, as verl's."""
    pl = config.policy_loss
    ratio_k = pl.clip_cov_ratio if pl.clip_cov_ratio is not None else 0.0002
    cov_ub = pl.clip_cov_ub if pl.clip_cov_ub is not None else 5.0
    cov_lb = pl.clip_cov_lb if pl.clip_cov_lb is not None else 1.0
    low, high = _clip_bounds(config)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    valid = response_mask > 0
    clip_by_origin = (pg_losses2 > pg_losses1) & valid
    cov_all = ((advantages - masked_mean(advantages, response_mask))
               * (log_prob - masked_mean(log_prob.detach(), response_mask))).detach()
    cov_all[~valid] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(ratio_k * response_mask.sum().item()), 1)
    candidates = torch.nonzero((cov_all < cov_ub) & (cov_all > cov_lb) & valid)
    if len(candidates) > 0:
        candidates = candidates[torch.randperm(len(candidates))[:min(clip_num, len(candidates))]]
    corr = torch.ones_like(advantages)
    corr[candidates[:, 0], candidates[:, 1]] = 0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr
    loss = _agg(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    with torch.no_grad():
        return loss, _metrics(pg_clipfrac=masked_mean((corr == 0).float(), response_mask),
                              ppo_kl=masked_mean(-log_ratio, response_mask))


@register_policy_loss("kl_cov")
def kl_cov_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
    """KL-Cov (arXiv 2505.22617): -A r, plus ppo_kl_coef |log r| on the kl_cov_ratio of the micro-batch's tokens with
    the largest centred covariance of A and log pi. Token choice over the micro-batch, as verl's; its ppo_kl metric
    is the mean |log r|, as verl's."""
    pl = config.policy_loss
    kl_cov_ratio = pl.kl_cov_ratio if pl.kl_cov_ratio is not None else 0.0002
    kl_coef = pl.ppo_kl_coef if pl.ppo_kl_coef is not None else 1.0
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    valid = response_mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    adv = advantages[valid].detach().reshape(-1).cpu()
    logp = log_prob[valid].detach().reshape(-1).cpu()
    if len(adv) > 0:
        cov = (adv - adv.mean()) * (logp - logp.mean())
        top = valid_idx[torch.topk(cov, max(1, int(len(cov) * kl_cov_ratio)), largest=True).indices.to(
            valid_idx.device)]
        width = advantages.shape[1]
        rows, cols = top // width, top % width
        pg_losses = pg_losses.index_put((rows, cols), pg_losses[rows, cols] + kl_coef * log_ratio.abs()[rows, cols])
    loss = _agg(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    with torch.no_grad():
        return loss, _metrics(ppo_kl=masked_mean(log_ratio.abs(), response_mask))


@register_policy_loss("geo_mean")
def geo_mean_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                  rollout_is_weights=None):
    """GMPO (arXiv 2507.20673): -mean_t(A) exp(mean_t clip_sign(log r)) per sequence (token-level clip, sign of A),
    rollout IS weights folded in as their geometric mean per sequence; loss_agg_mode unused. Mean over the global
    batch's sequences (global_batch_size); verl takes torch.mean over the micro-batch's rows, which is the same on
    one micro-batch without all-masked rows and not split-invariant otherwise."""
    low, high = _clip_bounds(config)
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -low, high)
    clipped_log_ratio = sign * torch.min(sign * log_ratio, sign * clamped)
    m = response_mask.to(log_ratio.dtype)
    lengths = m.sum(-1).clamp(min=1)  # verl: + 1e-8, which its bool response_mask's integer sum drops in float32
    ratio = torch.exp((clipped_log_ratio * m).sum(-1) / lengths)
    seq_adv = (advantages * m).sum(-1) / lengths
    pg_losses = -seq_adv * ratio
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights.detach().to(m.dtype) + 1e-10)
        pg_losses = pg_losses * torch.exp((log_w * m).sum(-1) / lengths)
    info = config.global_batch_info
    rows = info.get("global_batch_size")
    rows = pg_losses.shape[0] if rows is None else rows
    loss = pg_losses.sum() / torch.as_tensor(rows, dtype=pg_losses.dtype).clamp(min=1) * info.get("dp_size", 1)
    with torch.no_grad():
        clipped = log_ratio != clamped
        return loss, _metrics(pg_clipfrac=masked_mean((clipped & (advantages > 0)).float(), response_mask),
                              ppo_kl=masked_mean(-log_ratio, response_mask),
                              pg_clipfrac_lower=masked_mean((clipped & (advantages < 0)).float(), response_mask))


@register_policy_loss("dro")
def dro_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
             rollout_is_weights=None):
    """Direct Reward Optimization: -(A log pi - dro_beta / 2 (log r)^2)."""
    beta = config.policy_loss.dro_beta
    if beta is None or beta <= 0:
        raise ValueError("actor_rollout_ref.actor.policy_loss.dro_beta must be > 0 with loss_mode=dro")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    loss = _agg(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    with torch.no_grad():
        return loss, _metrics(ppo_kl=masked_mean(-log_ratio, response_mask))


def cispo_weight(ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """CISPO's token weight sg(clip(r, 1 - low, 1 + high)): clipped and stopped, so the gradient is A * w * grad log pi
    for every token (none is dropped, unlike PPO's clip)."""
    return torch.clamp(ratio, 1 - low, 1 + high).detach()


@register_policy_loss("cispo")
def cispo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
               rollout_is_weights=None):
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(r)) A log pi."""
    low, high = _clip_bounds(config)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    weight = cispo_weight(ratio, low, high)
    pg_losses = -weight * advantages * log_prob
    loss = _agg(_weighted(pg_losses, rollout_is_weights), response_mask, loss_agg_mode, config)
    with torch.no_grad():
        return loss, _metrics(pg_clipfrac=masked_mean((ratio != torch.clamp(ratio, 1 - low, 1 + high)).float(),
                                                      response_mask),
                              ppo_kl=masked_mean(-log_ratio, response_mask),
                              pg_clipfrac_lower=torch.zeros((), device=loss.device))


@register_policy_loss("bypass_mode")
def bypass_mode_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                     rollout_is_weights=None):
    """verl's bypass-mode loss with its ppo_clip loss_type: the old log-probs are the rollout's
    (algorithm.rollout_correction.bypass_mode), PPO clip on pi / pi_rollout, no IS weights (the ratio carries them).
    verl's reinforce loss_type and in-loss rollout_is / rollout_rs are refused when the config is checked."""
    loss_type = config.policy_loss.rollout_correction.get("loss_type", "ppo_clip")
    if loss_type != "ppo_clip":
        raise ValueError(f"bypass_mode loss_type={loss_type!r}: tripod runs verl's ppo_clip loss_type only")
    return vanilla_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, None)
