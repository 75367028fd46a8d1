"""The megatron sections every trained model carries: `*.optim` (megatron-core's OptimizerConfig) and `*.megatron`
(the parallel layout, precision, recompute, offload)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tripod.engine.config.common import LR_DECAY_STYLES, MOE_LOAD_BALANCING_TYPES, OPTIMIZERS, _choice


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
    weights (and Adam states) and reduces gradients in fp32 (parallel/precision.py)."""
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
    """Move this model's parameters to host memory between the phases that use them (runtime/offload.py: the actor's
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
