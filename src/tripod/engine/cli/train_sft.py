"""`tripod train-sft RECIPE [key=value ...]`: supervised fine-tuning on chat rows (engine/sft/).

Loads the recipe (schema: engine/sft/config.py) with overrides, checks it against the launch like `tripod train`,
checks the model directory and layout, and renders every train and validation conversation with the tokenizer's chat
template (one line naming the key or file, the row and the fix, before any process or model), then runs
`SFTTrainer.fit()` on every rank: in-process under torchrun / a multi-task srun, or in locally spawned processes
otherwise. It ends by exporting an HF causal-LM directory to `<trainer.default_local_dir>/hf`, which
`actor_rollout_ref.model.path` of `tripod train` takes.
"""
from __future__ import annotations

import argparse
import os

from tripod.engine.launch import check_world, detect_launch, run_distributed


def _train_sft_on_rank(config_yaml: str) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from tripod.engine.sft.config import SFTConfig
    from tripod.engine.sft.trainer import SFTTrainer

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SFTConfig), OmegaConf.create(config_yaml)))
    val = SFTTrainer(cfg).fit()
    if dist.get_rank() == 0 and val:
        print("final validation: " + "  ".join(f"{k}={v:.4f}" for k, v in sorted(val.items())), flush=True)


def prepare_train_sft(recipe: str | None, overrides: list[str], launch):
    """(config, world size) after every check that needs no model: config, launch, model directory, layout, data."""
    from transformers import AutoTokenizer

    from tripod.engine.preflight import check_model_dir, check_run_dir
    from tripod.engine.sft.config import load_sft_config
    from tripod.engine.sft.data import chat_rows
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.families.spec import check_tp_size
    from tripod.parallel.stages import split_of

    cfg = load_sft_config(recipe, overrides)
    world = check_world(cfg, launch)
    cfg.check(world)
    check_model_dir(cfg.model.path, "model.path")
    arch = arch_from_hf(cfg.model.path)
    if arch.score_head:
        raise ValueError(f"model.path={cfg.model.path} is a *ForSequenceClassification checkpoint; SFT trains a "
                         "causal LM: point model.path at one")
    check_tp_size(arch, cfg.megatron.tensor_model_parallel_size)  # the layout against the model's heads and layers
    problems = split_of(cfg.megatron, arch.num_layers).problems("megatron.")
    if problems:
        raise ValueError("; ".join(problems))
    tokenizer = AutoTokenizer.from_pretrained(cfg.data.tokenizer or cfg.model.path)
    rows = chat_rows(cfg.data.train_files, tokenizer, cfg.data)
    if len(rows) < cfg.data.train_batch_size:
        raise ValueError(f"data.train_files hold {len(rows)} conversations < data.train_batch_size="
                         f"{cfg.data.train_batch_size}; lower data.train_batch_size or add rows")
    if cfg.data.val_files:
        chat_rows(cfg.data.val_files, tokenizer, cfg.data)
    check_run_dir(cfg.trainer.default_local_dir)
    return cfg, world


def cmd_train_sft(args: argparse.Namespace) -> int:
    from tripod.engine.config import config_to_yaml
    from tripod.runtime.device import DEVICE_ENV

    cfg, world = prepare_train_sft(args.config, args.overrides, detect_launch())
    os.environ[DEVICE_ENV] = cfg.trainer.device
    run_distributed(world, _train_sft_on_rank, config_to_yaml(cfg))
    return 0


def add_train_sft_command(subparsers) -> None:
    p = subparsers.add_parser("train-sft", help="supervised fine-tuning on chat rows (loss on assistant tokens)",
                              description="Fine-tune a causal LM on parquet chat rows: tripod train-sft recipes/X.yaml "
                                          "a.b=c ...")
    p.add_argument("config", help="YAML recipe (every key with its default: recipes/sft/defaults.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.train_batch_size=16")
    p.set_defaults(func=cmd_train_sft)
