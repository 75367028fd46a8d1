"""Run a tiny PPO training in this process (world 1) and write which config leaves the engine read.

    python tests/multiprocess/workers/config_reads.py OUT.json key=value ...

The config is loaded and validated as `tripod train` does; then every config dataclass's attribute reads are
recorded while the CLI's world-size and preflight code, `PPOTrainer(cfg)` and `fit()` run. A read counts only when
the reading code is tripod's own (engine/, parallel/, runtime/, kernels/) and not the config's loading or validation
(engine/config*.py) or the pre-training checks (engine/preflight.py): a key only the
validator or preflight looks at is not honoured. Reads by omegaconf or dataclasses (saving the resolved config) do not
count either.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)
import tests.helpers.dapo_reward  # noqa: E402,F401  (registers the dynamic-sampling run's reward)
import tripod  # noqa: E402  (the package actually imported: src/tripod of this checkout under PYTHONPATH)

PACKAGE = os.path.dirname(os.path.abspath(tripod.__file__))
COUNTED = tuple(os.path.join(PACKAGE, d) + os.sep for d in ("engine", "parallel", "runtime", "kernels"))
# Loading, validating or pre-checking a key is not honouring it: preflight only checks that files exist, so a key
# read only there would still do nothing in training. launch.check_world does count: the world size it computes from
# trainer.nnodes x trainer.n_gpus_per_node is the number of ranks `tripod train` starts.
NOT_COUNTED = tuple(os.path.join(PACKAGE, "engine", f) for f in ("config_loading.py", "config_validation.py",
                                                                 "preflight.py"))
SCHEMA = os.path.join(PACKAGE, "engine", "config") + os.sep  # the schema's own checks and properties


def record_reads(cfg) -> set[str]:
    """Patch every config dataclass so that reads of its fields by tripod's code land in the returned set."""
    paths: dict[int, str] = {}
    classes: set[type] = set()

    def index(obj, prefix: str) -> None:
        paths[id(obj)] = prefix
        classes.add(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                index(value, f"{prefix}{f.name}.")

    index(cfg, "")
    reads: set[str] = set()
    field_names = {cls: {f.name for f in dataclasses.fields(cls)} for cls in classes}

    def getattribute(self, name):
        value = object.__getattribute__(self, name)
        names = field_names.get(type(self))
        if names and name in names:
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(COUNTED) and caller not in NOT_COUNTED and not caller.startswith(SCHEMA) \
                    and id(self) in paths:
                reads.add(paths[id(self)] + name)
        return value

    for cls in classes:
        cls.__getattribute__ = getattribute
    return reads


def main(out_path: str, overrides: list[str]) -> None:
    from tripod.engine.cli.train import rank_environment
    from tripod.engine.config import load_config
    from tripod.engine.config_validation import validate_config
    from tripod.engine.launch import check_world, detect_launch, run_distributed
    from tripod.engine.preflight import preflight
    from tripod.engine.trainer import PPOTrainer

    cfg = load_config(os.path.join(REPO, "recipes", "defaults.yaml"), overrides)
    validate_config(cfg, 1)
    reads = record_reads(cfg)
    world = check_world(cfg, detect_launch())
    assert world == 1  # (trainer.n_gpus_per_node * trainer.nnodes without a launcher)
    preflight(cfg, world)
    os.environ.update(rank_environment(cfg))  # as `tripod train` does before it starts the ranks
    with socket.socket() as s:  # then run in this process, as under torchrun
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    run_distributed(1, lambda: PPOTrainer(cfg).fit())
    with open(out_path, "w") as f:
        json.dump(sorted(reads), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
