"""`tripod train ... trainer.launcher=ray`: the world as Ray actors on a running Ray cluster.

The process that runs `tripod train` (on a node of the cluster, or as the entrypoint of `ray job submit`) is the
driver: it connects to the cluster (ray_kwargs.ray_init.address, else $RAY_ADDRESS, else the cluster `ray start`
left on this machine; token authentication is whatever ray.init finds in the environment; tripod never starts a
cluster), reserves one placement group of trainer.nnodes bundles of trainer.n_gpus_per_node GPUs (CPUs when
trainer.device=cpu), then rollout.nnodes bundles of rollout.n_gpus_per_node when the rollout has ranks of its own,
with STRICT_SPREAD: one bundle per node, a node's ranks packed in its bundle. One actor per rank runs the worker
entry point every launcher runs (engine/launch.py `_run_in_world`) with the environment torchrun would give it
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE, MASTER_ADDR/PORT on rank 0's node; on GPUs
CUDA_VISIBLE_DEVICES = the node's granted GPUs in local-rank order, so cuda:LOCAL_RANK is the rank's own GPU, as
under torchrun). The trainer's ranks come first, then the rollout's, as `check_world` counts them.

Output: each rank's stdout and stderr go to <run dir>/logs/rank<r>.log (appended; also streamed to the driver by
Ray), and <run dir>/placement.json records rank -> host, IP, Ray node id, GPU ids, pid.

Faults: when a rank's actor or node dies, or a rank raises, the driver kills every other rank (ray.kill: no rank
waits on a collective with a dead peer), frees the placement group and stops with one line naming the rank and
node; trainer.resume=auto continues from the newest complete checkpoint on resubmission. trainer.max_restarts=N
does that resubmission itself, up to N times. A surviving rank usually sees its peer vanish (a gloo/NCCL
connection error) before Ray has declared the node dead (GCS health checks: about 15 s by default), so a failure
that reads as a lost peer waits up to PEER_LOSS_WAIT_S for the death report that names the real culprit.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Mapping

from tripod.engine.launch import USER_ERRORS, CommandFailed, _run_in_world, error_line

# the driver's variables the ranks get too (torch reads THP_MEM_ALLOC_ENABLE at its first allocation: they are the
# Ray worker's environment from its start, not set later)
FORWARDED_ENV_PREFIXES = ("TRIPOD_", "NCCL_", "GLOO_", "OMP_", "MKL_", "THP_", "TORCH_", "PYTORCH_", "TOKENIZERS_",
                          "HF_", "TRANSFORMERS_", "WANDB_", "MLFLOW_", "SGLANG_", "VLLM_", "PYTHONWARNINGS",
                          "PYTHONHASHSEED", "CUDA_DEVICE_MAX_CONNECTIONS")
LOST_PEER = re.compile(r"connection (closed|reset|refused)|broken pipe|ECONNRESET|socket|peer|timed? ?out", re.I)
PEER_LOSS_WAIT_S = 45.0
CONNECT_PROBE_S = 5.0


def cluster_address(cfg, env: Mapping[str, str] = os.environ) -> str:
    """ray_kwargs.ray_init.address, else $RAY_ADDRESS, else "auto" (the cluster `ray start` left on this machine)."""
    return cfg.ray_kwargs.ray_init.address or env.get("RAY_ADDRESS") or "auto"


def bundle_sizes(cfg) -> list[int]:
    """Ranks per placement-group bundle (= per node): the trainer's nodes, then the rollout's own."""
    t, r = cfg.trainer, cfg.rollout
    return [t.n_gpus_per_node] * t.nnodes + ([r.n_gpus_per_node] * r.nnodes if r.ranks else [])


def probe_address(address: str) -> None:
    """A host:port that accepts no TCP connection makes ray.init retry for minutes: refuse it here in one line."""
    if address == "local":
        raise ValueError("ray_kwargs.ray_init.address=local would start a new cluster; tripod joins a running one: "
                         "set RAY_ADDRESS or ray_kwargs.ray_init.address to its host:port")
    if address == "auto":
        return
    host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"Ray address {address!r} is not host:port (or ray://host:port); set RAY_ADDRESS or "
                         "ray_kwargs.ray_init.address")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_PROBE_S).close()
    except OSError as e:
        raise ValueError(f"no Ray cluster at {address} ({e.strerror or e}); start one (`ray start --head`) or point "
                         "RAY_ADDRESS / ray_kwargs.ray_init.address at its head node") from None


def connect(address: str) -> None:
    import ray

    probe_address(address)
    try:
        ray.init(address=address, logging_level="warning", log_to_driver=True)
    except ConnectionError as e:
        raise ValueError(f"no Ray cluster at {address} ({error_line(e)}); start one (`ray start --head`) or set "
                         "RAY_ADDRESS / ray_kwargs.ray_init.address") from None


def _missing(sizes: list[int], resource: str) -> str:
    """What the cluster lacks for `sizes` bundles on distinct nodes, from each alive node's free `resource`."""
    import ray
    from ray._private.state import state

    ips = {n["NodeID"]: f"{n['NodeManagerAddress']} ({n['NodeID'][:6]})" for n in ray.nodes() if n["Alive"]}
    try:
        free = {ips[k]: v.get(resource, 0.0) for k, v in state.available_resources_per_node().items() if k in ips}
    except Exception:  # a private API: fall back to the nodes' totals
        free = {ips[n["NodeID"]]: n["Resources"].get(resource, 0.0) for n in ray.nodes() if n["NodeID"] in ips}
    left, placed = sorted(free.values(), reverse=True), 0
    for need in sorted(sizes, reverse=True):  # largest bundles on the freest nodes
        if left and left[0] >= need:
            left.pop(0)
            placed += 1
    listing = ", ".join(f"{ip}: {v:g}" for ip, v in sorted(free.items(), key=lambda kv: -kv[1])) or "no alive node"
    return (f"{len(sizes) - placed} of {len(sizes)} bundle(s) {sorted(set(sizes))} {resource} have no node (free "
            f"{resource} per node: {listing})")


