"""Real launches of `tripod train` through recipes/launch_torchrun.sh: two torchrun agents forming one 2-node
world over a c10d rendezvous on 127.0.0.1 give the same 3 PPO steps as one node (a reference world of 4 ranks,
started beside them), and under --max-restarts a
SIGKILLed rank restarts the group, which resumes from the last complete checkpoint and ends with the weights of
an uninterrupted run.

Why exact equality: both runs execute the same ranks with the same layout (TP2 x DP2, or DP2), the same thread
count (1 per process) and the same gloo collectives on the same CPU, in the same order; only how the processes
found each other differs. Any difference is a real bug (a rank given different data, a different reduction
order, state lost on resume), not floating-point noise.
"""
import json
import os
import random
import signal
import subprocess
import time

import pytest
import torch

from tests.helpers.common import REPO_ROOT, launch_world
from tests.helpers.common import free_port as _free_port
from tests.helpers.common import launch_env as _env
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides

LAUNCHER = str(REPO_ROOT / "recipes" / "launch_torchrun.sh")
COMPARED = ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm", "actor/ppo_kl",
            "critic/score/mean", "response_length/mean", "actor/entropy")


def _launch(args, log, **env):
    """The launcher in its own session; output to the file `log` (a pipe nobody reads while the test polls
    would fill up and block the workers)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", LAUNCHER, "recipes/defaults.yaml", *args], cwd=REPO_ROOT,
                                env=_env(**env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log
    return proc


def _finish(proc, timeout=600):
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with open(proc.log) as f:
        out = f.read()
    assert proc.returncode is not None and proc.returncode != -signal.SIGKILL, f"launch timed out:\n{out[-5000:]}"
    return proc.returncode, out


def _in_one_world(args, nproc, log):
    """`tripod train recipes/defaults.yaml *args` in-process on the ranks of a test world (no launcher): a reference
    run for the launches under test."""
    return launch_world("tripod_commands.py", nproc, json.dumps([["train", "recipes/defaults.yaml", *args]]), log=log)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {m["step"]: m for m in map(json.loads, f)}  # a resumed run may log a step twice; the last counts


def _weights(ckpt, tmp_path, name):
    """Every tensor of a checkpoint's actor and critic (megatron dist checkpoints), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = {}
    for model in ("actor", "critic"):
        dst = str(tmp_path / f"{name}_{model}.pt")
        dcp_to_torch_save(os.path.join(ckpt, model, "model"), dst)
        out.update({f"{model}/{k}": v for k, v in torch.load(dst, weights_only=False).items()
                    if isinstance(v, torch.Tensor)})
    return out


def _assert_same_run(a_dir, b_dir, tmp_path, steps):
    a, b = _metrics(a_dir), _metrics(b_dir)
    assert sorted(a) == sorted(b) and max(a) == steps
    for step in a:
        for k in COMPARED:
            if k in a[step]:
                assert b[step][k] == a[step][k], (step, k, a[step][k], b[step][k])
    ckpt = os.path.join("checkpoints", f"global_step_{steps}")
    wa = _weights(os.path.join(a_dir, ckpt), tmp_path, "a")
    wb = _weights(os.path.join(b_dir, ckpt), tmp_path, "b")
    assert wa.keys() == wb.keys() and len(wa) > 10
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]"}


