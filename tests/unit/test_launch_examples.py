"""trainer.launcher without a cluster: the cluster manifests users run as they are (recipes/launch_kuberay.yaml, a
KubeRay RayJob; recipes/launch_skypilot.yaml, a SkyPilot task) run a valid `tripod train` invocation for the shape
of the cluster they describe; `check_launcher` holds trainer.launcher against the launch; the Ray address probe
refuses what ray.init would retry for minutes. The launches themselves: tests/multiprocess/test_launch_ray.py."""
from __future__ import annotations

import re
import shlex

import pytest
import yaml

from tests.helpers.common import REPO_ROOT

# what a recipe leaves to the machine it runs on (as tests/unit/test_recipes.py): its data files and model directory
ENVIRONMENT = ("does not exist", "has no config.json", "is empty", "is not set")


def _manifest(name):
    with open(REPO_ROOT / "recipes" / name) as f:
        return yaml.safe_load(f)


def _check_train_command(argv: list[str], nnodes: int, gpus_per_node: int) -> None:
    """`argv` is `tripod train RECIPE key=value ...` that the CLI parses, whose config loads (only known keys, right
    types) and validates for its world, with trainer.launcher=ray on nnodes x gpus_per_node GPUs."""
    from tripod.engine.cli import build_parser
    from tripod.engine.config import ConfigError, load_config
    from tripod.engine.config_validation import validate_config

    assert argv[:2] == ["tripod", "train"], argv
    args = build_parser().parse_args(argv[1:])
    assert (REPO_ROOT / args.config).is_file(), args.config
    assert all(re.fullmatch(r"[\w.]+=\S+", o) for o in args.overrides), args.overrides
    cfg = load_config(str(REPO_ROOT / args.config), args.overrides)
    t = cfg.trainer
    assert (t.launcher, t.resume, t.device, t.nnodes, t.n_gpus_per_node) == ("ray", "auto", "cuda", nnodes, gpus_per_node)
    try:
        validate_config(cfg, t.nnodes * t.n_gpus_per_node)
    except ConfigError as e:
        problems = [p for p in str(e).split("\n  - ")[1:] if not any(s in p for s in ENVIRONMENT)]
        assert problems == [], problems


def test_kuberay_rayjob_runs_a_valid_train_command():
    job = _manifest("launch_kuberay.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]["rayClusterSpec"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no rank on the head
    (workers,) = spec["workerGroupSpecs"]
    gpus = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"]
    _check_train_command(shlex.split(job["spec"]["entrypoint"]), workers["replicas"], gpus)


def test_skypilot_task_runs_a_valid_train_command():
    task = _manifest("launch_skypilot.yaml")
    nodes, gpus = task["num_nodes"], int(task["resources"]["accelerators"].split(":")[1])
    script = task["run"].replace("\\\n", " ")
    (line,) = [s.strip() for s in script.splitlines() if s.strip().startswith("tripod train")]
    env = dict(task["envs"], SKYPILOT_NUM_NODES=str(nodes), SKYPILOT_NUM_GPUS_PER_NODE=str(gpus))
    line = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], line)  # what SkyPilot's environment expands
    _check_train_command(shlex.split(line), nodes, gpus)
    assert "ray start --head --port=6379" in script and "ray start --address=$HEAD_IP:6379" in script
    assert "export RAY_ADDRESS=127.0.0.1:6379" in script


SRUN = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize("launcher, env, refused", [
    ("auto", {}, None), ("auto", TORCHRUN, None), ("auto", SRUN, None),
    ("local", {}, None), ("local", TORCHRUN, "trainer.launcher=local but this process was started by torchrun"),
    ("torchrun", TORCHRUN, None), ("torchrun", {}, "trainer.launcher=torchrun but RANK/WORLD_SIZE are not set"),
    ("slurm", SRUN, None), ("slurm", dict(TORCHRUN, SLURM_JOB_ID="7"), None),
    ("slurm", TORCHRUN, "trainer.launcher=slurm but this is not a multi-task SLURM step"),
    ("ray", {}, None), ("ray", TORCHRUN, "trainer.launcher=ray but this process was started by torchrun"),
    ("ray", SRUN, "trainer.launcher=ray but this process was started by srun"),
])
def test_launcher_against_the_launch(launcher, env, refused):
    from tripod.engine.launch import check_launcher, detect_launch

    if refused is None:
        check_launcher(launcher, detect_launch(env), env)
    else:
        with pytest.raises(ValueError, match=re.escape(refused)):
            check_launcher(launcher, detect_launch(env), env)


def test_ray_address_probe():
    import socket

    from tripod.engine.launch_ray import probe_address

    with socket.socket() as s:  # a port nobody listens on: refused at once, not retried for minutes by ray.init
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match=rf"^no Ray cluster at 127\.0\.0\.1:{port} \("):
        probe_address(f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="would start a new cluster"):
        probe_address("local")
    with pytest.raises(ValueError, match="is not host:port"):
        probe_address("headnode")
    with socket.socket() as s:  # a listening port passes the probe (ray.init does the rest)
        s.bind(("127.0.0.1", 0))
        s.listen()
        probe_address(f"ray://127.0.0.1:{s.getsockname()[1]}")
