"""How this process was launched and how a command gets its torch.distributed world.

Three launches are recognised, in this order:

    torchrun   RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE are set: run in-process
    srun       a SLURM job step with more than one task (SLURM_STEP_ID, SLURM_PROCID, SLURM_NTASKS > 1): run
               in-process; rank from SLURM_PROCID, local rank from SLURM_LOCALID, world from SLURM_NTASKS,
               master address = first host of the step's node list, port = MASTER_PORT or one derived from
               the job id
    local      anything else (also a one-task srun, e.g. an interactive allocation): spawn the world's
               processes on this machine

trainer.launcher chooses instead of detecting (`check_launcher` holds the choice against the launch); `ray` starts
one Ray actor per rank on a running Ray cluster (`run_training` -> engine/launch_ray.py).

`check_world` holds the recipe (trainer.nnodes x trainer.n_gpus_per_node) against the launch and names the keys
to change in one line. `run_distributed` runs a function on every rank of the world, spawning only in the
local case.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Mapping, MutableMapping


class TrainingStopped(RuntimeError):
    """A run that stopped itself for a reason its message states (e.g. the divergence guard gave up)."""


# Errors a user can act on from the message alone: printed as one line, no traceback.
USER_ERRORS = (ValueError, FileNotFoundError, KeyError, NotADirectoryError, PermissionError, TimeoutError,
               TrainingStopped)


class CommandFailed(Exception):
    """A spawned worker failed; the message is the worker's one-line error."""


def error_line(exc: BaseException) -> str:
    msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    return " ".join(str(msg).split())


@dataclass(frozen=True)
class Launch:
    kind: str  # "torchrun" | "srun" | "local"
    world_size: int  # 0 for "local": the recipe decides
    rank: int = 0
    local_rank: int = 0
    nproc_per_node: int = 0
    nnodes: int = 0

    def describe(self) -> str:
        if self.kind == "torchrun":
            return f"torchrun --nnodes={self.nnodes} --nproc-per-node={self.nproc_per_node}"
        return f"srun with {self.world_size} tasks on {self.nnodes} node(s)"


def _first_int(text: str) -> int:
    m = re.match(r"\s*(\d+)", text or "")
    return int(m.group(1)) if m else 0


