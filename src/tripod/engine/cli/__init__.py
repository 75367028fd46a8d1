"""The `tripod` console script: argparse subcommands (`convert`, `export`, `train`, `plan`).

    tripod convert HF_DIR OUT_DIR --tp T --pp P [--ep E --etp X]   HF checkpoint -> sharded megatron dist checkpoint
    tripod export CKPT_DIR HF_DIR [--tp --pp --ep --etp]          tripod checkpoint -> safetensors + config.json
    tripod train RECIPE [key=value ...]           PPO training (engine/cli/train.py)
    tripod plan RECIPE [key=value ...]            the hybrid engine's resharding plan

A command that needs a torch.distributed world runs in-process when launched by torchrun or a multi-task
srun, and otherwise spawns its own local gloo world (engine/launch.py). Bad input is reported as one line
on stderr (exit code 2) before any process is spawned; TRIPOD_DEBUG=1 shows tracebacks.

Adding a subcommand (like `train` and `plan` in engine/cli/train.py): write `def add_<name>_command(subparsers)`
that adds its parser and sets `func=<callable(args) -> int>`, then append it to `SUBCOMMANDS`.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Sequence

from tripod.engine.cli.train import add_plan_command, add_train_command
from tripod.engine.launch import USER_ERRORS, CommandFailed, error_line, is_rank_zero, run_distributed

# ----------------------------------------------------------------------------- convert / export

def _say(line: str) -> None:
    if is_rank_zero():  # once, also under torchrun / srun
        print(line)


def _check_parallel_sizes(arch, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    from tripod.parallel.convert.common import check_tp_size

    if ep != 1 or etp is not None:
        if arch.moe is None:
            raise ValueError(f"--ep {ep} / --etp {etp}: {arch.family} is a dense model (no experts); drop them")
        experts, ffn = arch.moe.num_experts, arch.moe.expert_ffn_hidden_size
        if ep < 1 or experts % ep:
            raise ValueError(f"--ep {ep} does not divide the {experts} experts; use one of "
                             f"{[d for d in range(1, experts + 1) if experts % d == 0]}")
        if etp is not None and (etp < 1 or ffn % etp):
            raise ValueError(f"--etp {etp} does not divide moe_intermediate_size={ffn}; use one of "
                             f"{[d for d in range(1, ffn + 1) if ffn % d == 0]}")
    if pp < 1 or arch.num_layers % pp:
        divisors = [d for d in range(1, arch.num_layers + 1) if arch.num_layers % d == 0]
        raise ValueError(f"--pp {pp} does not divide num_hidden_layers={arch.num_layers}; use one of {divisors}")
    try:
        check_tp_size(arch, tp)
    except ValueError as e:
        raise ValueError(f"--tp {tp}: {e}") from None


def cmd_convert(args: argparse.Namespace) -> int:
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.checkpoint import check_checkpoint_destination, convert_hf_to_checkpoint, min_world_size
    from tripod.parallel.convert import SafetensorsReader, check_hf_names, family_of

    arch = arch_from_hf(args.hf_dir)
    names = family_of(arch)
    check_hf_names(arch, names, SafetensorsReader(args.hf_dir).names(), source=args.hf_dir)
    _check_parallel_sizes(arch, args.tp, args.pp, args.ep, args.etp)
    check_checkpoint_destination(args.out_dir)
    run_distributed(min_world_size(args.tp, args.pp, args.ep, args.etp), convert_hf_to_checkpoint, args.hf_dir,
                    args.out_dir, args.tp, args.pp, args.ep, args.etp)
    _say(f"tripod convert: {args.hf_dir} -> {args.out_dir} ({arch.family}, TP{args.tp} x PP{args.pp}"
         f"{_experts(args)})")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from tripod.parallel.checkpoint import check_exportable, checkpoint_arch, export_checkpoint_to_hf, min_world_size

    arch = checkpoint_arch(args.ckpt_dir)
    check_exportable(args.ckpt_dir)
    _check_parallel_sizes(arch, args.tp, args.pp, args.ep, args.etp)
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    run_distributed(min_world_size(args.tp, args.pp, args.ep, args.etp), export_checkpoint_to_hf, args.ckpt_dir,
                    args.hf_dir, args.tp, args.pp, dtype, args.ep, args.etp)
    _say(f"tripod export: {args.ckpt_dir} -> {args.hf_dir} ({arch.family}, loaded at TP{args.tp} x PP{args.pp}"
         f"{_experts(args)})")
    return 0


def _experts(args: argparse.Namespace) -> str:
    if args.ep == 1 and args.etp is None:
        return ""
    return f" x EP{args.ep}, expert TP{args.tp if args.etp is None else args.etp}"


def _add_expert_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models; default 1)")
    p.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (MoE; default: --tp)")


def add_convert_command(subparsers) -> None:
    p = subparsers.add_parser("convert", help="HF checkpoint -> sharded megatron dist checkpoint",
                              description="Convert a Hugging Face model directory (Llama, Qwen2, Qwen3-MoE, "
                                          "Qwen2-MoE, DeepSeek-V3/V2) into a tripod (megatron "
                                          "dist-checkpointing) checkpoint sharded TP x PP (x EP for experts).")
    p.add_argument("hf_dir", help="HF model directory (config.json + safetensors)")
    p.add_argument("out_dir", help="output checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    _add_expert_args(p)
    p.set_defaults(func=cmd_convert)


def add_export_command(subparsers) -> None:
    p = subparsers.add_parser("export", help="tripod checkpoint -> HF safetensors + config.json",
                              description="Export a tripod checkpoint (saved at any layout) as a Hugging "
                                          "Face model directory that AutoModelForCausalLM reads.")
    p.add_argument("ckpt_dir", help="tripod checkpoint directory")
    p.add_argument("hf_dir", help="output HF model directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size used to load (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size used to load (default 1)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="cast the exported weights (default: as stored)")
    _add_expert_args(p)
    p.set_defaults(func=cmd_export)


def add_bench_commands(subparsers) -> None:
    from tripod.engine.cli.bench import add_bench_command

    add_bench_command(subparsers)


SUBCOMMANDS: list[Callable[[Any], None]] = [add_convert_command, add_export_command, add_train_command,
                                             add_plan_command, add_bench_commands]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tripod", description="tripod: 3D-parallel PPO/RLHF on megatron-core")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CommandFailed, *USER_ERRORS) as e:
        if os.environ.get("TRIPOD_DEBUG"):
            raise
        if is_rank_zero():  # every rank of a launched world reaches the same verdict; one line is enough
            print(f"tripod {args.command}: error: {error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
