"""torchrun worker: several `tripod` CLI commands, in-process, one after the other in this one world.

argv: a JSON list of argument lists, e.g. '[["export", "CKPT", "OUT"], ["export", "CKPT2", "OUT2"]]'. Under
torchrun a command runs in-process (engine/launch.py) on the world this worker started (each command must need
exactly its size), so N commands cost one interpreter start and one torch/megatron import per rank instead of N CLI
subprocesses that each spawn their own ranks. Prints `TRIPOD_COMMAND_OK <i>` after command i succeeded; a command
that fails stops the world with its error.
"""
import json
import sys

from tests.helpers.common import dist_worker


def main() -> None:
    from tripod.engine.cli import main as tripod_main

    commands = json.loads(sys.argv[1])
    assert commands and all(isinstance(c, list) for c in commands), f"expected a list of argv lists: {commands}"
    for i, argv in enumerate(commands):
        assert tripod_main([str(a) for a in argv]) == 0, f"tripod {' '.join(map(str, argv))} failed"
        print(f"TRIPOD_COMMAND_OK {i}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
