"""`algorithm.*` (advantages, KL control, DAPO's group filter, rollout correction) and `reward_model.*`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tripod.engine.config.common import _choice, _positive
from tripod.engine.config.megatron_args import MegatronConfig, _reward_model_megatron
from tripod.engine.config.models import ModelConfig


@dataclass
class KLControlConfig:
    type: str = "fixed"
    """KL-in-reward coefficient controller: fixed, or adaptive (Ziegler et al. 2019). verl: kl_ctrl.type."""
    kl_coef: float = 0.001
    """(Initial) KL-in-reward coefficient. verl: kl_ctrl.kl_coef."""
    target_kl: float = 0.1
    """Adaptive controller's KL target per token. verl: kl_ctrl.target_kl."""
    horizon: int = 10000
    """Adaptive controller's horizon, in samples. verl: kl_ctrl.horizon."""
    warmup_steps: int = 0
    """PPO steps with a zero coefficient before the controller starts."""

    def check(self, key: str = "algorithm.kl_ctrl") -> list[str]:
        from tripod.engine.algorithms.controllers import KL_CONTROLLERS

        e = _choice(f"{key}.type", self.type, KL_CONTROLLERS)
        if self.type == "adaptive" and (self.target_kl <= 0 or self.horizon < 1):
            e.append(f"{key}.type=adaptive needs {key}.target_kl > 0 and horizon >= 1 "
                     f"(they are {self.target_kl}, {self.horizon})")
        return e


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (engine/algorithms/dynamic_sampling.py): drop the groups whose responses all score
    alike and keep generating until the train batch is full."""
    enable: bool = False
    """Drop every group (the rollout.n responses of one prompt) whose `metric` values are all equal (std 0: no GRPO
    signal) and generate further batches of data.gen_batch_size prompts until data.train_batch_size groups are kept;
    the surplus is discarded. Needs rollout.n >= 2 and trainer.total_training_steps (the prompts a step uses vary).
    Logged: train/num_gen_batches, dynamic_sampling/*. verl: algorithm.filter_groups.enable."""
    metric: str = "acc"
    """What a group's responses are compared by: acc or score (the rule reward), seq_reward (after the overlong
    penalty), seq_final_reward (after the KL penalty; only without algorithm.use_kl_in_reward, where it equals
    seq_reward). verl: algorithm.filter_groups.metric."""
    max_num_gen_batches: int = 0
    """Generation batches allowed per PPO step; when they keep too few groups the run stops with one line saying
    so. <= 0: no limit. verl: algorithm.filter_groups.max_num_gen_batches."""

    def check(self, key: str = "algorithm.filter_groups") -> list[str]:
        from tripod.engine.algorithms.dynamic_sampling import FILTER_METRICS

        return _choice(f"{key}.metric", self.metric, FILTER_METRICS) if self.enable else []


ROLLOUT_IS_AUTO = "auto"  # algorithm.rollout_correction.rollout_is's default: token with stale batches, else null


@dataclass
class RolloutCorrectionConfig:
    """The train / rollout mismatch (engine/algorithms/rollout_correction.py; verl's algorithm.rollout_correction,
    decoupled mode): each sample's rollout log-probs are kept in the PPO batch beside the recomputed old ones, and
    every step logs rollout_corr/* under verl's names (the gap, the IS weights before truncation, the rejected
    shares). Off by default, except token-level IS when the batches can be stale (rollout_is: auto);
    docs/config.md says where tripod differs from verl."""
    rollout_is: Optional[str] = ROLLOUT_IS_AUTO
    """Truncated importance sampling of the policy loss: token (weight min(pi_old / pi_rollout, threshold) per
    token), sequence (min(product of the sequence's ratios, threshold) for all its tokens), null (off) or auto. The
    weight is detached and multiplies the per-token PG loss. auto is resolved once, when the config is loaded (the
    run's config.yaml records the result): token when the batches can be stale (the rollout on its own ranks with
    async_training's bound allowing a sample older than the trainer's weights, i.e. floor((1 + staleness_threshold)
    x trigger_parameter_sync_step) > 1, or partial_rollout) and bypass_mode is off, else null. Stale, the rollout's
    log-probs are the behaviour policy and the recomputed old log-probs the proximal one: token TIS between them is
    decoupled PPO (docs/async.md). An explicit null with stale batches is allowed and prints one line at start: the
    update is then on-policy in name only. verl: algorithm.rollout_correction.rollout_is, default null (no
    correction; sequence once its section is given); tripod: auto."""
    rollout_is_threshold: float = 2.0
    """Upper bound the IS weights are clamped at (TIS); must be > 0. verl: same name (tripod takes a number only,
    not verl's "lower_upper" IcePop string)."""
    rollout_rs: Optional[str] = None
    """Rejection of whole sequences (they drop out of the response mask before advantages, as in verl):
    seq_mean_k1 (geometric-mean ratio outside [1/threshold, threshold]), seq_mean_k3 (mean k3 divergence
    exp(log r) - 1 - log r above threshold) or null (off). verl: algorithm.rollout_correction.rollout_rs."""
    rollout_rs_threshold: Optional[float] = None
    """Bound of rollout_rs: > 1 for seq_mean_k1 (a ratio, e.g. 1.001), > 0 for seq_mean_k3 (e.g. 0.01); required
    with rollout_rs. verl: same name."""
    bypass_mode: bool = False
    """Use the rollout's log-probs as the old ones and skip the actor's old-log-prob recompute (the PPO ratio is then
    pi_theta / pi_rollout and carries the correction itself). Refused with rollout_is / rollout_rs, which need the
    recompute. verl: algorithm.rollout_correction.bypass_mode (its ppo_clip loss_type)."""

    def resolve(self, stale_batches: bool) -> None:
        """Replace rollout_is=auto by what it stands for (see the field): token when `stale_batches`
        (TripodConfig.stale_batches) and bypass_mode is off, else null. Explicit values are kept. TripodConfig calls
        this when it is built, so the engine never sees "auto"."""
        if self.rollout_is == ROLLOUT_IS_AUTO:
            self.rollout_is = "token" if stale_batches and not self.bypass_mode else None

    @property
    def active(self) -> bool:
        """True when the policy loss is corrected (IS weights or rejection), which needs the recomputed old
        log-probs every step. Only of a resolved section (`resolve`)."""
        if self.rollout_is == ROLLOUT_IS_AUTO:
            raise RuntimeError("algorithm.rollout_correction.rollout_is=auto was not resolved: TripodConfig resolves "
                               "it when it is built (RolloutCorrectionConfig.resolve)")
        return self.rollout_is is not None or self.rollout_rs is not None

    def check(self, key: str = "algorithm.rollout_correction") -> list[str]:
        from tripod.engine.algorithms.rollout_correction import ROLLOUT_IS_LEVELS, ROLLOUT_RS_MODES

        e = _choice(f"{key}.rollout_is", self.rollout_is, (*ROLLOUT_IS_LEVELS, ROLLOUT_IS_AUTO, None))
        e += _choice(f"{key}.rollout_rs", self.rollout_rs, (*ROLLOUT_RS_MODES, None))
        if self.rollout_is not in (None, ROLLOUT_IS_AUTO) and not self.rollout_is_threshold > 0:
            e.append(f"{key}.rollout_is_threshold={self.rollout_is_threshold} must be > 0 (the bound the IS weights "
                     "are clamped at; verl's default is 2.0)")
        rs_threshold = self.rollout_rs_threshold
        if self.rollout_rs is not None and rs_threshold is None:
            e.append(f"{key}.rollout_rs={self.rollout_rs} needs {key}.rollout_rs_threshold (e.g. 1.001 for "
                     "seq_mean_k1, 0.01 for seq_mean_k3)")
        elif self.rollout_rs == "seq_mean_k1" and not rs_threshold > 1:
            e.append(f"{key}.rollout_rs_threshold={rs_threshold} must be > 1 with rollout_rs=seq_mean_k1 (a ratio "
                     "bound: sequences whose geometric-mean ratio leaves [1/t, t] are rejected); e.g. 1.001")
        elif self.rollout_rs is not None and not rs_threshold > 0:
            e.append(f"{key}.rollout_rs_threshold={rs_threshold} must be > 0 (the largest mean k3 divergence kept); "
                     "e.g. 0.01")
        explicit = [(k, v) for k, v in (("rollout_is", self.rollout_is), ("rollout_rs", self.rollout_rs))
                    if v not in (None, ROLLOUT_IS_AUTO)]  # auto resolves to null under bypass_mode
        if self.bypass_mode and explicit:
            which = " and ".join(f"{key}.{k}={v}" for k, v in explicit)
            e.append(f"{key}.bypass_mode=true skips the old-log-prob recompute that {which} needs (old = rollout "
                     f"makes every ratio 1); set {key}.bypass_mode=false or drop the estimator (null)")
        return e


@dataclass
class PfPpoConfig:
    """verl's algorithm.pf_ppo (preference-feedback PPO's resampling of the batch by score); refused when on."""
    reweight_method: str = "pow"
    """pow, max_min or max_random. verl: algorithm.pf_ppo.reweight_method."""
    weight_pow: float = 2.0
    """Exponent of the pow method. verl: algorithm.pf_ppo.weight_pow."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    """Advantage estimator (engine.algorithms.list_adv_estimators: gae, grpo, grpo_vectorized, grpo_passk, gdpo, rloo,
    rloo_vectorized, opo, gpg, reinforce_plus_plus, reinforce_plus_plus_baseline; verl's remax,
    optimal_token_baseline and tir_optimal_token_baseline are refused with the reason; docs/algorithms.md); only gae
    trains a critic. verl: algorithm.adv_estimator."""
    gamma: float = 1.0
    """Discount factor, in [0, 1]. verl: algorithm.gamma."""
    lam: float = 1.0
    """GAE lambda, in [0, 1]. verl: algorithm.lam."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide group-centred scores by the group std (false: Dr. GRPO); also read by grpo_vectorized, grpo_passk
    and gdpo (verl 0.9.1's trainer passes it to grpo and grpo_passk only). verl: same name."""
    use_pf_ppo: bool = False
    """Preference-feedback PPO's resampling of the batch by score after GAE: refused (true) in tripod, whose step does
    not resample its rows. verl: algorithm.use_pf_ppo."""
    pf_ppo: PfPpoConfig = field(default_factory=PfPpoConfig)
    """PF-PPO's settings (read only with use_pf_ppo, which is refused). verl: algorithm.pf_ppo."""
    gdpo_reward_keys: Optional[list] = None
    """GDPO's per-component reward keys: refused (non-null), as tripod's reward functions return one float; gdpo runs
    on that one reward (GRPO whitened over the batch). verl: algorithm.gdpo_reward_keys."""
    gdpo_reward_weights: Optional[list] = None
    """Weights of those components: refused (non-null) with them. verl: algorithm.gdpo_reward_weights."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef * KL(actor || reference) from the token rewards. verl: algorithm.use_kl_in_reward."""
    kl_penalty: str = "kl"
    """KL estimator of the reward penalty (engine.algorithms.list_kl_kinds). verl: algorithm.kl_penalty."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """KL-in-reward coefficient control."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """Dynamic sampling (DAPO; off by default)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Train / rollout mismatch: correction and rollout_corr/* metrics (engine/algorithms/rollout_correction.py; off by
    default, except token-level TIS when the batches can be stale: rollout_is auto). Follows verl's decoupled mode: its
    key names; the IS weight exp(old - rollout) per token or exp(sum over the sequence) per sequence, clamped at
    rollout_is_threshold and detached, multiplying the per-token PG loss; rejected sequences leaving the response mask
    before the advantages; verl's kl and k3_kl metric names. Rejected sequences keep their real scores in their groups'
    statistics (GRPO, RLOO, REINFORCE++-baseline) and get no advantage; a step that rejects every sequence logs its
    metrics and goes on. rollout_corr/* every step the rollout returns log-probs, with verl's names and formulas:
    training_ppl, rollout_ppl, log_ppl_diff, kl, k3_kl, chi2_token, chi2_seq; with rollout_is rollout_is_mean / max /
    min (weights before truncation), rollout_is_std (of the weights clamped to [1/threshold, threshold]) and
    rollout_is_ratio_fraction_high / low; with rollout_rs rollout_rs_masked_fraction (of the response tokens) and
    rollout_rs_seq_masked_fraction (of every sequence). Differs: thresholds are numbers (no "lower_upper" IcePop
    strings, no rollout_is_batch_normalize); rollout_rs is one of seq_mean_k1 / seq_mean_k3 (not a comma list of verl's
    twelve modes), so verl's per-mode rollout_rs_<mode>_* metrics are not logged, nor verl's ESS, seq_* breakdowns,
    training_log_ppl, rollout_log_ppl, log_ppl_abs_diff, log_ppl_diff_max / min and ppl_ratio (the gap is in the names
    above); bypass_mode is verl's ppo_clip loss_type only (no reinforce) and is refused with rollout_is / rollout_rs
    (verl recomputes those inside the loss against pi_theta); verl corrects nothing by default (and its rollout_is
    defaults to sequence once the section is given), tripod's rollout_is is auto: token with stale batches (the rollout
    on its own ranks allowed samples older than the trainer's weights, or partial rollouts) unless bypass_mode, else
    null. Without a recompute (an exactly on-policy step, bypass_mode) the gap is measured on the actor update's first
    mini-batch forward (the step's starting weights; verl logs it against pi_theta on every micro-batch of the update,
    mixing in the update's own drift), and not at all while the actor sits out trainer.critic_warmup. k3_kl clamps the
    log-ratio to +-20 before exp as the other estimators do (verl's does not: it overflows instead). A step that rejects
    every sequence skips the actor and critic updates (verl runs the optimizer on an all-zero mask, where Adam's moments
    and weight decay still move the weights). Added by tripod: rollout_corr/abs_diff_max and abs_diff_mean (|old -
    rollout| per token: the largest and the typical gap)."""

    def check(self, key: str = "algorithm") -> list[str]:
        from tripod.engine.algorithms import REFUSED_ESTIMATORS, list_adv_estimators, list_kl_kinds

        if self.adv_estimator in REFUSED_ESTIMATORS:
            e = [f"{key}.adv_estimator={self.adv_estimator} is refused: {REFUSED_ESTIMATORS[self.adv_estimator]}"]
        else:
            e = _choice(f"{key}.adv_estimator", self.adv_estimator, list_adv_estimators())
        if self.use_pf_ppo:
            e.append(f"{key}.use_pf_ppo=true is refused: PF-PPO resamples the batch's rows by score after the "
                     "advantages, which tripod's step does not do; set it false")
        if self.gdpo_reward_keys is not None or self.gdpo_reward_weights is not None:
            e.append(f"{key}.gdpo_reward_keys / gdpo_reward_weights are refused: tripod's reward functions return one "
                     "float, so gdpo runs on that one reward; set them null")
        e += _choice(f"{key}.kl_penalty", self.kl_penalty, list_kl_kinds())
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            e.append(f"{key}.gamma={self.gamma} and {key}.lam={self.lam} must be in [0, 1]")
        return (e + self.kl_ctrl.check(f"{key}.kl_ctrl") + self.filter_groups.check(f"{key}.filter_groups")
                + self.rollout_correction.check(f"{key}.rollout_correction"))


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment of long responses (engine/rewards/overlong.py): with L = rollout.response_length
    a response of |y| tokens gets min(0, -(|y| - (L - len)) / len * penalty_factor) added to its sequence reward."""
    enable: bool = False
    """Shape the training rewards (validation reports the rule reward alone). Logged as reward/overlong_penalty_mean
    and reward/overlong_frac. verl: reward_model.overlong_buffer.enable (DAPO recipe)."""
    len: int = 0
    """The buffer L_cache, in tokens: the penalty grows linearly over the last `len` tokens before
    rollout.response_length; must be in (0, response_length] when enabled (DAPO: 4096 of 20480).
    verl: reward_model.overlong_buffer.len."""
    penalty_factor: float = 1.0
    """The penalty at the full response length (DAPO: 1.0). verl: reward_model.overlong_buffer.penalty_factor."""

    def check(self, key: str = "reward_model.overlong_buffer") -> list[str]:
        if self.enable and self.penalty_factor < 0:
            return [f"{key}.penalty_factor={self.penalty_factor} must be >= 0 (it is subtracted)"]
        return []


REWARD_COMBINE = ("fallback", "sum")  # how a reward model's score combines with the rule rewards


@dataclass
class RewardModelConfig:
    """Rule rewards, chosen per row by the `data.reward_fn_key` column (see engine.rewards), and optionally a reward
    model: a frozen megatron GPTModel with a scalar score head loaded from an HF *ForSequenceClassification
    checkpoint, read at the last response token (engine/workers/reward_model.py)."""
    enable: bool = False
    """Score responses with the reward model in `model.path` too (combined with the rule rewards as `combine`
    says; logged: reward/model_mean, reward/rule_mean, reward/rule_frac). verl: reward_model.enable."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The reward model: an HF *ForSequenceClassification directory with one label (`score.weight`; `tripod
    train-rm` exports one) and the actor's tokenizer. verl: reward_model.model.path."""
    micro_batch_size_per_gpu: Optional[int] = None
    """Sequences per reward-model forward on one rank; null: all of a rank's rows at once.
    verl: reward_model.micro_batch_size_per_gpu."""
    megatron: MegatronConfig = field(default_factory=_reward_model_megatron)
    """Parallel layout (TP x PP x DP, EP for MoE), precision and seed of the reward model (defaults: the actor's,
    except context_parallel_size: 1, which the reward model needs)."""
    offload: bool = False
    """Keep the reward model's parameters on the host and bring them to the device for each scoring (like
    actor_rollout_ref.ref.offload). verl: reward_model.megatron.param_offload."""
    combine: str = "fallback"
    """fallback: a row's reward is its rule reward where its data source has a rule function, else reward_weight x
    the model's score; sum: rule reward (0 where the data source has none) + reward_weight x the model's score."""
    reward_weight: float = 1.0
    """Factor on the reward model's score before it is combined (tripod's key)."""
    retokenize: bool = False
    """The reward model's tokenizer differs from the actor's: decode each prompt + response with the actor's
    tokenizer and encode the text with the reward model's (`model.path`'s tokenizer files). false refuses such a
    reward model. verl re-tokenizes whenever reward_model.model.input_tokenizer differs."""
    num_workers: int = 1
    """Processes that score responses, per node: each rollout replica's first rank scores the rows its replica
    generated with num_workers / (replicas on its node) of them; <= 1: in that rank's process.
    (verl: reward_model.reward_manager)"""
    timeout_s: float = 10.0
    """Per-response scoring timeout, in seconds; a timed-out response scores 0 and is counted."""
    use_ray: bool = False
    """Score in Ray tasks instead of a local process pool."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """Overlong reward shaping (DAPO; off by default)."""

    def check(self, key: str = "reward_model") -> list[str]:
        e = _positive({f"{key}.num_workers": self.num_workers})
        e += self.overlong_buffer.check(f"{key}.overlong_buffer")
        if self.enable:
            e += _choice(f"{key}.combine", self.combine, REWARD_COMBINE) + self.megatron.check(f"{key}.megatron")
            micro = self.micro_batch_size_per_gpu
            e += [f"{key}.micro_batch_size_per_gpu={micro} must be >= 1 (or null)"] if micro is not None \
                and micro < 1 else []
        return e + ([f"{key}.timeout_s={self.timeout_s} must be > 0 seconds"] if self.timeout_s <= 0 else [])