def detect_launch(env: Mapping[str, str] = os.environ) -> Launch:
    """The launch this process runs under (see the module docstring)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        per_node = int(env.get("LOCAL_WORLD_SIZE", world))
        return Launch("torchrun", world, int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), per_node,
                      int(env.get("GROUP_WORLD_SIZE", max(1, world // max(1, per_node)))))
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")) or 1)
    if step is not None and "SLURM_PROCID" in env and tasks > 1:
        nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")) or 1)
        # SLURM_STEP_TASKS_PER_NODE looks like "2(x3)" or "2,1": the first node's count
        per_node = _first_int(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))) \
            or tasks // nodes
        return Launch("srun", tasks, int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), per_node, nodes)
    return Launch("local", 0)


def check_world(cfg, launch: Launch) -> int:
    """The world size (the trainer's ranks plus the rollout's own, `rollout.nnodes` x `rollout.n_gpus_per_node`, when
    it has them: they come after the trainer's), after checking that the recipe and the launch agree; one line naming
    the keys if not."""
    t, r = cfg.trainer, getattr(cfg, "rollout", None)  # `tripod train-rm` has no rollout
    want = t.nnodes * t.n_gpus_per_node
    if want < 1:
        raise ValueError(f"trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node} must be >= 1")
    own = r.nnodes * r.n_gpus_per_node if r is not None else 0
    total = want + own
    check_launcher(getattr(t, "launcher", "auto"), launch)
    if launch.kind == "local":
        return total
    if own:
        if launch.world_size != total:
            raise ValueError(
                f"launched as {launch.describe()} ({launch.world_size} processes) but the recipe says trainer "
                f"{t.nnodes}x{t.n_gpus_per_node} + rollout {r.nnodes}x{r.n_gpus_per_node} = {total} ranks; launch "
                f"{total} processes (the trainer's first) or change trainer.* / rollout.nnodes, n_gpus_per_node")
        return total
    if (launch.nnodes, launch.nproc_per_node) != (t.nnodes, t.n_gpus_per_node) or launch.world_size != want:
        raise ValueError(
            f"launched as {launch.describe()} ({launch.world_size} processes) but the recipe says trainer.nnodes="
            f"{t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node} = {want}; pass trainer.nnodes="
            f"{launch.nnodes} trainer.n_gpus_per_node={launch.nproc_per_node} (recipes/launch_*.sh do) or launch "
            f"{t.nnodes} node(s) x {t.n_gpus_per_node} processes")
    return want


def check_launcher(launcher: str, launch: Launch, env: Mapping[str, str] = os.environ) -> None:
    """trainer.launcher against the launch this process runs under (auto accepts any); one line naming the fix."""
    under_slurm = launch.kind == "srun" or (launch.kind == "torchrun" and "SLURM_JOB_ID" in env)
    if launcher == "ray" and launch.kind != "local":
        raise ValueError(f"trainer.launcher=ray but this process was started by {launch.describe()}: run `tripod train` "
                         "once (e.g. `ray job submit -- tripod train ...`), and Ray starts the ranks; or drop "
                         "trainer.launcher=ray under torchrun/srun")
    if launcher == "local" and launch.kind != "local":
        raise ValueError(f"trainer.launcher=local but this process was started by {launch.describe()}; use "
                         "trainer.launcher=auto there")
    if launcher == "torchrun" and launch.kind != "torchrun":
        raise ValueError("trainer.launcher=torchrun but RANK/WORLD_SIZE are not set: start it with "
                         "recipes/launch_torchrun.sh, or set trainer.launcher=auto")
    if launcher == "slurm" and not under_slurm:
        raise ValueError("trainer.launcher=slurm but this is not a multi-task SLURM step: start it with `sbatch "
                         "recipes/launch_slurm.sh` or `srun --ntasks=N`, or set trainer.launcher=auto")


# ----------------------------------------------------------------------------- SLURM rendezvous

def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list ("gpu[03-05,9],cpu1" -> "gpu03"): `scontrol show hostnames` when it is
    installed, else parsed here."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                 timeout=30, check=True).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    return parse_first_host(nodelist)


def parse_first_host(nodelist: str) -> str:
    """First host of a SLURM node list without scontrol (zero padding kept: "n[007-9]" -> "n007")."""
    first = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not first:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}; set MASTER_ADDR")
    prefix, ranges = first.group(1), first.group(3)
    return prefix if ranges is None else prefix + re.split(r"[-,]", ranges)[0]


def srun_env(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """torch.distributed's env:// variables for this srun task."""
    launch = detect_launch(env)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    addr = env.get("MASTER_ADDR") or (first_slurm_host(nodelist) if nodelist else "127.0.0.1")
    port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0") or 0) % 20000)
    return dict(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank),
                LOCAL_WORLD_SIZE=str(launch.nproc_per_node), GROUP_WORLD_SIZE=str(launch.nnodes),
                MASTER_ADDR=addr, MASTER_PORT=port)


