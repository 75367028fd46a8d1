"""`tripod train ... trainer.launcher=ray` on a real local Ray cluster started here (ray.cluster_utils.Cluster): a
head raylet with no CPU (it runs the GCS and the driver's connection, as KubeRay's head does with num-cpus 0, so that
killing a worker node never takes the GCS down) and two worker raylets with one CPU each.

- 2 steps of a 2-rank run (trainer.nnodes=2 x n_gpus_per_node=1) place one rank on each worker node (placement.json)
  and give the metrics and final weights of the same run launched locally (spawned, 1 node x 2), exactly: the same
  ranks, layout, threads (1) and gloo collectives; only how the processes found each other differs.
- Rank 1's node lost during step 2 (SIGKILL of its raylet and of the processes it started): the driver exits
  non-zero within 60 s with one error line naming rank 1 and its node, and no rank process is left; with
  trainer.resume=auto, the resubmission on the restarted cluster (a fresh worker raylet) resumes from global_step_1
  and ends equal to the uninterrupted run.
- trainer.max_restarts=1 and rank 1's process SIGKILLed during step 2: the driver restarts the group itself, which
  resumes from global_step_1 and ends equal to the uninterrupted run.
- Too few free CPUs for the placement group: one line saying what is missing, after ray_kwargs.placement_timeout_s.

The cluster tests are marked `ray` (make test-launch; ~3 min on 2 busy cores), excluded from make test; the
no-cluster line (a dead address refused in one line, without a cluster) runs in make test. Ray is a tripod
dependency, so a missing Ray fails these tests, never skips them. The module fixture stops only the raylets it started
(Cluster.shutdown kills the processes of its own nodes)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.common import REPO_ROOT
from tests.helpers.common import launch_env as _env
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.multiprocess.test_launch import _assert_same_run, _metrics

STEPS = 2
KILL_BOUND_S = 60.0


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    small = dict(object_store_memory=80 * 2**20)
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False, **small))
    workers = [c.add_node(num_cpus=1, **small) for _ in range(2)]
    c.wait_for_nodes()
    c.workers = workers
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return make_ppo_setup(tmp_path_factory.mktemp("ray_setup"))


def _args(setup, run_dir, *extra):
    return tiny_overrides(setup, run_dir, world=2, steps=STEPS) + [
        "data.val_files=[]", "trainer.val_before_train=false", "trainer.save_freq=1", *extra]


def _train(args, log, **env):
    """`tripod train recipes/defaults.yaml *args` as a user types it, in its own session, output to `log`."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tripod", "train", "recipes/defaults.yaml", *args],
                                cwd=REPO_ROOT, env=_env(**env), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    proc.log = log
    return proc


def _finish(proc, timeout=600):
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with open(proc.log) as f:
        return proc.returncode, f.read()


def _on_ray(cluster, setup, run_dir, *extra):
    return _args(setup, run_dir, "trainer.nnodes=2", "trainer.n_gpus_per_node=1", "trainer.launcher=ray",
                 f"ray_kwargs.ray_init.address={cluster.address}", *extra)


def _placement(run_dir):
    with open(os.path.join(run_dir, "placement.json")) as f:
        return json.load(f)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(")")[-1].split()[0] != "Z"


def _descendants(root):
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except FileNotFoundError:
                continue
            found += kids
            todo += kids
    return found


def _lose_node(cluster, node):
    """The node dies at once: SIGKILL of its raylet (Cluster.remove_node) and of every process the raylet started
    (its workers: a worker outlives its raylet by seconds, a lost machine's processes do not)."""
    raylet = node.all_processes["raylet"][0].process.pid
    workers = _descendants(raylet)
    cluster.remove_node(node, allow_graceful=False)
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def local_reference(setup, tmp_path_factory):
    """The uninterrupted run, launched locally (tripod spawns 1 node x 2 ranks)."""
    run_dir = str(tmp_path_factory.mktemp("local") / "run")
    code, out = _finish(_train(_args(setup, run_dir, "trainer.launcher=local"), run_dir + ".log"))
    assert code == 0, out[-5000:]
    return run_dir


@pytest.mark.ray
def test_two_ranks_on_two_nodes_equal_the_local_run(cluster, setup, local_reference, tmp_path):
    run_dir = str(tmp_path / "ray")
    code, out = _finish(_train(_on_ray(cluster, setup, run_dir), tmp_path / "ray.log"))
    assert code == 0, out[-5000:]
    placed = _placement(run_dir)
    workers = {n.node_id for n in cluster.workers}
    nodes = [r["node_id"] for r in placed["ranks"]]
    assert [r["rank"] for r in placed["ranks"]] == [0, 1] and placed["strategy"] == "STRICT_SPREAD"
    assert len(set(nodes)) == 2 and set(nodes) == workers, (nodes, workers)  # one rank on each worker raylet
    for rank in (0, 1):  # each rank's own output in the run directory
        with open(os.path.join(run_dir, "logs", f"rank{rank}.log")) as f:
            assert f"=== tripod rank {rank} of 2 on " in f.read()
    _assert_same_run(local_reference, run_dir, tmp_path, steps=STEPS)


