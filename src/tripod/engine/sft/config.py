"""`tripod train-sft`'s configuration: the typed schema of a supervised fine-tuning run (every field documented where
it is declared) and its checks. The data keys are verl's SFT trainer's (data.messages_key, data.tools_key,
data.max_length, data.truncation, trainer.max_ckpt_to_keep); the model's layout, precision and optimizer sections are
`tripod train`'s own (`MegatronConfig`, `OptimConfig`), so SFT runs on any layout with the same keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tripod.engine.config import MegatronConfig, OptimConfig, TrainedModelConfig, _positive
from tripod.engine.config_loading import ConfigError, load_structured

TRUNCATIONS = ("error", "left", "right")


@dataclass
class SFTDataConfig:
    train_files: list[str] = field(default_factory=list)
    """Parquet files of chat rows: a column of OpenAI-style message lists (role system / user / assistant / tool;
    an assistant message may carry `tool_calls`), and optionally a column of tool schemas."""
    val_files: list[str] = field(default_factory=list)
    """Held-out chat rows (same columns): val/loss per validation."""
    tokenizer: Optional[str] = None
    """Tokenizer directory (its chat template renders the rows); null: model.path's."""
    messages_key: str = "messages"
    """Column of the message lists. verl: data.messages_key."""
    tools_key: str = "tools"
    """Column of each row's tool schemas (OpenAI function schemas, a list or its JSON string), passed to the chat
    template as `tools=`; a file without the column renders without tools. verl: data.tools_key."""
    max_length: int = 1024
    """Tokens of a rendered conversation; longer ones are handled as data.truncation says. verl: data.max_length."""
    truncation: str = "error"
    """A conversation longer than max_length: error (refused, naming the file and row, before any model is built),
    left (keep its last max_length tokens) or right (keep its first max_length). verl: data.truncation."""
    train_batch_size: int = 8
    """Conversations per optimizer step (over all DP ranks). verl: data.train_batch_size."""
    micro_batch_size_per_gpu: int = 1
    """Conversations per forward/backward micro-batch on one rank (packed without padding where the model allows).
    verl: data.micro_batch_size_per_gpu."""
    shuffle: bool = True
    """Shuffle the rows every epoch (seeded by data.seed and the epoch)."""
    seed: int = 1
    """Seed of the shuffle."""

    def check(self, key: str = "data") -> list[str]:
        e = [] if self.train_files else [f"{key}.train_files is empty; give one or more chat-row parquet files"]
        if self.truncation not in TRUNCATIONS:
            e.append(f"{key}.truncation={self.truncation!r} is not one of {list(TRUNCATIONS)}")
        return e + _positive({f"{key}.max_length": self.max_length, f"{key}.train_batch_size": self.train_batch_size,
                              f"{key}.micro_batch_size_per_gpu": self.micro_batch_size_per_gpu})


@dataclass
class SFTTrainerConfig:
    project_name: str = "tripod"
    """Project name (TensorBoard / wandb / MLflow)."""
    experiment_name: str = "sft"
    """Run name."""
    total_epochs: int = 1
    """Passes over the training rows when total_training_steps is null."""
    total_training_steps: Optional[int] = None
    """Optimizer steps of the run; null: total_epochs x (rows // data.train_batch_size)."""
    save_freq: int = -1
    """Checkpoint every this many steps (and at the end); <= 0: only at the end."""
    test_freq: int = -1
    """Validate every this many steps (and at the end); <= 0: only at the end (needs data.val_files)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    max_ckpt_to_keep: Optional[int] = None
    """Keep the newest this many checkpoints, delete older ones (crash-safely); null: keep all. verl:
    trainer.max_ckpt_to_keep."""
    resume: str = "auto"
    """auto: the latest complete checkpoint under default_local_dir/checkpoints; disable; or a global_step_<k> path."""
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    """Run directory: metrics.jsonl, tensorboard/, checkpoints/ (model part `actor`, which `tripod export` reads), and
    hf/ (the exported causal LM, what actor_rollout_ref.model.path of `tripod train` takes)."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Metric sinks: console (progress line), jsonl, tensorboard, wandb, mlflow."""
    n_gpus_per_node: int = 1
    """Ranks per node (CPU: gloo processes)."""
    nnodes: int = 1
    """Nodes."""
    device: str = "cpu"
    """cpu or cuda."""


@dataclass
class SFTConfig:
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    """Chat rows."""
    model: TrainedModelConfig = field(default_factory=TrainedModelConfig)
    """Initial weights (an HF causal LM) and padding-free packing."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout (TP x PP x DP, CP, EP), precision and seed."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule (the schedule spans the run's optimizer steps)."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    """The loop: steps, validation, checkpoints, logging, world."""

    def check(self, world_size: int) -> None:
        """Raise one ConfigError listing every problem of this config for a `world_size`-rank run."""
        from tripod.parallel.precision import DTYPES

        e = self.data.check() + self.optim.check("optim") + self.megatron.check("megatron")
        t, m, d = self.trainer, self.megatron, self.data
        if t.device not in ("cpu", "cuda"):
            e.append(f"trainer.device={t.device!r} is not one of ['cpu', 'cuda']")
        if t.max_ckpt_to_keep is not None and t.max_ckpt_to_keep < 1:
            e.append(f"trainer.max_ckpt_to_keep={t.max_ckpt_to_keep} must be >= 1 or null (keep all)")
        if not d.val_files and (t.val_before_train or t.test_freq > 0):
            e.append("data.val_files is empty but validation is on (trainer.val_before_train / trainer.test_freq); "
                     "give held-out chat rows or set trainer.val_before_train=false trainer.test_freq=-1")
        mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
        if mp >= 1 and world_size % mp:
            e.append(f"megatron: tensor x pipeline x context parallel size = {mp} does not divide the world size "
                     f"{world_size}")
        elif mp >= 1 and d.train_batch_size >= 1 and d.micro_batch_size_per_gpu >= 1:
            dp = world_size // mp
            if d.train_batch_size % (dp * d.micro_batch_size_per_gpu):
                e.append(f"data.train_batch_size={d.train_batch_size} rows do not split over DP={dp} ranks in "
                         f"micro-batches of data.micro_batch_size_per_gpu={d.micro_batch_size_per_gpu}; make it a "
                         f"multiple of {dp * d.micro_batch_size_per_gpu}")
        if m.param_dtype not in DTYPES:
            e.append(f"megatron.param_dtype={m.param_dtype!r} is not one of {list(DTYPES)}")
        if e:
            raise ConfigError(f"{len(e)} configuration problem(s):\n  - " + "\n  - ".join(e))


def load_sft_config(yaml_path: str | None, overrides: list[str] | None = None) -> SFTConfig:
    """Defaults <- YAML recipe <- `key=value` overrides (ConfigError on an unknown key or a wrong type)."""
    return load_structured(SFTConfig, yaml_path, overrides)


if __name__ == "__main__":  # python -m tripod.engine.sft.config > recipes/sft/defaults.yaml
    from omegaconf import OmegaConf

    print("# Every tripod train-sft config key with its default (generated by `python -m tripod.engine.sft.config`; "
          "engine/sft/config.py documents each).")
    print(OmegaConf.to_yaml(OmegaConf.structured(SFTConfig)), end="")