def test_launch_detection():
    from tripod.engine.launch import detect_launch, parse_first_host, srun_env

    tr = detect_launch({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "GROUP_WORLD_SIZE": "2"})
    assert (tr.kind, tr.world_size, tr.rank, tr.local_rank, tr.nproc_per_node, tr.nnodes) == ("torchrun", 4, 3, 1, 2, 2)
    sr = detect_launch(SRUN)
    assert (sr.kind, sr.world_size, sr.rank, sr.local_rank, sr.nproc_per_node, sr.nnodes) == ("srun", 4, 3, 1, 2, 2)
    # the batch script itself (no job step) and a one-task step are plain launches: tripod spawns its world
    assert detect_launch({k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}).kind == "local"
    assert detect_launch(dict(SRUN, SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1")).kind == "local"
    assert detect_launch(dict(SRUN, RANK="0", WORLD_SIZE="2")).kind == "torchrun"  # srun -> torchrun
    assert parse_first_host("gpu[07-08,11],cpu1") == "gpu07" and parse_first_host("node5,node6") == "node5"
    env = srun_env(dict(SRUN, SLURM_STEP_NODELIST="gpu07", MASTER_PORT="31234"))
    assert env == dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_WORLD_SIZE="2",
                       MASTER_ADDR="gpu07", MASTER_PORT="31234")
    assert srun_env(dict(SRUN, SLURM_STEP_NODELIST="gpu07"))["MASTER_PORT"] == str(20000 + 4242)


@pytest.mark.dist
def test_two_torchrun_nodes_equal_one_node(tmp_path):
    setup = make_ppo_setup(tmp_path)
    one, two = str(tmp_path / "one_node"), str(tmp_path / "two_nodes")
    common = ["data.val_files=[]", "trainer.val_before_train=false"]
    # one node, 4 processes: the reference, in a world of 4 forked ranks (tests/helpers/forked_worlds.py: `tripod
    # train` in-process on each rank, as under torchrun) beside the two launched nodes; one thread a rank each
    one_node = _in_one_world(tiny_overrides(setup, one, world=4, tp=2, steps=3) + common, 4, tmp_path / "one.log")
    port = _free_port()
    nodes = [_launch(tiny_overrides(setup, two, world=2, tp=2, steps=3) + common, tmp_path / f"node{r}.log",
                     NNODES="2", NPROC="2",
                     NODE_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_ID=f"t{port}")
             for r in (0, 1)]
    for proc in nodes:
        code, out = _finish(proc)
        assert code == 0, out[-5000:]
    assert one_node.wait(timeout=600) == 0, (tmp_path / "one.log").read_text()[-5000:]
    with open(os.path.join(two, "config.yaml")) as f:
        assert "nnodes: 2" in f.read()
    _assert_same_run(one, two, tmp_path, steps=3)


def _worker_pids(root_pid):
    """Processes under `root_pid` whose environment has LOCAL_RANK (torchrun's workers), by local rank."""
    found, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (FileNotFoundError, ProcessLookupError):
            continue
        if b"LOCAL_RANK" in env and b"TORCHELASTIC_RESTART_COUNT" in env:
            found[int(env[b"LOCAL_RANK"])] = pid
    return found


@pytest.mark.dist
def test_sigkill_of_one_rank_restarts_the_group_and_resumes_exactly(tmp_path):
    # a different kill step from run to run (TRIPOD_TEST_SEED=<seed> replays one); the seed is in the test's output
    seed = int(os.environ.get("TRIPOD_TEST_SEED", str(time.time_ns() % 1_000_000)))
    kill_step = random.Random(seed).choice([2, 3])  # killed during this step, after checkpoint kill_step - 1
    print(f"elastic restart: TRIPOD_TEST_SEED={seed}, SIGKILL of local rank 1 during step {kill_step}")
    setup = make_ppo_setup(tmp_path)
    ref, cut = str(tmp_path / "uninterrupted"), str(tmp_path / "killed")
    common = ["trainer.save_freq=1", "data.val_files=[]", "trainer.val_before_train=false"]
    ref_args = tiny_overrides(setup, ref, world=2, steps=3) + common
    cut_args = [a for a in tiny_overrides(setup, cut, world=2, steps=3) if not a.startswith("trainer.resume=")]
    cut_args += common + ["trainer.resume=auto"]
    # the uninterrupted reference in a world of forked ranks, beside the launch under test
    reference = _in_one_world(ref_args, 2, tmp_path / "ref.log")
    job = _launch(cut_args, tmp_path / "killed.log", MAX_RESTARTS="2")
    marker = os.path.join(cut, "checkpoints", f"global_step_{kill_step - 1}", "COMPLETE")
    deadline = time.time() + 600
    while not os.path.exists(marker) and job.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert os.path.exists(marker), "the run never completed the checkpoint before the kill step"
    victim = _worker_pids(job.pid).get(1)
    assert victim is not None, "no worker with LOCAL_RANK=1 found under the launcher"
    assert not os.path.exists(os.path.join(cut, "checkpoints", f"global_step_{kill_step}"))
    os.kill(victim, signal.SIGKILL)  # mid-step: rank 0 has just started step kill_step
    code, out = _finish(job)
    assert code == 0, out[-5000:]
    assert "exitcode: -9" in out, out[-3000:]  # the agent saw the SIGKILL, yet the launch succeeded: restarted
    # Retraining from step 0 after the restart would end with the same weights (the runs are deterministic), so the
    # restart must show that it resumed: one resume line naming the last complete checkpoint, and the steps after
    # it logged by a process that started at that step.
    resumed = [line for line in out.splitlines() if "tripod: resumed from" in line]
    saved = kill_step - 1
    assert len(resumed) == 1 and resumed[0].rstrip().endswith(f"global_step_{saved} at step {saved}"), resumed
    starts = {step: m["training/start_step"] for step, m in _metrics(cut).items()}
    assert starts == {s: (0 if s <= saved else saved) for s in (1, 2, 3)}, (kill_step, starts)
    assert reference.wait(timeout=600) == 0, (tmp_path / "ref.log").read_text()[-5000:]
    _assert_same_run(ref, cut, tmp_path, steps=3)
