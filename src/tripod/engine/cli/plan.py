"""`tripod plan CONFIG [key=value ...]`: the hybrid engine's resharding plan and the memory plan of a recipe.

Prints the hybrid engine's resharding plan for the recipe's actor layout and rollout TP (groups, bytes
received and peak extra memory per rank) and the memory plan per rank (params, grads, fp32 main weights, optimizer
states of each model, generation shard, KV cache: parallel/memory_plan.py), without starting any process. It needs
only the model's config.json: a local directory, the local Hugging Face cache, or recipes/model_configs/ for a repo id
(`plan_model_config`).
"""
from __future__ import annotations

import argparse
import os

from tripod import CHECKOUT
from tripod.engine.launch import detect_launch


def _world_size(cfg) -> int:
    launch = detect_launch()
    return launch.world_size if launch.kind != "local" else cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes


MODEL_CONFIGS = CHECKOUT / "recipes" / "model_configs"


def plan_model_config(path: str, key: str = "actor_rollout_ref.model.path") -> str:
    """Where `tripod plan` reads the config.json of `path`: the directory itself, the local Hugging Face cache, or
    the architecture-only copy in recipes/model_configs/<org>--<name>.json (see its README for the sources)."""
    if os.path.exists(path):
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id=path, filename="config.json")
        if isinstance(cached, str):
            return cached
    except Exception:  # not a valid repo id, or no hub client: fall through to the bundled copies
        pass
    bundled = MODEL_CONFIGS / (path.replace("/", "--") + ".json")
    if bundled.is_file():
        return str(bundled)
    raise FileNotFoundError(f"{key}={path}: no local directory, no cached config.json and no {bundled}; "
                            "download the model (or just its config.json) and point the key at it")


def cmd_plan(args: argparse.Namespace) -> int:
    from tripod.engine.config import load_config
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.hybrid_engine import reshard_plan_from_config

    cfg = load_config(args.config, args.overrides)
    world = _world_size(cfg)
    m = cfg.actor_rollout_ref.actor.megatron
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    if world % (tp * pp):
        raise ValueError(f"world size {world} (trainer.n_gpus_per_node * trainer.nnodes) is not a multiple of the "
                         f"actor's TP*PP = {tp}*{pp}")
    source = plan_model_config(cfg.actor_rollout_ref.model.path)
    arch = arch_from_hf(source)
    print(f"architecture: {source}")
    plan = reshard_plan_from_config(cfg, world, arch, bucket_bytes=int(args.bucket_mb * (1 << 20)))
    print(plan.describe())
    from tripod.parallel.memory_plan import plan_from_config

    critic_arch = arch_from_hf(plan_model_config(cfg.critic.model.path, "critic.model.path")) \
        if cfg.uses_critic and cfg.critic.model.path else None
    print("\nmemory per rank (parallel/memory_plan.py):")
    print(plan_from_config(cfg, world, arch, critic_arch).describe())
    return 0


def add_plan_command(subparsers) -> None:
    p = subparsers.add_parser("plan", help="print the hybrid engine's resharding plan of a recipe",
                              description="Layouts, micro-DP and rollout TP groups, bytes and peak memory per rank.")
    p.add_argument("config", help="YAML recipe (see recipes/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size in MiB (default 64)")
    p.set_defaults(func=cmd_plan)
