"""`tripod train-rm RECIPE [key=value ...]`: reward-model training on preference parquet (engine/reward_training/).

Loads the recipe (schema: engine/reward_training/config.py) with overrides, checks it against the launch like
`tripod train`, reads and checks the preference data and the model directory (one line naming the key or file and the
fix, before any process or model), then runs `RewardModelTrainer.fit()` on every rank: in-process under torchrun /
a multi-task srun, or in locally spawned processes otherwise. It ends by exporting an HF *ForSequenceClassification
directory to `<trainer.default_local_dir>/hf`, which `reward_model.model.path` of `tripod train` takes.
"""
from __future__ import annotations

import argparse
import os

from tripod.engine.launch import check_world, detect_launch, run_distributed


def _train_rm_on_rank(config_yaml: str) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from tripod.engine.reward_training.config import RMTrainConfig
    from tripod.engine.reward_training.trainer import RewardModelTrainer

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RMTrainConfig), OmegaConf.create(config_yaml)))
    val = RewardModelTrainer(cfg).fit()
    if dist.get_rank() == 0 and val:
        print("final validation: " + "  ".join(f"{k}={v:.4f}" for k, v in sorted(val.items())), flush=True)


def prepare_train_rm(recipe: str | None, overrides: list[str], launch):
    """(config, world size) after every check that needs no model: config, launch, model directory, data."""
    from transformers import AutoTokenizer

    from tripod.engine.preflight import check_model_dir, check_run_dir
    from tripod.engine.reward_training.config import load_rm_config
    from tripod.engine.reward_training.data import preference_pairs, score_pad_token
    from tripod.parallel.arch import arch_from_hf

    cfg = load_rm_config(recipe, overrides)
    world = check_world(cfg, launch)
    cfg.check(world)
    check_model_dir(cfg.model.path, "model.path")
    arch = arch_from_hf(cfg.model.path)
    from tripod.parallel.families.spec import check_tp_size
    from tripod.parallel.stages import split_of

    check_tp_size(arch, cfg.megatron.tensor_model_parallel_size)  # the layout against the model's heads and layers
    problems = split_of(cfg.megatron, arch.num_layers).problems("megatron.")
    if problems:
        raise ValueError("; ".join(problems))
    tokenizer = AutoTokenizer.from_pretrained(cfg.data.tokenizer or cfg.model.path)
    score_pad_token(tokenizer)  # the export needs a pad token that is not the EOS
    pairs = preference_pairs(cfg.data.train_files, tokenizer, cfg.data)
    if len(pairs) < cfg.data.train_batch_size:
        raise ValueError(f"data.train_files hold {len(pairs)} preference pairs < data.train_batch_size="
                         f"{cfg.data.train_batch_size}; lower data.train_batch_size or add pairs")
    if cfg.data.val_files:
        preference_pairs(cfg.data.val_files, tokenizer, cfg.data)
    check_run_dir(cfg.trainer.default_local_dir)
    return cfg, world


def cmd_train_rm(args: argparse.Namespace) -> int:
    from tripod.engine.config import config_to_yaml
    from tripod.runtime.device import DEVICE_ENV

    cfg, world = prepare_train_rm(args.config, args.overrides, detect_launch())
    os.environ[DEVICE_ENV] = cfg.trainer.device
    run_distributed(world, _train_rm_on_rank, config_to_yaml(cfg))
    return 0


def add_train_rm_command(subparsers) -> None:
    p = subparsers.add_parser("train-rm", help="reward-model training (Bradley-Terry) on preference parquet",
                              description="Train a reward model: tripod train-rm recipes/X.yaml a.b=c ...")
    p.add_argument("config", help="YAML recipe (every key with its default: recipes/reward_model/defaults.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.train_batch_size=16")
    p.set_defaults(func=cmd_train_rm)
