"""The PPO trainer's configuration: typed defaults, YAML + command-line loading, and up-front validation.

Keys mirror verl's `ppo_megatron_trainer.yaml` wherever they mean the same thing, so a verl user can read a tripod
recipe. Loading is three layers, later wins:

    1. the dataclass defaults below (`TripodConfig`),
    2. a YAML recipe (only the keys it changes; see recipes/defaults.yaml for every key),
    3. `key=value` command-line overrides in omegaconf dot-list syntax (`data.train_batch_size=64`).

`load_config` returns a plain `TripodConfig` dataclass instance with every `${...}` interpolation resolved (attribute
access, picklable for Ray). `validate_config(cfg, world_size)` checks the whole config against the world it will run
in and raises one `ConfigError` listing every problem, each naming its key and the fix.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
# KL estimators by verl's names: k1 == "kl", k2 == "mse", k3 == "low_var_kl".
KL_PENALTIES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")  # = engine.algorithms.losses.AGG_MODES
ROLLOUT_NAMES = ("embedded", "sglang")
LOGGER_BACKENDS = ("console", "tensorboard", "jsonl")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
OPTIMIZERS = ("adam", "sgd")  # megatron-core OptimizerConfig.optimizer
DEVICES = ("cpu", "cuda")


class ConfigError(ValueError):
    """A configuration problem; the message names every offending key and how to fix it."""


# ---------------------------------------------------------------------------------------------- schema
@dataclass
class DataConfig:
    train_files: Any = field(default_factory=list)  # a parquet path or a list of them
    val_files: Any = field(default_factory=list)
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"  # column that selects the reward function (verl's data.reward_fn_key)
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024  # prompts per PPO step (each sampled rollout.n times)
    val_batch_size: Optional[int] = None  # None: the whole validation set in one batch
    shuffle: bool = True
    seed: int = 1
    filter_overlong_prompts: bool = True
    apply_chat_template: bool = True
    tokenizer: Optional[str] = None  # None: the actor model's tokenizer


@dataclass
class OptimConfig:
    optimizer: str = "adam"
    """adam | sgd: megatron-core's optimizer (Megatron-LM's --optimizer); sgd uses megatron's momentum 0.9."""
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    lr_warmup_steps: int = -1  # < 0: use lr_warmup_steps_ratio * total steps
    lr_warmup_steps_ratio: float = 0.0
    lr_decay_style: str = "constant"
    min_lr_ratio: float = 0.0


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False  # only meaningful with tensor_model_parallel_size > 1
    seed: int = 42


def _megatron_like_actor() -> MegatronConfig:
    base = "${actor_rollout_ref.actor.megatron."
    return MegatronConfig(tensor_model_parallel_size=base + "tensor_model_parallel_size}",
                          pipeline_model_parallel_size=base + "pipeline_model_parallel_size}",
                          virtual_pipeline_model_parallel_size=base + "virtual_pipeline_model_parallel_size}",
                          sequence_parallel=base + "sequence_parallel}", seed=base + "seed}")


@dataclass
class ModelConfig:
    path: Optional[str] = None  # a Hugging Face model directory (config.json + weights)


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x rollout.n responses)
    ppo_micro_batch_size_per_gpu: Optional[int] = 4
    ppo_epochs: int = 1
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: float = "${.clip_ratio}"
    clip_ratio_high: float = "${.clip_ratio}"
    clip_ratio_c: float = 3.0  # dual-clip lower bound for negative advantages
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    target_kl: Optional[float] = None  # early-stop the PPO epochs when approx KL exceeds it; None = off
    grad_clip: float = 1.0
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class ValKwargsConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False
    n: int = 1


@dataclass
class RolloutConfig:
    name: str = "embedded"
    tensor_model_parallel_size: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    n: int = 1
    do_sample: bool = True
    prompt_length: int = "${data.max_prompt_length}"
    response_length: int = "${data.max_response_length}"
    gpu_memory_utilization: float = 0.5
    mem_fraction_static: float = "${.gpu_memory_utilization}"  # SGLang's name for the same budget
    log_prob_micro_batch_size_per_gpu: Optional[int] = "${actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu}"
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)


@dataclass
class RefConfig:
    megatron: MegatronConfig = field(default_factory=_megatron_like_actor)
    offload: bool = False  # keep params on CPU, swap them in for the reference forward
    log_prob_micro_batch_size_per_gpu: Optional[int] = "${actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu}"


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class CriticConfig:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(
        path="${actor_rollout_ref.model.path}"))
    ppo_mini_batch_size: int = "${actor_rollout_ref.actor.ppo_mini_batch_size}"
    ppo_micro_batch_size_per_gpu: Optional[int] = "${actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu}"
    ppo_epochs: int = "${actor_rollout_ref.actor.ppo_epochs}"
    shuffle: bool = False
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    grad_clip: float = 1.0
    use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"
    ppo_max_token_len_per_gpu: int = 32768
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    megatron: MegatronConfig = field(default_factory=_megatron_like_actor)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive (Ziegler et al. 2019)
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000
    warmup_steps: int = 0


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)


