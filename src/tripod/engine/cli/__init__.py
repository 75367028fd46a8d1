"""The `tripod` console script: `main` and the list of argparse subcommands, one module each.

    tripod convert HF_DIR OUT_DIR --tp T --pp P [--ep E --etp X]   HF checkpoint -> megatron dist checkpoint (convert.py)
    tripod export CKPT_DIR HF_DIR [--tp --pp --ep --etp] [--merge | --lora]   checkpoint -> safetensors + config.json,
                                                  or a LoRA checkpoint's peft adapter dir (export.py)
    tripod train RECIPE [key=value ...]           PPO training (train.py)
    tripod train-rm RECIPE [key=value ...]        reward-model training on preference pairs (train_rm.py)
    tripod train-sft RECIPE [key=value ...]       supervised fine-tuning on chat rows (train_sft.py)
    tripod plan RECIPE|MODEL [key=value ...] [--per-rank] [--gpu-memory-gb G]   resharding + memory plan (plan.py)
    tripod bench RECIPE [key=value ...] --steps N --out DIR [--baseline trl hf]   throughput vs peers (bench.py)
    tripod report RUN_DIR [--out PNG]             dashboard PNG + health verdict from metrics.jsonl (report.py)
    tripod tool TOOL_CONFIG NAME --args JSON      one tool call as the agent loop runs it, one JSON line (tool.py)

A command that needs a torch.distributed world runs in-process when launched by torchrun or a multi-task
srun, and otherwise spawns its own local gloo world (engine/launch.py). Bad input is reported as one line
on stderr (exit code 2) before any process is spawned; TRIPOD_DEBUG=1 shows tracebacks.

Adding a subcommand: write a module here with `def add_<name>_command(subparsers)` that adds its parser and sets
`func=<callable(args) -> int>`, then append it to `SUBCOMMANDS`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Sequence

from tripod.engine.cli.bench import add_bench_command
from tripod.engine.cli.convert import add_convert_command
from tripod.engine.cli.export import add_export_command
from tripod.engine.cli.plan import add_plan_command
from tripod.engine.cli.report import add_report_command
from tripod.engine.cli.tool import add_tool_command
from tripod.engine.cli.train import add_train_command
from tripod.engine.cli.train_rm import add_train_rm_command
from tripod.engine.cli.train_sft import add_train_sft_command
from tripod.engine.launch import (
    USER_ERRORS,
    CommandFailed,
    default_huge_page_allocations,
    detect_launch,
    error_line,
    is_rank_zero,
)
from tripod.parallel.megatron_patches import apply_megatron_patches

NONZERO_RANK_EXIT_GRACE_S = 30.0

SUBCOMMANDS: list[Callable[[Any], None]] = [add_convert_command, add_export_command, add_train_command,
                                             add_train_rm_command, add_train_sft_command, add_plan_command,
                                             add_bench_command, add_report_command, add_tool_command]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tripod", description="tripod: 3D-parallel PPO/RLHF on megatron-core")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    apply_megatron_patches()  # before any command imports megatron (parallel/megatron_patches)
    args = build_parser().parse_args(argv)
    default_huge_page_allocations()  # for the ranks and peers this command spawns (engine/launch.py)
    try:
        return args.func(args)
    except (CommandFailed, *USER_ERRORS) as e:
        if os.environ.get("TRIPOD_DEBUG"):
            raise
        if is_rank_zero():  # every rank of a launched world reaches the same verdict; one line is enough
            print(f"tripod {args.command}: error: {error_line(e)}", file=sys.stderr, flush=True)
        else:
            # The launcher (srun --kill-on-bad-exit, torchrun) kills the world on the first failed exit; a silent
            # rank that exits first would take rank 0 down before its line is out. Rank 0 exits at once, which
            # ends the world; the wait is only an upper bound. A rank still alive after it says its own line, so an
            # error only this rank met is not lost.
            time.sleep(NONZERO_RANK_EXIT_GRACE_S)
            print(f"tripod {args.command}: error (rank {detect_launch().rank}): {error_line(e)}", file=sys.stderr,
                  flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
