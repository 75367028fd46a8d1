"""Shared test helpers for tripod: tiny random HF checkpoints (`make_tiny_hf_model`, defined in
tripod/engine/data/tiny_models.py, which scripts/ use too) and torchrun (gloo) launches.

Usable from pytest files (`from tests.helpers.common import make_tiny_hf_model, run_torchrun`; pytest.ini puts
the repository root on sys.path) and from torchrun worker scripts in tests/multiprocess/workers/ (run_torchrun puts
the repository root on PYTHONPATH), e.g. `from tests.helpers.common import dist_worker`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

from tripod.engine.data.tiny_models import make_tiny_hf_model  # noqa: F401  (the tests' name for it, one definition)

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = TESTS_DIR.parent
DIST_DIR = TESTS_DIR / "multiprocess" / "workers"


def launch_env(**extra: str) -> dict[str, str]:
    """Environment for a launcher subprocess: one thread per rank, the checkout importable, warnings quiet."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHON=sys.executable, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for rendezvous and MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(script: str | os.PathLike, nproc: int, *args: Any,
                     env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of `torchrun --standalone --nproc-per-node nproc script *args`: one thread per rank, no
    CUDA, the checkout importable. `script` is a path or a file name inside tests/multiprocess/workers/."""
    path = Path(script)
    if not path.is_absolute() and not path.exists():
        path = DIST_DIR / path
    if not path.exists():
        raise FileNotFoundError(f"run_torchrun script={script!r}: no such file (looked in {DIST_DIR})")
    run_env = dict(os.environ)
    run_env.update({
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), run_env.get("PYTHONPATH", "")]),
    })
    run_env.update(env or {})
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(path), *map(str, args)], run_env


def torchrun_failure(name: str, nproc: int, returncode: int, out: str) -> str:
    """The message of a failed torchrun world: the first rank's FAILED report (dist_worker) and the output's tail."""
    first_failure = out.find("] FAILED")
    detail = out[max(0, first_failure - 200):first_failure + 6000] if first_failure >= 0 else ""
    return f"torchrun {name} x{nproc} exited {returncode}:\n{detail}\n--- output tail ---\n{out[-3000:]}"


def launch_world(script: str | os.PathLike, nproc: int, *args: Any, log: str | os.PathLike,
                 env: dict[str, str] | None = None):
    """Start the world `torchrun --standalone --nproc-per-node nproc script *args` would start, its merged output
    going to the file `log`; returns its handle (`wait(timeout)`, `kill()`, `returncode`). The ranks are forks of one
    preloaded interpreter (tests/helpers/forked_worlds.py), or a real torchrun with TRIPOD_TEST_FORKED_WORLDS=0."""
    from tests.helpers import forked_worlds

    cmd, run_env = torchrun_command(script, nproc, *args, env=env)
    if forked_worlds.enabled():
        return forked_worlds.ForkedWorld(cmd[5], nproc, cmd[6:], run_env, str(REPO_ROOT), str(log))
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=run_env, stdout=out, stderr=subprocess.STDOUT, text=True)


def run_torchrun(script: str | os.PathLike, nproc: int, *args: Any, timeout: float = 300,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Launch `torchrun --standalone --nproc-per-node nproc script *args` (`launch_world`) and assert it succeeds.

    `script` is a path or a file name inside tests/multiprocess/workers/. Returns the completed process (stdout
    and stderr merged into `.stdout`) so callers can parse lines the workers printed. On failure
    or timeout the AssertionError carries the tail of the output.
    """
    import tempfile

    name = Path(script).name
    with tempfile.NamedTemporaryFile("r", suffix=".log", prefix=f"world-{name}-") as log:
        world = launch_world(script, nproc, *args, log=log.name, env=env)
        try:
            world.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            world.kill()
            world.wait()
            raise AssertionError(f"torchrun {name} x{nproc} timed out after {timeout}s:\n{log.read()[-6000:]}")
        out = log.read()
    if world.returncode != 0:
        raise AssertionError(torchrun_failure(name, nproc, world.returncode, out))
    return subprocess.CompletedProcess([name, str(nproc), *map(str, args)], world.returncode, out, None)


def dist_worker(main: Callable[[], None]) -> None:
    """Run a torchrun worker's `main()` on gloo with tripod's megatron patches applied (the CPU ones where CUDA is
    absent), as tripod's own ranks get them (engine/launch.py).

    Sets one thread per process, initialises the default process group, and on any exception
    prints the traceback with the rank and hard-exits (so torchrun tears the world down at once
    instead of the other ranks hanging in a collective).
    """
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    try:
        from datetime import timedelta
        dist.init_process_group(backend="gloo", timeout=timedelta(minutes=3))
        from tripod.parallel.megatron_patches import apply_megatron_patches
        apply_megatron_patches(None if torch.cuda.is_available() else "cpu")
        main()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        print(f"[rank{rank}] FAILED\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