@pytest.mark.ray
def test_raylet_of_rank1_killed_then_resume_is_exact(cluster, setup, local_reference, tmp_path):
    run_dir = str(tmp_path / "ray")
    job = _train(_on_ray(cluster, setup, run_dir, "trainer.resume=auto"), tmp_path / "killed.log")
    marker = os.path.join(run_dir, "checkpoints", "global_step_1", "COMPLETE")
    deadline = time.time() + 600
    while not os.path.exists(marker) and job.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert os.path.exists(marker), _finish(job, timeout=1)[1][-5000:]
    placed = _placement(run_dir)["ranks"]
    victim = next(n for n in cluster.workers if n.node_id == placed[1]["node_id"])
    assert not os.path.exists(os.path.join(run_dir, "checkpoints", "global_step_2"))
    killed_at = time.time()
    _lose_node(cluster, victim)  # during step 2
    code, out = _finish(job, timeout=KILL_BOUND_S + 30)
    took = time.time() - killed_at
    print(f"driver exited {code} {took:.1f} s after the raylet of rank 1 was killed")
    errors = [line for line in out.splitlines() if line.startswith("tripod train: error:")]
    assert code not in (0, None, -9) and took < KILL_BOUND_S, (code, took, out[-3000:])
    assert len(errors) == 1, out[-3000:]
    assert "rank 1 " in errors[0] and placed[1]["node_id"][:12] in errors[0], errors[0]
    assert "node died" in errors[0], errors[0]
    time.sleep(5)  # the ranks are stopped by the driver (and rank 1 with its raylet), not left to time out
    assert not any(_alive(r["pid"]) for r in placed), [(r["rank"], r["pid"]) for r in placed if _alive(r["pid"])]

    cluster.workers.remove(victim)
    cluster.workers.append(cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20))  # the node comes back
    cluster.wait_for_nodes()
    code, out = _finish(_train(_on_ray(cluster, setup, run_dir, "trainer.resume=auto"), tmp_path / "resumed.log"))
    assert code == 0, out[-5000:]
    with open(os.path.join(run_dir, "logs", "rank0.log")) as f:
        resumed = [line for line in f.read().splitlines() if "tripod: resumed from" in line]
    assert len(resumed) == 1 and resumed[0].rstrip().endswith("global_step_1 at step 1"), resumed
    starts = {step: m["training/start_step"] for step, m in _metrics(run_dir).items()}
    assert starts == {1: 0, 2: 1}, starts  # step 2 was trained by the resubmission, from the checkpoint
    _assert_same_run(local_reference, run_dir, tmp_path, steps=STEPS)


@pytest.mark.ray
def test_too_few_free_cpus_is_one_line_after_the_timeout(cluster, setup, tmp_path):
    args = _args(setup, str(tmp_path / "run"), "trainer.nnodes=4", "trainer.n_gpus_per_node=1",  # 2 nodes have 1 CPU
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1",
                 "trainer.launcher=ray", "ray_kwargs.placement_timeout_s=3")
    code, out = _finish(_train(args, tmp_path / "short.log", RAY_ADDRESS=cluster.address), timeout=300)
    errors = [line for line in out.splitlines() if line.startswith("tripod train: error:")]
    assert code == 2 and len(errors) == 1, out[-3000:]
    assert re.search(r"in 3 s: 2 of 4 bundle\(s\) \[1\] CPU have no node \(free CPU per node: ", errors[0]), errors[0]
    assert not os.path.exists(tmp_path / "run" / "placement.json")


def test_no_cluster_at_the_address_is_one_line(setup, tmp_path):
    from tests.helpers.common import free_port

    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.time()
    code, out = _finish(_train(_args(setup, str(tmp_path / "run"), "trainer.launcher=ray",
                                     f"ray_kwargs.ray_init.address={address}"), tmp_path / "none.log"), timeout=300)
    errors = [line for line in out.splitlines() if line.startswith("tripod train: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert errors[0].startswith(f"tripod train: error: no Ray cluster at {address} ("), errors[0]
    assert time.time() - started < 120 and not os.path.exists(tmp_path / "run" / "placement.json")


@pytest.mark.ray
def test_max_restarts_restarts_the_group_after_a_rank_dies(cluster, setup, local_reference, tmp_path):
    run_dir = str(tmp_path / "ray")
    job = _train(_on_ray(cluster, setup, run_dir, "trainer.resume=auto", "trainer.max_restarts=1"),
                 tmp_path / "restarted.log")
    marker = os.path.join(run_dir, "checkpoints", "global_step_1", "COMPLETE")
    deadline = time.time() + 600
    while not os.path.exists(marker) and job.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert os.path.exists(marker), _finish(job, timeout=1)[1][-5000:]
    first = _placement(run_dir)
    assert first["attempt"] == 0 and not os.path.exists(os.path.join(run_dir, "checkpoints", "global_step_2"))
    os.kill(first["ranks"][1]["pid"], signal.SIGKILL)  # rank 1's process, during step 2; its node stays up
    code, out = _finish(job)
    assert code == 0, out[-5000:]
    restarts = [line for line in out.splitlines() if line.startswith("tripod: rank 1 (trainer) on ")]
    assert len(restarts) == 1 and "its actor process died" in restarts[0], out[-3000:]
    assert restarts[0].endswith("restarting the group from the newest checkpoint (restart 1 of 1)"), restarts
    assert _placement(run_dir)["attempt"] == 1
    starts = {step: m["training/start_step"] for step, m in _metrics(run_dir).items()}
    assert starts == {1: 0, 2: 1}, starts  # the restarted group resumed from global_step_1
    _assert_same_run(local_reference, run_dir, tmp_path, steps=STEPS)
