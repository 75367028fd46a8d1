"""`trainer.*` (steps, validation, checkpoints, logging, the world), `global_profiler.*`, and the asynchronous
schedule's `rollout.*` placement and `async_training.*`."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from tripod.engine.config.common import DEVICES, _choice, _positive


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
    """cpu | cuda. Chosen once per rank by runtime/device.py (cuda: cuda:LOCAL_RANK, set as the current device);
    models, batches, masks, the rollout engine and the kernels all follow it."""
    threads_per_rank: int = 0
    """torch intra-op threads of each rank. 0 (auto): OMP_NUM_THREADS when set, else SLURM_CPUS_PER_TASK in a SLURM
    step, else the cores this process may run on (its affinity mask) divided by the ranks on its node, so ranks that
    share a host never oversubscribe it. Resolved before the ranks start; the run's config.yaml records the number."""
    divergence_guard: DivergenceGuardConfig = field(default_factory=DivergenceGuardConfig)
    """Divergence detection and rollback (see DivergenceGuardConfig; off by default)."""
    launcher: str = "auto"
    """How the ranks start (engine/launch.py, docs/launching.md): auto (torchrun or a multi-task srun when this process
    runs under one, else spawned on this machine), local (spawned here), torchrun, slurm (srun, or sbatch -> srun ->
    torchrun), ray (one Ray actor per rank on the running Ray cluster at RAY_ADDRESS or ray_kwargs.ray_init.address,
    placed by a STRICT_SPREAD placement group of trainer.nnodes bundles: engine/launch_ray.py)."""
    max_restarts: int = 0
    """launcher=ray only: times the driver restarts the whole group from the newest checkpoint after a rank or node
    is lost (needs trainer.resume=auto); 0: stop with one line naming the rank and node. Under torchrun:
    MAX_RESTARTS (recipes/launch_torchrun.sh)."""

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
        e += _choice(f"{key}.launcher", self.launcher, LAUNCHERS)
        if self.max_restarts < 0 or (self.max_restarts and self.launcher != "ray"):
            e.append(f"{key}.max_restarts={self.max_restarts} must be >= 0 and is read with {key}.launcher=ray only "
                     "(torchrun: MAX_RESTARTS=N bash recipes/launch_torchrun.sh)")
        elif self.max_restarts and self.resume != "auto":
            e.append(f"{key}.max_restarts={self.max_restarts} restarts from the newest checkpoint: set "
                     f"{key}.resume=auto (not {self.resume!r})")
        if self.divergence_guard.enabled and self.save_freq <= 0:
            e.append(f"{key}.divergence_guard.enabled=true needs checkpoints to roll back to; set {key}.save_freq "
                     "(e.g. 10)")
        if self.resume not in ("auto", "disable") and not os.path.isdir(os.path.expanduser(self.resume)):
            e.append(f"{key}.resume={self.resume!r} is neither 'auto', 'disable' nor an existing checkpoint directory")
        return e


LAUNCHERS = ("auto", "local", "torchrun", "slurm", "ray")


@dataclass
class RayInitConfig:
    """What `tripod train` with trainer.launcher=ray connects to (verl's ray_kwargs.ray_init)."""
    address: Optional[str] = None
    """The running cluster's address (host:port of its GCS, or ray://host:10001); null: $RAY_ADDRESS, else the cluster
    started on this machine (`ray start`). tripod never starts a cluster. verl: ray_kwargs.ray_init.address."""


@dataclass
class RayKwargsConfig:
    """The Ray cluster of trainer.launcher=ray (engine/launch_ray.py); read with that launcher only."""
    ray_init: RayInitConfig = field(default_factory=RayInitConfig)
    """ray.init's arguments. verl: ray_kwargs.ray_init."""
    placement_timeout_s: float = 300.0
    """Seconds to wait for the cluster to grant the placement group (free GPUs / CPUs on enough nodes, or an
    autoscaler adding them) before stopping with one line saying what is missing (tripod's own key)."""


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

    @property
    def max_age(self) -> int:
        """The largest age of a trained sample in optimizer steps with the rollout on its own ranks, without partial
        rollouts (engine/async_rollout/schedule.py: floor((1 + staleness_threshold) x trigger_parameter_sync_step)
        - 1); 0 for values `check` refuses."""
        from tripod.engine.async_rollout.schedule import StalenessSchedule

        try:
            return StalenessSchedule(self.staleness_threshold, self.trigger_parameter_sync_step, 0).max_age
        except ValueError:  # refused by check()
            return 0

    def check(self, key: str = "async_training") -> list[str]:
        e = []
        if not self.staleness_threshold >= 0:  # also NaN
            e.append(f"{key}.staleness_threshold={self.staleness_threshold} must be >= 0 (0: synchronous streaming)")
        e += _positive({f"{key}.trigger_parameter_sync_step": self.trigger_parameter_sync_step,
                        f"{key}.require_batches": self.require_batches})
        return e
