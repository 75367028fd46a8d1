"""The trained models: `*.model` (HF path, LoRA), the actor's and the critic's PPO keys."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tripod.engine.config.common import _choice, _positive
from tripod.engine.config.megatron_args import MegatronConfig, OptimConfig, _megatron_like_actor


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """A Hugging Face model directory (config.json + weights). verl: model.path."""


@dataclass
class LoraConfig:
    """LoRA adapters on the model's megatron linears (parallel/lora/); verl's Megatron LoRA keys (model.lora.*)."""
    rank: int = 0
    """Rank of each adapter; 0: off (full-parameter training). With rank > 0 the base weights are frozen (no gradient
    buffers, no optimizer state) and only the adapters train; the actor's reference is the actor with its adapters
    switched off (no reference model is built). verl: model.lora.rank."""
    alpha: float = 32.0
    """Scale numerator: adapters add alpha / rank * B @ A @ x (peft's lora_alpha). verl: model.lora.alpha."""
    dropout: float = 0.0
    """Dropout on an adapter's input (peft's lora_dropout; 'pre' position). verl: model.lora.dropout."""
    target_modules: list = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    """Linears that get adapters: megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2; MLA's
    linear_q_proj, linear_q_down_proj, linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj; experts' linears
    share linear_fc1 / linear_fc2), HF names mapped through the family table (q_proj, ..., down_proj: only that part
    of a fused linear), or all-linear. A fused linear gets one adapter per HF module, as peft does. verl:
    model.lora.target_modules."""
    exclude_modules: list = field(default_factory=list)
    """Names (as in target_modules) removed from the targets. verl: model.lora.exclude_modules."""
    merge: bool = True
    """Send merged weights (W + alpha / rank * B @ A, computed on each training shard) to the rollout engine. false: the
    rollout serves the adapters itself, with the base weights pushed once and only the adapters every step (actor,
    rollout.name=vllm only: vLLM's LoRA, engine/rollout/vllm_lora.py; rollout/weight_sync_bytes logs both modes'
    bytes). verl: model.lora.merge."""
    adapter_path: Optional[str] = None
    """A peft adapter directory (adapter_config.json + adapter_model.safetensors) to start from; its r and lora_alpha
    must equal rank and alpha. null: fresh adapters (A as peft's kaiming init, B zero). verl: model.lora.adapter_path."""

    def check(self, key: str) -> list[str]:
        e = [f"{key}.rank={self.rank} must be >= 0 (0 turns LoRA off)"] if self.rank < 0 else []
        if self.rank == 0 and self.adapter_path:
            e.append(f"{key}.adapter_path is set but {key}.rank=0 (LoRA off); set rank to the adapter's r")
        if self.rank > 0:
            e += [f"{key}.alpha={self.alpha} must be > 0"] if not self.alpha > 0 else []
            e += [f"{key}.dropout={self.dropout} must be in [0, 1)"] if not 0 <= self.dropout < 1 else []
            e += [f"{key}.target_modules is empty; name linears or all-linear"] if not self.target_modules else []
        return e


@dataclass
class TrainedModelConfig(ModelConfig):
    """The model section of the actor (with its reference) and the critic."""
    use_remove_padding: bool = True
    """Padding-free packing: lay each micro-batch's rows (with share_prompt_prefix, each prompt with its responses)
    out without padding, several to a model row, apart by a block-diagonal mask (engine/workers/packing.py). Same
    results up to float rounding; never more model slots than without it, fewer where prompts or responses differ in
    length (bench/RESULTS.md). Used where the attention takes an arbitrary mask (megatron's local spec); Transformer
    Engine models and MoE routers that keep token statistics run unpacked. verl: model.use_remove_padding."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters instead of full-parameter training (rank 0: off). verl: model.lora."""


@dataclass
class PPOModelConfig:
    """What the actor and the critic share: batching of the PPO update, its loss aggregation, optimizer, layout."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (x rollout.n responses); the train batch is split into such mini-batches.
    verl: ppo_mini_batch_size."""
    ppo_micro_batch_size_per_gpu: Optional[int] = 4
    """Responses per forward/backward micro-batch on one rank (gradients accumulate over them); null with
    use_dynamic_bsz. verl: ppo_micro_batch_size_per_gpu; Megatron-LM: --micro-batch-size."""
    ppo_epochs: int = 1
    """Passes over the batch per PPO step. verl: ppo_epochs."""
    shuffle: bool = False
    """Shuffle the rows into mini-batches each PPO epoch (seeded alike on every rank). verl: shuffle."""
    loss_agg_mode: str = "token-mean"
    """How token losses reduce to one number (engine.algorithms.AGG_MODES). verl: loss_agg_mode."""
    grad_clip: float = 1.0
    """Global gradient-norm clip. verl: grad_clip; Megatron-LM: --clip-grad."""
    use_dynamic_bsz: bool = False
    """Micro-batches under a token budget (ppo_max_token_len_per_gpu) instead of a fixed row count, at any layout: the
    DP ranks get equal row counts of balanced token sums, each micro-batch keeps its own length (at PP > 1 megatron
    sends each activation's shape first). Same gradients as fixed micro-batches. verl: use_dynamic_bsz."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of one micro-batch with use_dynamic_bsz (prompt + response tokens). verl: same name."""
    share_prompt_prefix: bool = True
    """Run a prompt shared by several rows of a micro-batch (GRPO's n samples) through the model once: its rows are
    packed into one sequence with a block attention mask and per-slot RoPE positions (engine/workers/packing.py).
    Same results up to float rounding, less compute and activation memory. The actor's setting also applies to the
    reference. Used where the attention takes an arbitrary mask (megatron's local spec; not with Transformer
    Engine)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule of this model."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout and seed of this model."""

    def check(self, key: str) -> list[str]:
        from tripod.engine.algorithms import AGG_MODES

        e = _positive({f"{key}.ppo_epochs": self.ppo_epochs})
        if self.ppo_mini_batch_size < 1:
            e.append(f"{key}.ppo_mini_batch_size={self.ppo_mini_batch_size} must be >= 1")
        if not self.use_dynamic_bsz and (self.ppo_micro_batch_size_per_gpu is None
                                         or self.ppo_micro_batch_size_per_gpu < 1):
            e.append(f"{key}.ppo_micro_batch_size_per_gpu={self.ppo_micro_batch_size_per_gpu} must be >= 1 (or set "
                     f"{key}.use_dynamic_bsz=true)")
        if self.grad_clip <= 0:
            e.append(f"{key}.grad_clip={self.grad_clip} must be > 0")
        e += _choice(f"{key}.loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        return e + self.optim.check(f"{key}.optim") + self.megatron.check(f"{key}.megatron")


@dataclass
class RouterReplayConfig:
    mode: str = "disabled"
    """MoE routing replay (parallel/router_replay.py, through megatron-core's RouterReplay): disabled | R2 (the
    experts the actor's old-log-prob forward chose are replayed in its update forwards) | R3 (the rollout engine's
    choices, replayed in the old-log-prob, reference and update forwards; needs
    actor_rollout_ref.rollout.enable_rollout_routing_replay). The routing weights still come from the live router,
    which keeps learning. Refused with full activation recomputation. R2 replays nothing in a step that skips the old-log-prob forward (an exactly on-policy
    update, or rollout_correction.bypass_mode): the update's own forward then routes as that pass would.
    verl: actor.router_replay.mode."""


@dataclass
class PolicyLossConfig:
    """verl's actor.policy_loss: which registered policy loss the actor runs and its loss-specific knobs
    (engine/algorithms/policy_losses.py; every loss and its status: docs/algorithms.md)."""
    loss_mode: str = "vanilla"
    """The policy loss, by its registered name (engine.algorithms.list_policy_losses(): verl 0.9.1's vanilla, gspo,
    sapo, gpg, clip_cov, kl_cov, geo_mean, dro, cispo, dppo_tv, dppo_kl, bypass_mode, and any loss registered with
    engine.algorithms.register_policy_loss, verl's call). vanilla runs on the fused kernel, the others in plain torch.
    verl: actor.policy_loss.loss_mode."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: share of a micro-batch's tokens whose gradient is stopped. verl: same name."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance of the tokens it may stop. verl: same name."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of that covariance. verl: same name."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: share of a micro-batch's tokens (largest covariance) that get the |log-ratio| penalty. verl: same name."""
    ppo_kl_coef: float = 0.1
    """kl_cov: weight of that penalty. verl: same name."""
    dro_beta: Optional[float] = None
    """dro: weight of the quadratic log-ratio penalty; required (> 0) with loss_mode=dro. verl: same name."""

    def check(self, key: str) -> list[str]:
        from tripod.engine.algorithms import list_policy_losses

        e = _choice(f"{key}.loss_mode", self.loss_mode, list_policy_losses())
        if self.loss_mode == "dro" and not (self.dro_beta is not None and self.dro_beta > 0):
            e.append(f"{key}.dro_beta={self.dro_beta} must be > 0 with {key}.loss_mode=dro (e.g. 0.1)")
        if self.loss_mode == "clip_cov" and not (self.clip_cov_ratio > 0 and self.clip_cov_lb < self.clip_cov_ub):
            e.append(f"{key}.clip_cov_ratio={self.clip_cov_ratio} must be > 0 and clip_cov_lb={self.clip_cov_lb} < "
                     f"clip_cov_ub={self.clip_cov_ub}")
        if self.loss_mode == "kl_cov" and not self.kl_cov_ratio > 0:
            e.append(f"{key}.kl_cov_ratio={self.kl_cov_ratio} must be > 0 with {key}.loss_mode=kl_cov")
        return e


@dataclass
class ActorConfig(PPOModelConfig):
    clip_ratio: float = 0.2
    """PPO ratio clip epsilon (default of clip_ratio_low/high). verl: actor.clip_ratio."""
    clip_ratio_low: float = "${.clip_ratio}"
    """Lower clip: ratio >= 1 - clip_ratio_low. verl: actor.clip_ratio_low."""
    clip_ratio_high: float = "${.clip_ratio}"
    """Upper clip: ratio <= 1 + clip_ratio_high (DAPO's clip-higher). verl: actor.clip_ratio_high."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1); dppo_tv / dppo_kl truncate their IS ratio at it.
    verl: actor.clip_ratio_c."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The policy loss and its knobs (docs/algorithms.md). verl: actor.policy_loss."""
    loss_scale_factor: Optional[float] = None
    """seq-mean-token-sum-norm's divisor; null: the batch's response width (rollout.response_length), the same for
    every micro-batch (verl: each micro-batch's width). verl: actor.loss_scale_factor."""
    tau_pos: float = 1.0
    """sapo: gate temperature of tokens with a positive advantage (> 0). verl: actor.tau_pos."""
    tau_neg: float = 1.05
    """sapo: gate temperature of the others (> 0). verl: actor.tau_neg."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus in the actor loss. verl: actor.entropy_coeff."""
    use_kl_loss: bool = False
    """Add a KL(actor || reference) term to the actor loss (GRPO style). verl: actor.use_kl_loss."""
    kl_loss_coef: float = 0.001
    """Weight of that KL loss. verl: actor.kl_loss_coef."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the loss (engine.algorithms.list_kl_kinds: k1/kl, k2/mse, k3/low_var_kl, abs).
    verl: actor.kl_loss_type."""
    target_kl: Optional[float] = None
    """Stop the PPO epochs early when a mini-batch's approximate KL exceeds it; null: off. (Spinning Up's target_kl)"""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    """MoE routing replay (R2 / R3). verl: actor.router_replay."""

    def check(self, key: str = "actor_rollout_ref.actor") -> list[str]:
        from tripod.engine.algorithms import list_kl_kinds

        e = super().check(key)
        if not (self.clip_ratio_low > 0 and self.clip_ratio_high > 0):
            e.append(f"{key}.clip_ratio_low/high = {self.clip_ratio_low}/{self.clip_ratio_high} must be > 0")
        if self.clip_ratio_c <= 1:
            e.append(f"{key}.clip_ratio_c={self.clip_ratio_c} must be > 1 (dual-clip bound)")
        if self.target_kl is not None and self.target_kl <= 0:
            e.append(f"{key}.target_kl={self.target_kl} must be > 0 (or null to disable early stop)")
        if self.loss_scale_factor is not None and not self.loss_scale_factor > 0:
            e.append(f"{key}.loss_scale_factor={self.loss_scale_factor} must be > 0 (or null: the response width)")
        if not (self.tau_pos > 0 and self.tau_neg > 0):
            e.append(f"{key}.tau_pos={self.tau_pos} and {key}.tau_neg={self.tau_neg} must be > 0 (SAPO's gates)")
        e += self.policy_loss.check(f"{key}.policy_loss")
        return e + _choice(f"{key}.kl_loss_type", self.kl_loss_type, list_kl_kinds())


@dataclass
class CriticConfig(PPOModelConfig):
    ppo_mini_batch_size: int = "${actor_rollout_ref.actor.ppo_mini_batch_size}"
    ppo_micro_batch_size_per_gpu: Optional[int] = "${actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu}"
    """Rows per micro-batch of the critic's update and of its value forward (verl's forward_micro_batch_size_per_gpu
    defaults to it); null with use_dynamic_bsz."""
    ppo_epochs: int = "${actor_rollout_ref.actor.ppo_epochs}"
    use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = "${critic.ppo_max_token_len_per_gpu}"
    """Token budget of one micro-batch of the value forward with use_dynamic_bsz. verl: same name."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    megatron: MegatronConfig = field(default_factory=_megatron_like_actor)
    """Parallel layout and seed of the critic (defaults: the actor's)."""
    model: TrainedModelConfig = field(default_factory=lambda: TrainedModelConfig(path="${actor_rollout_ref.model.path}"))
    """The critic's initial weights (default: the actor's model; the value head is freshly initialised)."""
    cliprange_value: float = 0.5
    """Clip of the value prediction around the old value. verl: critic.cliprange_value."""

    def check(self, key: str = "critic") -> list[str]:
        e = super().check(key)
        if self.loss_agg_mode == "seq-mean-token-sum-norm":
            e.append(f"{key}.loss_agg_mode=seq-mean-token-sum-norm is the actor's (its horizon is "
                     "actor.loss_scale_factor); give the critic token-mean, token-sum, seq-mean-token-sum or "
                     "seq-mean-token-mean")
        return e + ([f"{key}.cliprange_value={self.cliprange_value} must be > 0"] if self.cliprange_value <= 0 else [])
