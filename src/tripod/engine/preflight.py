"""Checks that `tripod train` runs before any model is built: everything a user can type or point at.

`prepare_train(recipe, overrides, launch)` loads the config, holds the launch against the recipe, validates the
config for that world and runs `preflight`: the HF model directory and its safetensors headers, the layouts,
the data files, the reward sources, the resume checkpoint (complete, same model) and a writable run directory.
Each problem raises one error whose message names the key or file and the fix; nothing is written except a
probe file in the run directory, which is removed again.
"""
from __future__ import annotations

import errno
import glob
import os
import socket

from tripod.engine.launch import Launch, check_world


def prepare_train(recipe: str, overrides: list[str], launch: Launch):
    """(config, world size) for `tripod train RECIPE overrides` under `launch`, after every cheap check."""
    from tripod.engine.config import load_config
    from tripod.engine.config_validation import validate_config

    cfg = load_config(recipe, overrides)
    world = check_world(cfg, launch)  # the trainer's ranks and the rollout's own (engine/async_rollout/)
    validate_config(cfg, world - cfg.rollout.ranks)
    preflight(cfg, world - cfg.rollout.ranks)
    resolve_threads(cfg, launch.nproc_per_node if launch.kind != "local" else world, announce=launch.rank == 0)
    note = cfg.rollout_correction_note()  # stale batches without rollout correction, set so on purpose
    if note and launch.rank == 0:
        print(note, flush=True)
    return cfg, world


def resolve_threads(cfg, ranks_per_node: int, announce: bool = False) -> None:
    """Write the number of torch threads each rank will use into cfg.trainer.threads_per_rank (0 means auto), so that
    the ranks use it and the run's config.yaml records it."""
    from tripod.engine.launch import threads_per_rank

    t = cfg.trainer
    t.threads_per_rank, source = threads_per_rank(ranks_per_node, t.threads_per_rank)
    if announce and t.device == "cpu":
        decode = cfg.actor_rollout_ref.rollout.decode_threads or t.threads_per_rank
        from tripod.engine.launch import HUGE_PAGES_ENV, huge_pages_on

        huge = "on" if huge_pages_on() else "off"
        print(f"threads: {t.threads_per_rank} per rank ({source}), {ranks_per_node} rank(s) on this node; "
              f"decode steps {decode}; huge-page allocations {huge} ({HUGE_PAGES_ENV})", flush=True)


def check_safetensors(model_dir: str) -> None:
    """Every *.safetensors file of `model_dir` has a readable header and the bytes its header promises."""
    import json
    import struct

    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        size = os.path.getsize(path)
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError("header longer than the file")
                header = json.loads(f.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (struct.error, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"model file {path} is not a readable safetensors file ({e}); re-download or "
                             "re-export actor_rollout_ref.model.path") from None
        if 8 + n + end > size:
            raise ValueError(f"model file {path} is truncated ({size} bytes, its header needs {8 + n + end}); "
                             "re-download or re-export actor_rollout_ref.model.path")


def check_model_dir(path: str | None, key: str) -> None:
    if not path:
        raise ValueError(f"{key} is not set; point it at a Hugging Face model directory (config.json + weights)")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{key}={path} does not exist; point it at a Hugging Face model directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{key}={path} has no config.json; point it at a Hugging Face model directory")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise FileNotFoundError(f"{key}={path} has no *.safetensors weights; save the model with "
                                "safe_serialization=True")
    check_safetensors(path)


def check_run_dir(run_dir: str) -> None:
    """The run directory can be created and written (a full disk or read-only mount fails here, not mid-run)."""
    probe = os.path.join(run_dir, f".tripod-write-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        os.makedirs(run_dir, exist_ok=True)
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
        try:
            os.write(fd, b"x" * 4096)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        why = {errno.EROFS: "read-only file system", errno.ENOSPC: "disk full", errno.EDQUOT: "quota exceeded",
               errno.EACCES: "permission denied", errno.EPERM: "not permitted"}.get(e.errno, e.strerror)
        raise PermissionError(f"trainer.default_local_dir={run_dir} is not writable ({why}); point it at a "
                              "writable directory with free space") from None


def check_resume(cfg, arch, world: int) -> None:
    """An explicit trainer.resume checkpoint is complete, from this model and this world size."""
    import json

    from tripod.engine.checkpoints.manager import COMPLETE, STATE_FILE
    from tripod.parallel.checkpoint import checkpoint_arch

    mode = cfg.trainer.resume
    if mode in ("auto", "disable", "", None):
        return
    if not os.path.isfile(os.path.join(mode, COMPLETE)):
        raise ValueError(f"trainer.resume={mode} is not a complete tripod checkpoint (no {COMPLETE} marker); "
                         "point it at a global_step_<k> directory or use trainer.resume=auto")
    try:
        saved = checkpoint_arch(os.path.join(mode, "actor"))
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"trainer.resume={mode}: cannot read its actor checkpoint ({e})") from None
    if saved != arch:
        diff = [f"{k}={getattr(saved, k)} (model: {getattr(arch, k)})" for k in vars(arch)
                if getattr(saved, k, None) != getattr(arch, k)]
        raise ValueError(f"trainer.resume={mode} holds a different model than actor_rollout_ref.model.path="
                         f"{cfg.actor_rollout_ref.model.path}: {', '.join(diff[:4])}; resume a checkpoint of "
                         "this model")
    with open(os.path.join(mode, STATE_FILE)) as f:
        ranks = json.load(f).get("world_size")
    if ranks != world:
        raise ValueError(f"trainer.resume={mode} was saved by {ranks} ranks and this run has {world}; set "
                         f"trainer.nnodes x trainer.n_gpus_per_node = {ranks}")


