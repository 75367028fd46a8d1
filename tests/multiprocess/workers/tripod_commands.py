"""torchrun worker: several `tripod` CLI commands, in-process, one after the other in this one world.

argv: a JSON list of commands, each an argument list or {"argv": [...], "plant": BUG}, e.g.
'[["export", "CKPT", "OUT"], {"argv": ["train", "RECIPE", "k=v"], "plant": "pp_stage_grads"}]'. Under torchrun a
command runs in-process (engine/launch.py) on the world this worker started (each command must need exactly its
size), so N commands cost one interpreter start and one torch/megatron import per rank instead of N CLI
subprocesses that each spawn their own ranks. A command with a `plant` runs with that bug of
tests/multiprocess/workers/train_with_hooks.py planted, and only it (the bug is taken out after it). Prints
`TRIPOD_COMMAND_OK <i>` after command i succeeded; a command that fails stops the world with its error.
"""
import json
import sys

import tests.helpers.dapo_reward  # noqa: F401  (registers the test data source dynamic-sampling runs score with)
from tests.helpers.common import dist_worker


def main() -> None:
    from tests.multiprocess.workers.train_with_hooks import plant, unplant
    from tripod.engine.cli import main as tripod_main

    commands = [c if isinstance(c, dict) else {"argv": c} for c in json.loads(sys.argv[1])]
    assert commands and all(isinstance(c.get("argv"), list) for c in commands), \
        f"expected a list of argv lists or {{'argv': [...], 'plant': bug}}: {commands}"
    for i, command in enumerate(commands):
        argv = [str(a) for a in command["argv"]]
        if command.get("plant"):
            plant(command["plant"])
        try:
            assert tripod_main(argv) == 0, f"tripod {' '.join(argv)} failed"
        finally:
            unplant()
        print(f"TRIPOD_COMMAND_OK {i}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
