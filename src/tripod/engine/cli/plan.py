"""`tripod plan RECIPE|MODEL [key=value ...] [--per-rank] [--gpu-memory-gb G]`: the hybrid engine's resharding plan
and the memory plan of a run, without starting any process.

RECIPE is a YAML recipe; MODEL (instead of a recipe: tripod's defaults plus the overrides) is a local model
directory, a config.json, or a hub name whose config.json recipes/model_configs/ holds (`plan_model_config`; the
local Hugging Face cache is tried too). It prints the resharding plan for the actor layout and rollout TP (groups,
bytes received and peak extra memory: one row per distinct rank role, `--per-rank` for every rank;
parallel/hybrid_engine/plan_report.py), the memory plan per rank (params, grads, fp32 main weights, optimizer states
of each model, generation shard, KV cache, activations: parallel/memory_plan.py) and where those bytes live in each
phase with the offload keys, with the verdict against the device memory (parallel/memory_phases.py).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from tripod import CHECKOUT
from tripod.engine.launch import detect_launch


def _world_size(cfg) -> int:
    """The trainer's ranks (a launched world also holds the rollout's own, `rollout.nnodes`, after them)."""
    launch = detect_launch()
    own = cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node
    return launch.world_size - own if launch.kind != "local" else cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes


MODEL_CONFIGS = CHECKOUT / "recipes" / "model_configs"  # a source checkout's (an editable install's) bundled configs


def model_config_dirs(recipe: str | None = None) -> list[Path]:
    """Where bundled architecture-only config.json copies are looked up, in order: the nearest `model_configs/` at or
    above the recipe file's directory (recipes/model_configs/ for recipes/<family>/<name>.yaml, wherever the recipes
    are: an installed wheel holds no recipes/, so beside the package is not where they live), then the source
    checkout's recipes/model_configs/ (an editable install)."""
    dirs: list[Path] = []
    if recipe:
        for parent in Path(recipe).resolve().parents:
            if (parent / "model_configs").is_dir():
                dirs.append(parent / "model_configs")
                break
    if MODEL_CONFIGS.is_dir() and MODEL_CONFIGS.resolve() not in [d.resolve() for d in dirs]:
        dirs.append(MODEL_CONFIGS)
    return dirs


def bundled_model_names_in(directory: Path) -> list[str]:
    """The hub names `directory` holds a config.json of (`<org>--<name>.json` -> `org/name`)."""
    return sorted(p.stem.replace("--", "/") for p in directory.glob("*.json"))


def bundled_model_names(recipe: str | None = None) -> list[str]:
    """The hub names of every bundled model_configs/ directory (`model_config_dirs`)."""
    return sorted({n for d in model_config_dirs(recipe) for n in bundled_model_names_in(d)})


def plan_model_config(path: str, key: str = "actor_rollout_ref.model.path", recipe: str | None = None) -> str:
    """Where `tripod plan` reads the config.json of `path`: a local directory or config.json file, the local Hugging
    Face cache, or the architecture-only copy <org>--<name>.json in a bundled model_configs/ (`model_config_dirs`:
    beside `recipe`, then the checkout's; see recipes/model_configs/README.md)."""
    if not path:
        raise FileNotFoundError(f"{key} is not set; give the model on the command line ({key}=DIR) or in the recipe: a "
                                "model directory, its config.json, or one of " + ", ".join(bundled_model_names(recipe)))
    if os.path.exists(path):
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(repo_id=path, filename="config.json")
        if isinstance(cached, str):
            return cached
    except Exception:  # not a valid repo id, or no hub client: fall through to the bundled copies
        pass
    dirs = model_config_dirs(recipe)
    for d in dirs:
        bundled = d / (path.replace("/", "--") + ".json")
        if bundled.is_file():
            return str(bundled)
    searched = "; ".join(f"{d} holds {', '.join(bundled_model_names_in(d)) or 'nothing'}" for d in dirs) or \
        "no model_configs/ directory beside the recipe or in a source checkout"
    raise FileNotFoundError(f"{key}={path}: no local directory or config.json, not in the Hugging Face cache, and no "
                            f"bundled copy ({searched}); point it at a model directory or its config.json")


def _is_recipe(arg: str) -> bool:
    return arg.endswith((".yaml", ".yml"))