def reserve(sizes: list[int], resource: str, timeout_s: float):
    """The placement group (STRICT_SPREAD: each bundle on its own node), or TimeoutError naming what is missing."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{resource: float(n)} for n in sizes], strategy="STRICT_SPREAD")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        missing = _missing(sizes, resource)
        remove_placement_group(pg)
        raise TimeoutError(f"Ray granted no placement group for trainer.launcher=ray in {timeout_s:g} s: {missing}; "
                           "free or add nodes, lower trainer.nnodes / n_gpus_per_node (rollout.* too), or raise "
                           "ray_kwargs.placement_timeout_s")
    return pg


def _tee_output(path: str) -> None:
    """This process's fds 1 and 2 into `path` (appended) and on to what they were (Ray streams that to the driver)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log = open(path, "ab", buffering=0)
    sys.stdout.flush()
    sys.stderr.flush()
    before = os.dup(1)
    read_end, write_end = os.pipe()
    for fd in (1, 2):
        os.dup2(write_end, fd)
    os.close(write_end)

    def pump() -> None:
        while chunk := os.read(read_end, 1 << 16):
            log.write(chunk)
            os.write(before, chunk)

    threading.Thread(target=pump, name="tripod-rank-log", daemon=True).start()
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]


class RankActor:
    """One rank of the world in its own Ray worker process (wrapped by ray.remote at launch)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __repr__(self) -> str:  # Ray's prefix of this actor's lines on the driver
        return f"rank{self.rank}"

    def where(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return dict(host=socket.gethostname(), ip=ray.util.get_node_ip_address(), node_id=ctx.get_node_id(),
                    gpu_ids=[str(g) for g in ctx.get_accelerator_ids().get("GPU", [])], pid=os.getpid())

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(self, env: dict[str, str], cwd: str, log_path: str, fn: Callable[..., Any], args: tuple) -> str:
        """'' when `fn(*args)` finished on this rank, else the one-line error (the traceback goes to the log)."""
        _tee_output(log_path)
        print(f"=== tripod rank {env['RANK']} of {env['WORLD_SIZE']} on {socket.gethostname()}, pid {os.getpid()}, "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')} ===", flush=True)  # the log is appended across launches
        os.environ.update(env)
        if os.path.isdir(cwd):  # relative recipe paths as the driver sees them (same checkout / shared FS)
            os.chdir(cwd)
        try:
            _run_in_world(fn, args)
            return ""
        except BaseException as e:
            traceback.print_exc()
            return error_line(e) if isinstance(e, USER_ERRORS) else f"{type(e).__name__}: {error_line(e)}"
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


def rank_environments(where: list[dict], bundle_of: list[int], master: str, gpus: bool) -> list[dict[str, str]]:
    """The torchrun variables of every rank; ranks of a bundle are one node's, local rank in rank order."""
    nodes = sorted(set(bundle_of))
    members = {b: [r for r, rb in enumerate(bundle_of) if rb == b] for b in nodes}
    envs = []
    for rank, b in enumerate(bundle_of):
        env = dict(RANK=str(rank), WORLD_SIZE=str(len(bundle_of)), LOCAL_RANK=str(members[b].index(rank)),
                   LOCAL_WORLD_SIZE=str(len(members[b])), GROUP_WORLD_SIZE=str(len(nodes)),
                   MASTER_ADDR=master.rpartition(":")[0], MASTER_PORT=master.rpartition(":")[2])
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(g for r in members[b] for g in where[r]["gpu_ids"])
        envs.append(env)
    return envs


def _write_json(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def _node_up(node: dict | None) -> bool:
    """Whether a node is up: alive for the GCS (which declares a silent node dead only after its health checks fail,
    ~15 s by default) and its raylet still accepting connections (refused at once when the raylet is gone)."""
    if not node or not node["Alive"]:
        return False
    try:
        socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=2).close()
        return True
    except OSError:
        return False