def check_stage_splits(cfg, arch) -> None:
    """Every model's pipeline stages against its layer count (uneven num_layers_in_first/last_pipeline_stage
    included): one line naming the key and the fix (parallel/stages.py)."""
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.stages import split_of

    arc = cfg.actor_rollout_ref
    models = [("actor_rollout_ref.actor", arc.actor.megatron, arch)]
    if cfg.uses_critic:
        critic_arch = arch if cfg.critic.model.path == arc.model.path else arch_from_hf(cfg.critic.model.path)
        models.append(("critic", cfg.critic.megatron, critic_arch))
    if cfg.uses_reference:
        models.append(("actor_rollout_ref.ref", arc.ref.megatron, arch))
    if cfg.reward_model.enable:
        models.append(("reward_model", cfg.reward_model.megatron, arch_from_hf(cfg.reward_model.model.path)))
    problems, seen = [], set()
    for key, m, a in models:
        split = split_of(m, a.num_layers)
        if split not in seen:  # the critic and the reference follow the actor's keys by default: say it once
            seen.add(split)
            problems += split.problems(f"{key}.megatron.")
    if problems:
        raise ValueError("; ".join(problems))


def preflight(cfg, world: int) -> None:
    """Everything that can be checked without a model: model files, layouts, rollout TP (and the vLLM backend's
    needs), data, rewards, resume checkpoint and run directory."""
    import torch
    from transformers import AutoTokenizer

    from tripod.engine.data import PromptDataset, prompt_tools
    from tripod.engine.data.token_cache import resolve_cache_dir
    from tripod.engine.rewards import check_data_sources
    from tripod.engine.rollout import validate_rollout_tp
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.context_parallel import check_cp_config
    from tripod.parallel.hybrid_engine import validate_layouts

    if cfg.trainer.device == "cuda" and torch.cuda.device_count() < min(world, cfg.trainer.n_gpus_per_node):
        raise ValueError(f"trainer.device=cuda needs {min(world, cfg.trainer.n_gpus_per_node)} CUDA devices per node, "
                         f"this machine has {torch.cuda.device_count()}; set trainer.device=cpu or launch fewer ranks")
    arc = cfg.actor_rollout_ref
    check_model_dir(arc.model.path, "actor_rollout_ref.model.path")
    if cfg.uses_critic and cfg.critic.model.path != arc.model.path:
        check_model_dir(cfg.critic.model.path, "critic.model.path")
    arch = arch_from_hf(arc.model.path)
    m = arc.actor.megatron
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    check_stage_splits(cfg, arch)
    from tripod.engine.workers.lora_options import lora_problems

    if lora_problems(cfg, arch):  # a LoRA target the family lacks, an unsupported layer, a mismatched adapter
        raise ValueError("; ".join(lora_problems(cfg, arch)))
    check_cp_config(arch, [("actor_rollout_ref.actor", m)] + ([("critic", cfg.critic.megatron)] if cfg.uses_critic
                                                              else []) + [("actor_rollout_ref.ref", arc.ref.megatron)])
    validate_rollout_tp(arch, arc.rollout.tensor_model_parallel_size)
    from tripod.engine.rollout.factory import stop_problems

    if stop_problems(arch, arc.rollout):
        raise ValueError("; ".join(stop_problems(arch, arc.rollout)))
    if arc.rollout.name == "vllm":  # installed, tested release, a family / head size / TP it runs (no vLLM import)
        from tripod.engine.rollout.vllm_engine import require_vllm
        from tripod.parallel.hybrid_engine import reshard_plan_from_config

        rtp = arc.rollout.tensor_model_parallel_size
        groups = reshard_plan_from_config(cfg, world, arch).rollout_tp_groups if rtp > 1 else None
        require_vllm(arch, rtp, on_cuda=cfg.trainer.device == "cuda", rollout_tp_groups=groups)
    validate_layouts(arch, tp, pp, m.weight_replicas(world), arc.rollout.tensor_model_parallel_size, world,
                     first=m.num_layers_in_first_pipeline_stage, last=m.num_layers_in_last_pipeline_stage,
                     vpp=m.virtual_pipeline_model_parallel_size or 1)
    tokenizer_dir = cfg.data.tokenizer or arc.model.path
    if not os.path.isdir(tokenizer_dir):
        raise FileNotFoundError(f"data.tokenizer={tokenizer_dir} does not exist; point it at a tokenizer directory")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    d = cfg.data
    datasets = []
    for files in (d.train_files, d.val_files):
        if files:
            ds = PromptDataset(files, tokenizer, d.prompt_key, d.max_prompt_length, d.filter_overlong_prompts,
                               d.apply_chat_template, d.reward_fn_key, resolve_cache_dir(d.token_cache_dir),
                               prompt_tools(cfg), chat_template_kwargs=dict(d.apply_chat_template_kwargs or {}))
            datasets.append(ds)
            if not cfg.reward_model.enable:  # with a reward model, rows without a rule function get its score
                check_data_sources(ds.data_sources)
    from tripod.engine.agent.rollout import check_agent_inputs

    check_agent_inputs(cfg, tokenizer, datasets)  # multi-turn: tools, interactions, the rows' kwargs, chat template
    if cfg.reward_model.enable:
        from tripod.engine.workers.reward_model import reward_model_problems

        check_model_dir(cfg.reward_model.model.path, "reward_model.model.path")
        problems = reward_model_problems(cfg, tokenizer)
        if problems:
            raise ValueError("; ".join(problems))
    check_resume(cfg, arch, world)
    check_run_dir(cfg.trainer.default_local_dir)
