"""`tripod train CONFIG [key=value ...]` and `tripod plan CONFIG [key=value ...]`.

train: loads the YAML recipe with overrides, validates it against the world size (trainer.n_gpus_per_node *
trainer.nnodes; on CPU each "GPU" is one gloo process), then runs `PPOTrainer.fit()` on every rank: in-process
under torchrun / SLURM's srun, or in locally spawned processes otherwise. Every config or data problem is
reported before any model is built.

plan: prints the hybrid engine's resharding plan for the recipe's actor layout and rollout TP (groups, bytes
received and peak extra memory per rank) and the memory plan per rank (params, grads, fp32 main weights, optimizer
states of each model, generation shard, KV cache: parallel/memory_plan.py), without starting any process.
"""
from __future__ import annotations

import argparse
import os

from engine.cli import run_distributed


def _world_size(cfg) -> int:
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes


def _train_on_rank(config_yaml: str) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from engine.config import TripodConfig
    from engine.trainer import PPOTrainer

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TripodConfig), OmegaConf.create(config_yaml)))
    val = PPOTrainer(cfg).fit()
    if dist.get_rank() == 0 and val:
        print("final validation: " + "  ".join(f"{k}={v:.4f}" for k, v in sorted(val.items())), flush=True)


def cmd_train(args: argparse.Namespace) -> int:
    from engine.config import config_to_yaml, load_config, validate_config

    cfg = load_config(args.config, args.overrides)
    world = _world_size(cfg)
    validate_config(cfg, world)
    if os.environ.get("RANK", "0") == "0":
        preflight(cfg)
    from engine.device import DEVICE_ENV

    os.environ[DEVICE_ENV] = cfg.trainer.device  # read by engine.device.select_device on every rank
    run_distributed(world, _train_on_rank, config_to_yaml(cfg))
    return 0


def preflight(cfg) -> None:
    """Everything that can be checked without a model: HF config, rollout TP, data files and reward sources."""
    from transformers import AutoTokenizer

    from engine.data import PromptDataset
    from engine.rewards import check_data_sources
    from engine.rollout import validate_rollout_tp
    from parallel.arch import arch_from_hf
    from parallel.hybrid_engine import validate_layouts

    arch = arch_from_hf(cfg.actor_rollout_ref.model.path)
    m = cfg.actor_rollout_ref.actor.megatron
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    world = _world_size(cfg)
    validate_rollout_tp(arch, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
    validate_layouts(arch, tp, pp, world // (tp * pp), cfg.actor_rollout_ref.rollout.tensor_model_parallel_size,
                     world)
    tokenizer = AutoTokenizer.from_pretrained(cfg.data.tokenizer or cfg.actor_rollout_ref.model.path)
    d = cfg.data
    for files in (d.train_files, d.val_files):
        if files:
            ds = PromptDataset(files, tokenizer, d.prompt_key, d.max_prompt_length, d.filter_overlong_prompts,
                               d.apply_chat_template, d.reward_fn_key)
            check_data_sources(ds.data_sources)


def cmd_plan(args: argparse.Namespace) -> int:
    from engine.config import load_config
    from parallel.arch import arch_from_hf
    from parallel.hybrid_engine import build_reshard_plan

    cfg = load_config(args.config, args.overrides)
    world = _world_size(cfg)
    m = cfg.actor_rollout_ref.actor.megatron
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    if world % (tp * pp):
        raise ValueError(f"world size {world} (trainer.n_gpus_per_node * trainer.nnodes) is not a multiple of the "
                         f"actor's TP*PP = {tp}*{pp}")
    arch = arch_from_hf(cfg.actor_rollout_ref.model.path)
    plan = build_reshard_plan(arch, tp, pp, world // (tp * pp), cfg.actor_rollout_ref.rollout.tensor_model_parallel_size,
                              bucket_bytes=int(args.bucket_mb * (1 << 20)), world_size=world)
    print(plan.describe())
    from parallel.memory_plan import plan_from_config

    critic_arch = arch_from_hf(cfg.critic.model.path) if cfg.algorithm.adv_estimator == "gae" and \
        cfg.critic.model.path else None
    print("\nmemory per rank (parallel/memory_plan.py; activations not included):")
    print(plan_from_config(cfg, world, arch, critic_arch).describe())
    return 0


def add_train_command(subparsers) -> None:
    p = subparsers.add_parser("train", help="PPO training from a YAML recipe with key=value overrides",
                              description="Run PPO: tripod train recipes/X.yaml a.b=c ...")
    p.add_argument("config", help="YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.train_batch_size=64")
    p.set_defaults(func=cmd_train)


def add_plan_command(subparsers) -> None:
    p = subparsers.add_parser("plan", help="print the hybrid engine's resharding plan of a recipe",
                              description="Layouts, micro-DP and rollout TP groups, bytes and peak memory per rank.")
    p.add_argument("config", help="YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size in MiB (default 64)")
    p.set_defaults(func=cmd_plan)
