"""`tripod train CONFIG [key=value ...]`: PPO training from a YAML recipe.

Loads the YAML recipe with overrides, checks it against the launch (trainer.nnodes x trainer.n_gpus_per_node must
match torchrun's --nnodes x --nproc-per-node or srun's tasks; on CPU each "GPU" is one gloo process) and runs every
pre-model check (engine/preflight.py), then runs `PPOTrainer.fit()` on every rank: in-process under torchrun / a
multi-task srun, or in locally spawned processes otherwise.
"""
from __future__ import annotations

import argparse
import os

from tripod.engine.launch import detect_launch, run_training


def _train_on_rank(config_yaml: str) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from tripod.engine.config import TripodConfig
    from tripod.engine.trainer import PPOTrainer

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TripodConfig), OmegaConf.create(config_yaml)))
    if cfg.separate_rollout:  # the trainer's ranks first, then the rollout's own (engine/async_rollout/)
        from tripod.engine.async_rollout.bridge import split_world
        from tripod.engine.async_rollout.server import RolloutServer

        with split_world(cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node) as placement:
            if not placement.is_trainer:
                RolloutServer(cfg, placement).serve()
                return
            val = PPOTrainer(cfg, placement).fit()
    else:
        val = PPOTrainer(cfg).fit()
    if dist.get_rank() == 0 and val:
        print("final validation: " + "  ".join(f"{k}={v:.4f}" for k, v in sorted(val.items())), flush=True)


def cmd_train(args: argparse.Namespace) -> int:
    from tripod.engine.config import config_to_yaml
    from tripod.engine.preflight import prepare_train

    cfg, world = prepare_train(args.config, args.overrides, detect_launch())  # every rank: same verdict
    os.environ.update(rank_environment(cfg))
    run_training(cfg, world, _train_on_rank, config_to_yaml(cfg))  # spawned, in-process, or Ray actors
    return 0


def rank_environment(cfg) -> dict[str, str]:
    """What every rank's process environment must agree on before the process group starts: the device
    (`trainer.device`, read by runtime.device.select_device) and, for SGLang, the NCCL variables it would otherwise
    rewrite only in the process that creates its engine."""
    from tripod.runtime.device import DEVICE_ENV

    env = {DEVICE_ENV: cfg.trainer.device}
    if cfg.actor_rollout_ref.rollout.name == "sglang":
        from tripod.engine.rollout.sglang_engine import sglang_process_env
        env.update(sglang_process_env(dict(cfg.actor_rollout_ref.rollout.engine_kwargs or {})))
    return env


def add_train_command(subparsers) -> None:
    p = subparsers.add_parser("train", help="PPO training from a YAML recipe with key=value overrides",
                              description="Run PPO: tripod train recipes/X.yaml a.b=c ...")
    p.add_argument("config", help="YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.train_batch_size=64")
    p.set_defaults(func=cmd_train)