def _outcome(refs: dict, roles: list[str], where: list[dict]) -> str | None:
    """None when every rank finished, else the one line naming the failed rank and its node (see the docstring)."""
    import ray
    from ray.exceptions import RayActorError

    pending, lost, errors, deadline = dict(refs), {}, {}, None
    while pending and not lost:
        left = None if deadline is None else deadline - time.time()
        if left is not None and left <= 0:
            break
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
        for ref in ready:
            rank = pending.pop(ref)
            try:
                msg = ray.get(ref)
            except RayActorError as e:
                lost[rank] = e
                continue
            if msg:
                errors[rank] = msg
                if not LOST_PEER.search(msg):  # the rank's own error: the cause
                    pending = {}
                elif deadline is None:
                    deadline = time.time() + PEER_LOSS_WAIT_S
    if not lost and not errors:
        return None
    nodes = {n["NodeID"]: n for n in ray.nodes()}

    def node(rank: int) -> str:
        w = where[rank]
        return f"{w['host']} ({w['ip']}, Ray node {w['node_id'][:12]})"

    if lost:
        rank = min(lost)
        what = "its actor process died" if _node_up(nodes.get(where[rank]["node_id"])) else "its node died"
        return f"rank {rank} ({roles[rank]}) on {node(rank)} was lost: {what}"
    rank = min(errors, key=lambda r: (bool(LOST_PEER.search(errors[r])), r))
    return f"rank {rank} ({roles[rank]}) on {node(rank)} failed: {errors[rank]}"


def _run_once(cfg, world_size: int, fn: Callable[..., Any], args: tuple, attempt: int) -> str | None:
    """One launch of the world on the cluster: None when it finished, else the failure's one line."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    sizes, gpus = bundle_sizes(cfg), cfg.trainer.device == "cuda"
    if sum(sizes) != world_size:
        raise ValueError(f"the placement group holds {sum(sizes)} ranks but the world has {world_size}")
    resource, timeout = ("GPU" if gpus else "CPU"), cfg.ray_kwargs.placement_timeout_s
    pg = reserve(sizes, resource, timeout)
    bundle_of = [b for b, n in enumerate(sizes) for _ in range(n)]
    roles = ["trainer"] * (cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node)
    roles += ["rollout"] * (world_size - len(roles))
    forwarded = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    actor_class = ray.remote(RankActor)
    actors = [actor_class.options(
        num_cpus=0 if gpus else 1, num_gpus=1 if gpus else 0, max_restarts=0, runtime_env={"env_vars": forwarded},
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)).remote(rank)
        for rank, b in enumerate(bundle_of)]
    try:
        try:
            where = ray.get([a.where.remote() for a in actors], timeout=timeout)
            master = f"{where[0]['ip']}:{ray.get(actors[0].free_port.remote(), timeout=timeout)}"
        except (RayActorError, GetTimeoutError) as e:  # e.g. tripod not importable on a node, a runtime_env failure
            raise CommandFailed(f"the ranks' Ray actors did not start: {error_line(e)[:500]}; every node needs "
                                "tripod installed in the Python that runs Ray") from None
        run_dir = os.path.abspath(cfg.trainer.default_local_dir)
        _write_json(os.path.join(run_dir, "placement.json"), dict(
            address=ray.get_runtime_context().gcs_address, attempt=attempt, master=master, resource=resource,
            strategy="STRICT_SPREAD", placement_group=pg.id.hex(),
            ranks=[dict(rank=r, role=roles[r], bundle=bundle_of[r], **where[r]) for r in range(world_size)]))
        print(f"ray: {world_size} rank(s) on {len(sizes)} node(s), rank 0 at {master}; {run_dir}/placement.json, "
              f"logs {run_dir}/logs/rank<r>.log", flush=True)
        envs = rank_environments(where, bundle_of, master, gpus)
        refs = {a.run.remote(envs[r], os.getcwd(), os.path.join(run_dir, "logs", f"rank{r}.log"), fn, args): r
                for r, a in enumerate(actors)}
        return _outcome(refs, roles, where)
    finally:  # no rank outlives the launch: a survivor blocked on a collective is killed, not waited for
        for a in actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(pg)


def run_on_ray(cfg, world_size: int, fn: Callable[..., Any], args: tuple) -> None:
    """Run `fn(*args)` on every rank of a `world_size` world of Ray actors (the module docstring); CommandFailed with
    one line when a rank or node is lost and trainer.max_restarts restarts are used up."""
    import ray

    if not cfg.ray_kwargs.placement_timeout_s > 0:
        raise ValueError(f"ray_kwargs.placement_timeout_s={cfg.ray_kwargs.placement_timeout_s} must be > 0")
    connect(cluster_address(cfg))
    try:
        restarts = cfg.trainer.max_restarts
        for attempt in range(restarts + 1):
            failure = _run_once(cfg, world_size, fn, args, attempt)
            if failure is None:
                return
            if attempt == restarts:
                raise CommandFailed(f"{failure}; the other ranks were stopped"
                                    + ("" if not restarts else f" ({restarts} restart(s) used)")
                                    + "; resubmit with trainer.resume=auto to continue from the newest checkpoint")
            print(f"tripod: {failure}; restarting the group from the newest checkpoint (restart {attempt + 1} of "
                  f"{restarts})", flush=True)
    finally:
        ray.shutdown()
