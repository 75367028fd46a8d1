"""The `tripod` console script: argparse subcommands (`convert`, `export`; more register the same way).

    tripod convert HF_DIR OUT_DIR --tp T --pp P   HF checkpoint -> sharded megatron dist checkpoint
    tripod export CKPT_DIR HF_DIR [--tp --pp]     tripod checkpoint -> safetensors + config.json

A command that needs a torch.distributed world runs in-process when launched by torchrun, and
otherwise spawns its own local gloo world (`run_distributed`). Bad input is reported as one line
on stderr (exit code 2) before any process is spawned; TRIPOD_DEBUG=1 shows tracebacks.

Adding a subcommand (e.g. `plan`, `train`): write `def add_<name>_command(subparsers)` that adds its
parser and sets `func=<callable(args) -> int>`, then append it to `SUBCOMMANDS`.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable, Sequence

# Errors a user can fix from the message alone: printed as one line, no traceback.
USER_ERRORS = (ValueError, FileNotFoundError, KeyError, NotADirectoryError)


class CommandFailed(Exception):
    """A spawned worker failed; the message is the worker's one-line error."""


def _error_line(exc: BaseException) -> str:
    msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return " ".join(str(msg).split())


# ----------------------------------------------------------------------------- distributed runs

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_worker(local_rank: int, world_size: int, port: int, error_dir: str,
                    fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size))
    try:
        _run_in_world(fn, args)
    except BaseException as e:  # first line: the message the parent prints; then the traceback
        summary = _error_line(e) if isinstance(e, USER_ERRORS) else f"{type(e).__name__}: {_error_line(e)}"
        with open(os.path.join(error_dir, f"rank{local_rank}.err"), "w") as f:
            f.write(f"rank {local_rank}: {summary}\n{traceback.format_exc()}")
        sys.exit(1)


def _run_in_world(fn: Callable[..., Any], args: tuple) -> None:
    import torch
    import torch.distributed as dist

    if not os.environ.get("TRIPOD_DEBUG"):
        import warnings
        warnings.filterwarnings("ignore")  # megatron's TE/apex fallbacks, torch DCP deprecations
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ["WORLD_SIZE"]))))
    own_group = not dist.is_initialized()
    if own_group:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    from parallel.cpu_compat import apply_cpu_compat

    apply_cpu_compat()
    try:
        fn(*args)
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(world_size: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run `fn(*args)` on every rank of a `world_size` world: in-process under torchrun (the
    launched world must have that size), else in `world_size` spawned local processes."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        launched = int(os.environ["WORLD_SIZE"])
        if launched != world_size:
            raise ValueError(f"launched with {launched} processes but this command needs {world_size} "
                             "(tp*pp); launch it with that many or without torchrun")
        _run_in_world(fn, args)
        return
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="tripod-errors-") as error_dir:
        try:
            mp.start_processes(_spawned_worker, args=(world_size, _free_port(), error_dir, fn, args),
                               nprocs=world_size, start_method="spawn", join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            reports = sorted(os.listdir(error_dir))
            if not reports:
                raise CommandFailed(f"worker {e.error_index} died (exit {getattr(e, 'exit_code', '?')}) "
                                    "without a message") from None
            with open(os.path.join(error_dir, reports[0])) as f:
                summary, _, trace = f.read().partition("\n")
            if os.environ.get("TRIPOD_DEBUG"):
                print(trace, file=sys.stderr)
            raise CommandFailed(summary) from None


# ----------------------------------------------------------------------------- convert / export

def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # once, also under torchrun
        print(line)


def _check_parallel_sizes(arch, tp: int, pp: int) -> None:
    from parallel.convert.common import check_tp_size

    if pp < 1 or arch.num_layers % pp:
        divisors = [d for d in range(1, arch.num_layers + 1) if arch.num_layers % d == 0]
        raise ValueError(f"--pp {pp} does not divide num_hidden_layers={arch.num_layers}; use one of {divisors}")
    try:
        check_tp_size(arch, tp)
    except ValueError as e:
        raise ValueError(f"--tp {tp}: {e}") from None


def cmd_convert(args: argparse.Namespace) -> int:
    from parallel.arch import arch_from_hf
    from parallel.checkpoint import check_checkpoint_destination, convert_hf_to_checkpoint
    from parallel.convert import SafetensorsReader, check_hf_names, family_names

    arch = arch_from_hf(args.hf_dir)
    names = family_names(arch)
    _check_parallel_sizes(arch, args.tp, args.pp)
    check_hf_names(arch, names, SafetensorsReader(args.hf_dir).names(), source=args.hf_dir)
    check_checkpoint_destination(args.out_dir)
    run_distributed(args.tp * args.pp, convert_hf_to_checkpoint, args.hf_dir, args.out_dir, args.tp, args.pp)
    _say(f"tripod convert: {args.hf_dir} -> {args.out_dir} ({arch.family}, TP{args.tp} x PP{args.pp})")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from parallel.checkpoint import checkpoint_arch, check_exportable, export_checkpoint_to_hf

    arch = checkpoint_arch(args.ckpt_dir)
    check_exportable(args.ckpt_dir)
    _check_parallel_sizes(arch, args.tp, args.pp)
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    run_distributed(args.tp * args.pp, export_checkpoint_to_hf, args.ckpt_dir, args.hf_dir, args.tp, args.pp, dtype)
    _say(f"tripod export: {args.ckpt_dir} -> {args.hf_dir} ({arch.family}, loaded at TP{args.tp} x PP{args.pp})")
    return 0


def add_convert_command(subparsers) -> None:
    p = subparsers.add_parser("convert", help="HF checkpoint -> sharded megatron dist checkpoint",
                              description="Convert a Hugging Face Llama/Qwen2 directory into a tripod "
                                          "(megatron dist-checkpointing) checkpoint sharded TP x PP.")
    p.add_argument("hf_dir", help="HF model directory (config.json + safetensors)")
    p.add_argument("out_dir", help="output checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
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
    p.set_defaults(func=cmd_export)


def add_train_commands(subparsers) -> None:
    from engine.cli_train import add_plan_command, add_train_command  # engine/cli_train.py imports this module

    add_train_command(subparsers)
    add_plan_command(subparsers)


def add_bench_commands(subparsers) -> None:
    from engine.bench.command import add_bench_command

    add_bench_command(subparsers)


SUBCOMMANDS: list[Callable[[Any], None]] = [add_convert_command, add_export_command, add_train_commands,
                                            add_bench_commands]


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
        print(f"tripod {args.command}: error: {_error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