# ----------------------------------------------------------------------------- running a world

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_worker(local_rank: int, world_size: int, port: int, error_dir: str,
                    fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    try:
        _run_in_world(fn, args)
    except BaseException as e:  # first line: the message the parent prints; then the traceback
        summary = error_line(e) if isinstance(e, USER_ERRORS) else f"{type(e).__name__}: {error_line(e)}"
        with open(os.path.join(error_dir, f"rank{local_rank}.err"), "w") as f:
            f.write(f"rank {local_rank}: {summary}\n{traceback.format_exc()}")
        sys.exit(1)


def cores_available() -> int:
    """The CPU cores this process may run on: its affinity mask (taskset, a SLURM or container cgroup), which
    `os.cpu_count()` ignores."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_rank(ranks_per_node: int, requested: int = 0, env: Mapping[str, str] = os.environ) -> tuple[int, str]:
    """(torch intra-op threads for each rank of a node, where the number came from).

    In order: `requested` (trainer.threads_per_rank) when > 0; OMP_NUM_THREADS when set (it fixes the CPU reduction
    order, e.g. for comparing layouts); SLURM_CPUS_PER_TASK in a SLURM step (the task's own share already); else this
    process's cores divided by the ranks that share the node, so that ranks never oversubscribe the cores."""
    if requested > 0:
        return requested, "trainer.threads_per_rank"
    explicit = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit), "OMP_NUM_THREADS"
    slurm = env.get("SLURM_CPUS_PER_TASK", "").strip()
    if slurm.isdigit() and int(slurm) > 0 and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        return int(slurm), "SLURM_CPUS_PER_TASK"
    cores, ranks = cores_available(), max(1, ranks_per_node)
    return max(1, cores // ranks), f"{cores} cores / {ranks} ranks on this node"


HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def default_huge_page_allocations(env: MutableMapping[str, str] = os.environ) -> bool:
    """Turn on torch's huge-page CPU allocations for the processes this one starts, unless the user chose; return
    whether they are on.

    With THP_MEM_ALLOC_ENABLE=1 torch's CPU allocator aligns every allocation of 2 MB or more to 2 MB and marks it
    MADV_HUGEPAGE, so that the kernel backs it with 2 MB pages (transparent huge pages in "madvise" or "always"
    mode). Without it a fresh large tensor (activations, gradients, a matmul's output) takes one page fault per 4 KB
    page on first touch, on every step, which makes zeroing or first writing it several times slower and shows in
    the update's time (bench/RESULTS.md).
    torch reads the variable once, at a process's first allocation, so it has to be in the environment when the
    process starts: `tripod` sets it before spawning its ranks and the bench's peers; recipes/launch_torchrun.sh and
    recipes/launch_slurm.sh export it. THP_MEM_ALLOC_ENABLE=0 turns it off."""
    env.setdefault(HUGE_PAGES_ENV, "1")
    return huge_pages_on(env)


def huge_pages_on(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the processes started from `env` allocate on huge pages (default_huge_page_allocations)."""
    return env.get(HUGE_PAGES_ENV, "0").strip() not in ("", "0")


def _run_in_world(fn: Callable[..., Any], args: tuple) -> None:
    import torch
    import torch.distributed as dist

    from tripod.parallel.megatron_patches import apply_megatron_patches

    apply_megatron_patches()  # a spawned rank is a fresh interpreter: before `fn` imports megatron
    if not os.environ.get("TRIPOD_DEBUG"):
        import warnings
        warnings.filterwarnings("ignore")  # megatron's TE/apex fallbacks, torch DCP deprecations
    torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))[0])
    from tripod.runtime.device import process_group_backend, select_device

    device = select_device()  # $TRIPOD_DEVICE (trainer.device) and LOCAL_RANK; sets the CUDA device first
    own_group = not dist.is_initialized()
    if own_group:
        backend = process_group_backend(device)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is None:
            dist.init_process_group(backend=backend)
        else:  # torchrun keeps its store across --max-restarts: without a per-attempt prefix a restarted group
            # reads the dead ranks' addresses and gloo's connectFullMesh is refused
            store, rank, world = next(dist.rendezvous("env://"))
            dist.init_process_group(backend=backend, store=dist.PrefixStore(f"tripod/attempt_{attempt}", store),
                                    rank=rank, world_size=world)
    apply_megatron_patches(device)  # on a CPU rank, the CPU shims too
    try:
        fn(*args)
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(world_size: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run `fn(*args)` on every rank of a `world_size` world: in-process under torchrun or a multi-task srun (the
    launched world must have that size), else in `world_size` spawned local processes."""
    launch = detect_launch()
    if launch.kind != "local":
        if launch.world_size != world_size:
            raise ValueError(f"launched as {launch.describe()} ({launch.world_size} processes) but this command "
                             f"needs {world_size}; launch it with that many processes")
        if launch.kind == "srun":
            os.environ.update(srun_env())
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


def run_training(cfg, world_size: int, fn: Callable[..., Any], *args: Any) -> None:
    """`run_distributed`, or one Ray actor per rank on a running Ray cluster when trainer.launcher=ray
    (engine/launch_ray.py)."""
    if getattr(cfg.trainer, "launcher", "auto") == "ray":
        from tripod.engine.launch_ray import run_on_ray

        run_on_ray(cfg, world_size, fn, args)
        return
    run_distributed(world_size, fn, *args)


def is_rank_zero() -> bool:
    launch = detect_launch()
    return launch.rank == 0
