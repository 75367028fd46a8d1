"""`tripod train-rm`'s configuration: the typed schema of a reward-model training run (every field documented where
it is declared) and its checks. The model's layout, precision and optimizer sections are `tripod train`'s own
(`MegatronConfig`, `OptimConfig`), so a reward model trains on any layout with the same keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tripod.engine.config import MegatronConfig, ModelConfig, OptimConfig, _positive
from tripod.engine.config_loading import ConfigError, load_structured


@dataclass
class PreferenceDataConfig:
    train_files: list[str] = field(default_factory=list)
    """Parquet files of preferences: `prompt`, `chosen`, `rejected` (strings), or `prompt` and `ranking` (a list of
    >= 2 responses, most preferred first), or both kinds of row."""
    val_files: list[str] = field(default_factory=list)
    """Held-out preference files (same columns): pairwise accuracy and margin per validation."""
    tokenizer: Optional[str] = None
    """Tokenizer directory; null: model.path's."""
    prompt_key: str = "prompt"
    """Column of the prompt text."""
    chosen_key: str = "chosen"
    """Column of the preferred response."""
    rejected_key: str = "rejected"
    """Column of the dispreferred response."""
    ranking_key: str = "ranking"
    """Column of a ranked list of responses (best first); it trains on all N(N-1)/2 of its ordered pairs, weighted
    as reward_model.ranking_weight says."""
    apply_chat_template: bool = False
    """Wrap the prompt in the tokenizer's chat template (as a user turn, generation prompt added)."""
    max_length: int = 512
    """Tokens of prompt + response + EOS; a longer pair is refused before any model is built."""
    train_batch_size: int = 8
    """Preference pairs per optimizer step (over all DP ranks)."""
    micro_batch_size_per_gpu: int = 1
    """Pairs per forward/backward micro-batch on one rank (2 sequences each)."""
    shuffle: bool = True
    """Shuffle the pairs every epoch (seeded by data.seed and the epoch)."""
    seed: int = 1
    """Seed of the shuffle."""

    def check(self, key: str = "data") -> list[str]:
        e = [] if self.train_files else [f"{key}.train_files is empty; give one or more preference parquet files"]
        return e + _positive({f"{key}.max_length": self.max_length, f"{key}.train_batch_size": self.train_batch_size,
                              f"{key}.micro_batch_size_per_gpu": self.micro_batch_size_per_gpu})


@dataclass
class RMLossConfig:
    ranking_weight: str = "per_prompt"
    """Weight of a ranking's pairs in the loss and the train/val metrics: per_prompt (each of a ranking of N responses'
    N(N-1)/2 pairs weighs 1/(N(N-1)/2), so a prompt weighs one pair however many responses it ranks: InstructGPT's
    weighting) or per_pair (every pair 1, so a ranking weighs N(N-1)/2 pairs). A step's loss is the weighted mean over
    its pairs; chosen/rejected rows weigh 1 either way."""

    def check(self, key: str = "reward_model") -> list[str]:
        from tripod.engine.reward_training.data import RANKING_WEIGHTS

        if self.ranking_weight not in RANKING_WEIGHTS:
            return [f"{key}.ranking_weight={self.ranking_weight!r} is not one of {list(RANKING_WEIGHTS)}"]
        return []


@dataclass
class RMTrainerConfig:
    project_name: str = "tripod"
    """Project name (TensorBoard / wandb / MLflow)."""
    experiment_name: str = "reward_model"
    """Run name."""
    total_epochs: int = 1
    """Passes over the training pairs when total_training_steps is null."""
    total_training_steps: Optional[int] = None
    """Optimizer steps of the run; null: total_epochs x (pairs // data.train_batch_size)."""
    save_freq: int = -1
    """Checkpoint every this many steps (and at the end); <= 0: only at the end."""
    test_freq: int = -1
    """Validate every this many steps (and at the end); <= 0: only at the end (needs data.val_files)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    resume: str = "auto"
    """auto: the latest complete checkpoint under default_local_dir/checkpoints; disable; or a global_step_<k> path."""
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    """Run directory: metrics.jsonl, tensorboard/, checkpoints/, and hf/ (the exported *ForSequenceClassification)."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Metric sinks: console (progress line), jsonl, tensorboard, wandb, mlflow."""
    n_gpus_per_node: int = 1
    """Ranks per node (CPU: gloo processes)."""
    nnodes: int = 1
    """Nodes."""
    device: str = "cpu"
    """cpu or cuda."""


@dataclass
class RMTrainConfig:
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    """Preference data."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Initial weights: an HF causal LM (its LM head is replaced by a new score head) or *ForSequenceClassification."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallel layout (TP x PP x DP, EP), precision and seed of the reward model."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule (the schedule spans the run's optimizer steps)."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    reward_model: RMLossConfig = field(default_factory=RMLossConfig)
    """The Bradley-Terry loss: how ranked lists are weighted."""
    trainer: RMTrainerConfig = field(default_factory=RMTrainerConfig)
    """The loop: steps, validation, checkpoints, logging, world."""

    def check(self, world_size: int) -> None:
        """Raise one ConfigError listing every problem of this config for a `world_size`-rank run."""
        from tripod.parallel.precision import DTYPES

        e = self.data.check() + self.reward_model.check() + self.optim.check("optim") + self.megatron.check("megatron")
        t, m, d = self.trainer, self.megatron, self.data
        if t.device not in ("cpu", "cuda"):
            e.append(f"trainer.device={t.device!r} is not one of ['cpu', 'cuda']")
        if not d.val_files and (t.val_before_train or t.test_freq > 0):
            e.append("data.val_files is empty but validation is on (trainer.val_before_train / trainer.test_freq); "
                     "give held-out preference files or set trainer.val_before_train=false trainer.test_freq=-1")
        mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size
        if mp >= 1 and world_size % mp:
            e.append(f"megatron: tensor_model_parallel_size * pipeline_model_parallel_size = {mp} does not divide the "
                     f"world size {world_size}")
        elif mp >= 1 and d.train_batch_size >= 1 and d.micro_batch_size_per_gpu >= 1:
            dp = world_size // mp
            if d.train_batch_size % (dp * d.micro_batch_size_per_gpu):
                e.append(f"data.train_batch_size={d.train_batch_size} pairs do not split over DP={dp} ranks in "
                         f"micro-batches of data.micro_batch_size_per_gpu={d.micro_batch_size_per_gpu}; make it a "
                         f"multiple of {dp * d.micro_batch_size_per_gpu}")
        if m.param_dtype not in DTYPES:
            e.append(f"megatron.param_dtype={m.param_dtype!r} is not one of {list(DTYPES)}")
        if e:
            raise ConfigError(f"{len(e)} configuration problem(s):\n  - " + "\n  - ".join(e))


def load_rm_config(yaml_path: str | None, overrides: list[str] | None = None) -> RMTrainConfig:
    """Defaults <- YAML recipe <- `key=value` overrides (ConfigError on an unknown key or a wrong type)."""
    return load_structured(RMTrainConfig, yaml_path, overrides)


if __name__ == "__main__":  # python -m tripod.engine.reward_training.config > recipes/reward_model/defaults.yaml
    from omegaconf import OmegaConf

    print("# Every tripod train-rm config key with its default (generated by `python -m "
          "tripod.engine.reward_training.config`; engine/reward_training/config.py documents each).")
    print(OmegaConf.to_yaml(OmegaConf.structured(RMTrainConfig)), end="")