def cmd_plan(args: argparse.Namespace) -> int:
    from tripod.engine.config import load_config
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.hybrid_engine import reshard_plan_from_config

    recipe = args.config if _is_recipe(args.config) else None
    if recipe:
        cfg = load_config(args.config, args.overrides)
    else:  # a model: check it before the config, so that a wrong name is the one line printed
        plan_model_config(args.config, "tripod plan MODEL")
        cfg = load_config(None, [f"actor_rollout_ref.model.path={args.config}", *args.overrides])
    world = _world_size(cfg)
    m = cfg.actor_rollout_ref.actor.megatron
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} (trainer.n_gpus_per_node * trainer.nnodes) is not a multiple of the "
                         f"actor's TP*CP*PP = {tp}*{cp}*{pp}")
    source = plan_model_config(cfg.actor_rollout_ref.model.path, recipe=recipe)
    arch = arch_from_hf(source)
    print(f"architecture: {source}")
    plan = reshard_plan_from_config(cfg, world, arch, bucket_bytes=int(args.bucket_mb * (1 << 20)))
    print(plan.describe(per_rank=args.per_rank))
    from tripod.parallel.memory_phases import describe_phases
    from tripod.parallel.memory_plan import plan_from_config
    from tripod.runtime.offload import flags_of

    critic_arch = arch_from_hf(plan_model_config(cfg.critic.model.path, "critic.model.path", recipe)) \
        if cfg.uses_critic and cfg.critic.model.path else None
    rm = cfg.reward_model
    reward_arch = arch_from_hf(plan_model_config(rm.model.path, "reward_model.model.path", recipe)) \
        if rm.enable and rm.model.path else None
    teacher_arch = None  # distillation: the teacher's own checkpoint
    if cfg.distillation.enabled:
        name, teacher = cfg.distillation.teacher()
        teacher_arch = arch_from_hf(plan_model_config(teacher.model_path or "",
                                                      f"distillation.teacher_models.{name}.model_path", recipe))
    print("\nmemory per rank (parallel/memory_plan.py):")
    arc, on_cuda = cfg.actor_rollout_ref, cfg.trainer.device == "cuda"
    gpu_gb = args.gpu_memory_gb if args.gpu_memory_gb is not None else (80.0 if on_cuda else None)
    memory = plan_from_config(cfg, world, arch, critic_arch, reward_arch, gpu_memory_gb=gpu_gb,
                              bucket_bytes=int(args.bucket_mb * (1 << 20)), teacher_arch=teacher_arch)
    print(memory.describe())
    if cfg.separate_rollout:  # the rollout on its own ranks (docs/async.md)
        from tripod.parallel.memory_plan import rollout_ranks_plan

        own = rollout_ranks_plan(cfg, arch, int(args.bucket_mb * (1 << 20)), gpu_gb)
        from tripod.engine.async_rollout.schedule import StalenessSchedule

        a = cfg.async_training
        pushes = StalenessSchedule(a.staleness_threshold, a.trigger_parameter_sync_step, 1).capacity
        print(own.describe(staged=own.generation_shard * pushes))
        from tripod.engine.async_rollout.weights import describe_push  # the push per sending rank

        print(describe_push(plan, cfg.rollout.nnodes * cfg.rollout.n_gpus_per_node, int(args.bucket_mb * (1 << 20))))
    offload = {"actor": flags_of(arc.actor.megatron, True), "critic": flags_of(cfg.critic.megatron, True),
               "reference": flags_of(arc.ref.megatron, False, arc.ref.offload),
               "reward_model": flags_of(rm.megatron, False, rm.offload)} if on_cuda else {}
    cpu_optimizer = frozenset(n for n, c in (("actor", arc.actor.megatron), ("critic", cfg.critic.megatron))
                              if on_cuda and c.optimizer_cpu_offload)
    print("\n" + describe_phases(memory, offload, gpu_gb, cpu_optimizer))
    return 0


def add_plan_command(subparsers) -> None:
    p = subparsers.add_parser("plan", help="print the resharding and memory plan of a recipe or a model",
                              description="Layouts, micro-DP and rollout TP groups, bytes and memory per rank, per "
                                          "phase, and whether the peak fits the device memory.")
    p.add_argument("config", help="YAML recipe (see recipes/), or a model: a local directory, a config.json, or a "
                                  "hub name recipes/model_configs/ holds (then tripod's defaults + the overrides)")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size in MiB (default 64)")
    p.add_argument("--per-rank", action="store_true", help="one row per rank (default: one per distinct rank role)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="device memory in GiB for the fits / does-not-fit verdict (default 80 with "
                        "trainer.device=cuda, none on CPU)")
    p.set_defaults(func=cmd_plan)
