"""`tripod export CKPT_DIR HF_DIR [--tp --pp --ep --etp --dtype] [--merge | --lora]`: tripod checkpoint -> HF
safetensors + config.json (a causal LM; a reward model or critic as a one-label *ForSequenceClassification:
parallel/checkpoint.py). A LoRA checkpoint exports with `--merge` (the HF model with W + alpha / rank * B @ A) or
`--lora` (a peft adapter directory for the base model the checkpoint records: parallel/lora/checkpoint.py)."""
from __future__ import annotations

import argparse
import json
import os

from tripod.engine.cli.convert import add_expert_args, check_parallel_sizes, experts_suffix, say
from tripod.engine.launch import is_rank_zero, run_distributed


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from tripod.parallel.checkpoint import export_checkpoint_to_hf, exported_arch, min_world_size

    arch = exported_arch(args.ckpt_dir)
    check_parallel_sizes(arch, args.tp, args.pp, args.ep, args.etp)
    if check_lora_flags(args):
        return export_lora(args)
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    run_distributed(min_world_size(args.tp, args.pp, args.ep, args.etp), export_checkpoint_to_hf, args.ckpt_dir,
                    args.hf_dir, args.tp, args.pp, dtype, args.ep, args.etp)
    say(f"tripod export: {args.ckpt_dir} -> {args.hf_dir} ({arch.family}"
        f"{', ' + arch.hf_config['architectures'][0] if arch.score_head else ''}, loaded at TP{args.tp} x PP{args.pp}"
        f"{experts_suffix(args)})")
    if is_rank_zero():
        say_extra_layers(args.ckpt_dir, arch)
        with open(os.path.join(args.hf_dir, "config.json")) as f:
            bias = json.load(f).get("tripod_value_bias")
        if bias is not None:
            say(f"tripod export: the critic's value-head bias {bias:.6g} is not in HF's score (it has none): "
                "transformers reads every value minus it; config.json keeps it as tripod_value_bias")
    return 0


def say_extra_layers(ckpt_dir: str, arch) -> None:
    """One line on the checkpoint's MTP layers (left out of the model): copied unchanged, or why they are not."""
    from tripod.parallel.checkpoint import EXTRA_LAYERS_KEY, read_checkpoint_metadata
    from tripod.parallel.convert import extra_layers_of, family_of

    source = read_checkpoint_metadata(ckpt_dir).get(EXTRA_LAYERS_KEY)
    if source is None:
        return
    what = f"layers past num_hidden_layers={arch.num_layers} ({family_of(arch).extra_hf_layers})"
    if os.path.isdir(source):
        say(f"tripod export: {len(extra_layers_of(arch, source))} tensor(s) of {what} copied unchanged from {source}")
    else:
        say(f"tripod export: {what} not written: {source}, the checkpoint that held them, is gone")


def check_lora_flags(args: argparse.Namespace) -> bool:
    """Whether the peft adapter export (`--lora`) was asked for; one line where the flags do not fit the checkpoint."""
    from tripod.parallel.checkpoint import is_critic_checkpoint, read_checkpoint_metadata
    from tripod.parallel.lora.checkpoint import saved_lora

    lora = saved_lora(read_checkpoint_metadata(args.ckpt_dir))
    if (args.lora or args.merge) and not lora:
        raise ValueError(f"{args.ckpt_dir}: holds no LoRA adapters (saved with model.lora.rank 0); export it without "
                         f"--{'lora' if args.lora else 'merge'}")
    if lora and not (args.lora or args.merge):
        raise ValueError(f"{args.ckpt_dir}: holds LoRA adapters (rank {lora['rank']}); pass --merge for the merged HF "
                         "model or --lora for a peft adapter directory")
    if args.lora and is_critic_checkpoint(args.ckpt_dir):
        raise ValueError(f"{args.ckpt_dir}: a critic (value head, fully trained beside its adapters) exports with "
                         "--merge; --lora writes a causal LM's adapters")
    if args.lora and args.dtype is not None:
        raise ValueError(f"--dtype {args.dtype}: --lora writes the adapters as saved; drop --dtype")
    return bool(args.lora)


def export_lora(args: argparse.Namespace) -> int:
    from tripod.parallel.checkpoint import min_world_size
    from tripod.parallel.lora.checkpoint import export_lora_adapter

    run_distributed(min_world_size(args.tp, args.pp, args.ep, args.etp), export_lora_adapter, args.ckpt_dir,
                    args.hf_dir, args.tp, args.pp, args.ep, args.etp)
    say(f"tripod export --lora: {args.ckpt_dir} -> {args.hf_dir} (peft adapter directory, loaded at TP{args.tp} x "
        f"PP{args.pp}{experts_suffix(args)})")
    return 0


def add_export_command(subparsers) -> None:
    p = subparsers.add_parser("export", help="tripod checkpoint -> HF safetensors + config.json",
                              description="Export a tripod checkpoint (saved at any layout) as a Hugging "
                                          "Face model directory that AutoModelForCausalLM reads (a reward model or "
                                          "critic: AutoModelForSequenceClassification, one label).")
    p.add_argument("ckpt_dir", help="tripod checkpoint directory")
    p.add_argument("hf_dir", help="output HF model directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size used to load (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size used to load (default 1)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="cast the exported weights (default: as stored)")
    lora = p.add_mutually_exclusive_group()
    lora.add_argument("--merge", action="store_true",
                      help="a LoRA checkpoint: write the HF model with the adapters merged (W + alpha / rank * B @ A)")
    lora.add_argument("--lora", action="store_true",
                      help="a LoRA checkpoint: write a peft adapter directory (adapter_config.json + "
                           "adapter_model.safetensors) to HF_DIR instead")
    add_expert_args(p)
    p.set_defaults(func=cmd_export)