@dataclass
class RewardModelConfig:
    """Rule rewards chosen per sample by `data.reward_fn_key` (see engine.rewards)."""
    reward_fn_key: str = "${data.reward_fn_key}"
    num_workers: int = 1  # <= 1: score in-process
    timeout_s: float = 10.0  # per sample; a timed-out sample scores 0 and is counted
    use_ray: bool = False


@dataclass
class TrainerConfig:
    project_name: str = "tripod"
    experiment_name: str = "run"
    total_epochs: int = 1
    total_training_steps: Optional[int] = None  # None: total_epochs * steps per epoch
    save_freq: int = -1  # <= 0: only at the end
    test_freq: int = -1  # <= 0: no periodic validation
    val_before_train: bool = True
    resume: str = "auto"  # auto | disable | a checkpoint directory
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    n_gpus_per_node: int = 1
    nnodes: int = 1
    critic_warmup: int = 0  # steps that train only the critic
    seed: int = 1
    device: str = "cpu"


@dataclass
class TripodConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# ---------------------------------------------------------------------------------------------- loading
def _unknown_keys(schema: DictConfig, user: Any, prefix: str = "") -> list[str]:
    """Every key in `user` that the schema does not have, as a message with close matches."""
    problems = []
    if not isinstance(user, DictConfig):
        return problems
    for key in user.keys():
        full = f"{prefix}{key}"
        if key not in schema:
            near = difflib.get_close_matches(str(key), [str(k) for k in schema.keys()], n=1)
            hint = f"did you mean '{prefix}{near[0]}'? " if near else ""
            problems.append(f"{full}: unknown key; {hint}valid keys under '{prefix.rstrip('.') or '<root>'}' "
                            f"are {sorted(str(k) for k in schema.keys())}")
        elif isinstance(schema._get_node(key), DictConfig):
            problems += _unknown_keys(schema[key], user._get_node(key), f"{full}.")
    return problems


def _merge(base: DictConfig, layer: DictConfig, source: str) -> DictConfig:
    problems = _unknown_keys(base, layer)
    if problems:
        raise ConfigError(f"{source} has keys tripod does not know:\n  - " + "\n  - ".join(problems))
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        reason = str(e).splitlines()[0]
        raise ConfigError(f"{source}: bad value for {key}: {reason}; give {key} a value of the type in "
                          "engine/config.py (see recipes/defaults.yaml)") from None


def load_config(yaml_path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> TripodConfig:
    """Defaults <- YAML recipe <- `key=value` overrides, resolved into a `TripodConfig` dataclass.

    Raises ConfigError for an unknown key (with the closest valid key), a value of the wrong type, a malformed
    override, or a missing YAML file. Semantic checks against the world size are `validate_config`'s job.
    """
    cfg = OmegaConf.structured(TripodConfig)
    if yaml_path is not None:
        yaml_path = os.fspath(yaml_path)
        if not os.path.isfile(yaml_path):
            raise ConfigError(f"config file {yaml_path} does not exist; pass an existing YAML recipe (see recipes/)")
        loaded = OmegaConf.load(yaml_path)
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"config file {yaml_path} must hold a mapping of keys at the top level")
        cfg = _merge(cfg, loaded, f"config file {yaml_path}")
    overrides = list(overrides or [])
    bad = [o for o in overrides if "=" not in o or o.startswith(("+", "~"))]
    if bad:
        raise ConfigError(f"overrides {bad} are not of the form key=value (e.g. data.train_batch_size=64); "
                          "tripod has no '+key'/'~key' syntax: every key already exists with a default")
    if overrides:
        cfg = _merge(cfg, OmegaConf.from_dotlist(overrides), f"command-line overrides {overrides}")
    for key in ("data.train_files", "data.val_files"):  # a single path is a one-element list
        value = OmegaConf.select(cfg, key)
        if value is None:
            OmegaConf.update(cfg, key, [], merge=False)
        elif isinstance(value, str):
            OmegaConf.update(cfg, key, [value], merge=False)
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"cannot resolve {key}: {str(e).splitlines()[0]}") from None


def config_to_yaml(cfg: TripodConfig | DictConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg) if not isinstance(cfg, DictConfig) else cfg, resolve=True)


def save_resolved_config(cfg: TripodConfig | DictConfig, run_dir: str | os.PathLike) -> str:
    """Write the fully resolved config to `run_dir/config.yaml` (load it back with `load_config`); returns the path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(os.fspath(run_dir), "config.yaml")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(config_to_yaml(cfg))
    os.replace(tmp, path)
    return path


# validation lives in its own module; re-exported here so callers import everything from engine.config
if __name__ != "__main__":  # (as a script this file only prints the defaults)
    from engine.config_validation import data_parallel_size, validate_config  # noqa: E402,F401


if __name__ == "__main__":  # python -m engine.config > recipes/defaults.yaml
    print("# Every tripod config key with its default (generated by `python -m engine.config`).", end="\n")
    print(OmegaConf.to_yaml(OmegaConf.structured(TripodConfig)), end="")
