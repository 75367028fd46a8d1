"""Shared test helpers for tripod: tiny random HF checkpoints and torchrun (gloo) launches.

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

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = TESTS_DIR.parent
DIST_DIR = TESTS_DIR / "multiprocess" / "workers"

# Tiny shapes: heads=4 / kv=2 / layers=4 so that TP in {1, 2} and PP in {1, 2, 4} all divide.
_TINY_COMMON: dict[str, Any] = dict(
    vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


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


def make_tiny_hf_model(tmp_path: str | os.PathLike, family: str, *, seed: int = 0,
                       subdir: str | None = None, sequence_classification: bool = False, **overrides: Any) -> str:
    """Save a tiny random fp32 Llama, Qwen2 or Qwen3 checkpoint with `save_pretrained`; return its directory.

    `family` is "llama", "qwen2" (always has QKV bias) or "qwen3" (per-head q/k norm; pass `head_dim`, whose
    Qwen3Config default is 128). `overrides` go into the HF config,
    e.g. `tie_word_embeddings=True`, `num_hidden_layers=2`,
    `rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}`.
    Weights are drawn from N(0, 0.02) but biases and norm weights are randomised too, so no
    parameter is at a trivial value. The same (family, seed, overrides) gives the same weights.
    `sequence_classification=True` saves a `*ForSequenceClassification` model with one label (a reward model:
    a `score` head [1, hidden] instead of `lm_head`).
    """
    import torch
    import transformers

    configs = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    models = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
              "qwen3": transformers.Qwen3ForCausalLM}
    if family not in configs:
        raise ValueError(f"make_tiny_hf_model family={family!r}; use one of {sorted(configs)}")
    kwargs = dict(_TINY_COMMON)
    if sequence_classification:
        kwargs["num_labels"] = 1
        models = {k: getattr(transformers, v.__name__.replace("ForCausalLM", "ForSequenceClassification"))
                  for k, v in models.items()}
    kwargs.update(overrides)
    config = configs[family](**kwargs)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = models[family](config).to(torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.05 * torch.randn_like(p))
    out = Path(tmp_path) / (subdir or f"{family}_seed{seed}")
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


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
