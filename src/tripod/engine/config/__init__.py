"""The PPO trainer's configuration: the typed schema (every field documented where it is declared) and the checks
that need only one section. Loading mechanics (omegaconf merging, unknown-key hints) are in engine/config_loading.py.

One module per part of the schema: data.py, megatron_args.py (`*.optim`, `*.megatron`), models.py (`*.model`, the
actor's and critic's keys), rollout.py (`actor_rollout_ref.rollout` / `.ref`), algorithm.py (`algorithm`,
`reward_model`), trainer.py (`trainer`, `global_profiler`, `rollout`, `async_training`); `TripodConfig` joins them
here and every name is importable from `tripod.engine.config`.

Keys mirror verl's `ppo_megatron_trainer.yaml` wherever they mean the same thing, so a verl user can read a tripod
recipe. Loading is three layers, later wins:

    1. the dataclass defaults (`TripodConfig`),
    2. a YAML recipe (only the keys it changes; see recipes/defaults.yaml for every key),
    3. `key=value` command-line overrides in omegaconf dot-list syntax (`data.train_batch_size=64`).

One default depends on other sections and is resolved when a `TripodConfig` is built (`__post_init__`):
`algorithm.rollout_correction.rollout_is: auto` becomes token or null (`RolloutCorrectionConfig.resolve`,
`TripodConfig.stale_batches`), so the engine and the run's saved config.yaml never hold "auto".

Every field carries an attribute docstring (the string literal right below it): meaning, unit, and the verl /
Megatron-LM name it mirrors. `scripts/gen_config_docs.py` turns them into docs/config.md (a test keeps it in sync);
`python -m tripod.engine.config > recipes/defaults.yaml` (__main__.py) writes every key with its default.

Each section has a `check(key)` that returns its own problems (ranges, choices taken from the registries that
implement them). Checks that need several sections or the world size live in engine/config_validation.py, which
imports this module (never the reverse).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from tripod.engine.config.algorithm import (  # noqa: F401 (re-exported: the schema is importable from here)
    REWARD_COMBINE,
    AlgorithmConfig,
    FilterGroupsConfig,
    KLControlConfig,
    OverlongBufferConfig,
    RewardModelConfig,
    RolloutCorrectionConfig,
)
from tripod.engine.config.common import (  # noqa: F401
    CRITIC_ESTIMATORS,
    DEVICES,
    LR_DECAY_STYLES,
    MOE_LOAD_BALANCING_TYPES,
    OPTIMIZERS,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    _choice,
    _positive,
)
from tripod.engine.config.data import DataConfig
from tripod.engine.config.distillation import (  # noqa: F401 (issue 48: on-policy distillation)
    DistillationConfig,
    DistillationLossConfig,
    TeacherModelConfig,
)
from tripod.engine.config.megatron_args import MegatronConfig, OptimConfig  # noqa: F401
from tripod.engine.config.models import (  # noqa: F401
    ActorConfig,
    CriticConfig,
    LoraConfig,
    ModelConfig,
    PPOModelConfig,
    RouterReplayConfig,
    TrainedModelConfig,
)
from tripod.engine.config.rollout import (  # noqa: F401
    ActorRolloutRefConfig,
    AgentLoopConfig,
    CustomAsyncServerConfig,
    MultiTurnConfig,
    RefConfig,
    RolloutConfig,
    ValKwargsConfig,
)
from tripod.engine.config.trainer import (  # noqa: F401
    AsyncTrainingConfig,
    DivergenceGuardConfig,
    GlobalProfilerConfig,
    RayInitConfig,
    RayKwargsConfig,
    RolloutPlacementConfig,
    TrainerConfig,
)
from tripod.engine.config_loading import (  # noqa: F401 (re-exported)
    ConfigError,
    config_to_yaml,
    load_structured,
    save_resolved_config,
)


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
    ray_kwargs: RayKwargsConfig = field(default_factory=RayKwargsConfig)
    """The Ray cluster of trainer.launcher=ray (read with that launcher only)."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation from a frozen teacher (off by default; engine/config/distillation.py)."""

    def __post_init__(self) -> None:
        # resolved once, wherever a TripodConfig is built (load_config, a rank's config from YAML): the engine reads
        # algorithm.rollout_correction.rollout_is as token / sequence / null, never "auto"
        self.algorithm.rollout_correction.resolve(self.stale_batches)

    @property
    def stale_batches(self) -> bool:
        """Whether a trained sample can come from older weights than the trainer's: the rollout on its own ranks with
        async_training's bound allowing an age above 0 (async_training.max_age), or partial rollouts (a weight
        version may land between two tokens). The rollout's log-probs are then the behaviour policy."""
        a = self.async_training
        return self.separate_rollout and (a.max_age > 0 or a.partial_rollout)

    def rollout_correction_note(self) -> Optional[str]:
        """The one line `tripod train` prints at start (rank 0) when the batches can be stale and rollout_is was set to
        null on purpose (without bypass_mode); else None."""
        rc, a = self.algorithm.rollout_correction, self.async_training
        if not self.stale_batches or rc.rollout_is is not None or rc.bypass_mode:
            return None
        why = (f"samples up to {a.max_age} trainer step(s) old" if a.max_age > 0 else "") + \
              (" and " if a.max_age > 0 and a.partial_rollout else "") + \
              ("partial rollouts" if a.partial_rollout else "")
        left = "nothing corrects for it" if rc.rollout_rs is None else \
            f"rollout_rs={rc.rollout_rs} only drops sequences, it reweights none"
        return (f"algorithm.rollout_correction.rollout_is=null with stale batches ({why}): the update is on-policy in "
                "name only: PPO's ratio is taken against the recomputed old log-probs (the trainer's weights), not "
                f"the behaviour policy that generated the samples, and {left}; set "
                "algorithm.rollout_correction.rollout_is=auto (or token) to weight each token by "
                f"min(pi_old / pi_rollout, {rc.rollout_is_threshold:g}) (decoupled PPO, docs/async.md)")

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
