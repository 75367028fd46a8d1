"""`tripod convert HF_DIR OUT_DIR --tp T --pp P [--ep E --etp X]`: HF checkpoint -> sharded megatron dist checkpoint.

Also the argument checks `tripod export` shares (parallel sizes against the architecture, the expert flags).
"""
from __future__ import annotations

import argparse

from tripod.engine.launch import is_rank_zero, run_distributed


def say(line: str) -> None:
    if is_rank_zero():  # once, also under torchrun / srun
        print(line)


def check_parallel_sizes(arch, tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
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
    check_parallel_sizes(arch, args.tp, args.pp, args.ep, args.etp)
    check_checkpoint_destination(args.out_dir)
    run_distributed(min_world_size(args.tp, args.pp, args.ep, args.etp), convert_hf_to_checkpoint, args.hf_dir,
                    args.out_dir, args.tp, args.pp, args.ep, args.etp)
    say(f"tripod convert: {args.hf_dir} -> {args.out_dir} ({arch.family}, TP{args.tp} x PP{args.pp}"
        f"{experts_suffix(args)})")
    return 0


def experts_suffix(args: argparse.Namespace) -> str:
    if args.ep == 1 and args.etp is None:
        return ""
    return f" x EP{args.ep}, expert TP{args.tp if args.etp is None else args.etp}"


def add_expert_args(p: argparse.ArgumentParser) -> None:
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
    add_expert_args(p)
    p.set_defaults(func=cmd_convert)
