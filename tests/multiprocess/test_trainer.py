"""The PPO trainer end to end on a tiny model: exact resume after SIGKILL, fail-fast inputs.
(Cross-layout equivalence of training runs: tests/multiprocess/test_layout_equivalence.py.)"""
import json
import math
import os
import subprocess
import time

import pytest
import torch

from tests.helpers.common import launch_world
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import GREEDY, final_actor_weights_of, metrics, train, tripod_in_one_world

COMPARED = ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm", "actor/ppo_kl",
            "critic/score/mean", "response_length/mean", "actor/lr", "critic/lr")


def _train(args, timeout=900, **popen):
    return train(args, timeout=timeout, **popen)


@pytest.mark.dist
@pytest.mark.parametrize("tp,pp,world", [(2, 2, 4)], ids=["tp2pp2"])
def test_resume_after_sigkill_is_exact(tmp_path, tp, pp, world):
    """Saving asynchronously (`trainer.async_save`), killed (SIGKILL to every rank) while the step-3 checkpoint is being
    written (a planted 120 s wait in its writer thread), after the step-2 one became complete, then `trainer.resume=auto` in a new
    world (`tripod train` in-process on each rank, tests/multiprocess/workers/tripod_commands.py; the CLI's own
    launching is test_launch's): the resumed process must start at
    step 2 (its log line and the `training/start_step` metric), leave steps 0-2 as the killed process logged them
    (a no-op resume would recompute and rewrite them, with other timings), and end bit-identical to an uninterrupted
    run, which saved synchronously (so the asynchronous save wrote the same state). At TP2 x PP2 only: a (1,1,1) case ran the same assertions on a subset of the same code (110 s of the suite);
    one-rank and DP2 resumes are also exact in test_launch (elastic restart) and test_precision (another layout)."""
    setup = make_ppo_setup(tmp_path)
    # a decaying LR schedule: a resume that did not restore the scheduler would train step 3 at a different LR
    schedule = ["actor_rollout_ref.actor.optim.lr_warmup_steps=2", "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
                "actor_rollout_ref.actor.optim.min_lr_ratio=0.1", "critic.optim.lr_decay_style=linear"]
    # the critic on SGD (megatron's momentum 0.9): its momentum buffers are restored too (megatron gives SGD no state
    # initialiser for the load; engine/checkpoints/optimizer_state.py's _sgd_init_state)
    common = GREEDY[1:] + ["actor_rollout_ref.rollout.do_sample=true", "trainer.save_freq=1",
                           "critic.optim.optimizer=sgd"] + schedule
    ref_dir, cut_dir = str(tmp_path / "uninterrupted"), str(tmp_path / "killed")
    layout = dict(world=world, tp=tp, pp=pp, steps=3)
    args = tiny_overrides(setup, cut_dir, **layout) + common
    # the uninterrupted run and the one to be killed side by side, each in a world of its own (one thread a rank: a
    # run's arithmetic does not depend on what runs beside it)
    ref = launch_world("tripod_commands.py", world, json.dumps([["train", "recipes/defaults.yaml",
                                                                 *tiny_overrides(setup, ref_dir, **layout), *common]]),
                       log=tmp_path / "uninterrupted.log")
    job = launch_world("tripod_commands.py", world, json.dumps([{
        "argv": ["train", "recipes/defaults.yaml", *args, "trainer.async_save=true"], "plant": "slow_checkpoint_write"}]),
        log=tmp_path / "killed.log")
    marker = os.path.join(cut_dir, "checkpoints", "global_step_2", "COMPLETE")
    in_flight = os.path.join(cut_dir, "checkpoints", "tmp_global_step_3", "trainer_state.json")
    deadline = time.time() + 900
    while not (os.path.exists(marker) and os.path.exists(in_flight)) and time.time() < deadline:
        try:
            job.wait(timeout=0.2)
            break  # ended before the kill
        except subprocess.TimeoutExpired:
            pass
    job.kill()  # SIGKILL to every rank, while the step-3 checkpoint is being written
    job.wait()
    assert os.path.exists(in_flight), "the run never began writing its step-3 checkpoint"
    assert ref.wait(timeout=900) == 0, (tmp_path / "uninterrupted.log").read_text()[-5000:]
    assert os.path.exists(marker), "the run never completed its step-2 checkpoint"
    assert not os.path.exists(os.path.join(cut_dir, "checkpoints", "global_step_3"))
    with open(os.path.join(cut_dir, "metrics.jsonl")) as f:  # (a step-3 line may be cut short by the kill)
        before = [line for line in f if line.endswith("\n") and json.loads(line)["step"] <= 2]
    assert [json.loads(line)["step"] for line in before] == [0, 1, 2]
    # debris a crash can leave: a half-written save and a directory without its COMPLETE marker
    os.makedirs(os.path.join(cut_dir, "checkpoints", "tmp_global_step_3", "actor"), exist_ok=True)  # (the kill left it)
    os.makedirs(os.path.join(cut_dir, "checkpoints", "global_step_99", "actor"))

    resume_args = [a for a in args if not a.startswith("trainer.resume=")] + ["trainer.resume=auto"]
    out = tripod_in_one_world([["train", "recipes/defaults.yaml", *resume_args]], world)
    saved = os.path.join(cut_dir, "checkpoints", "global_step_2")
    assert f"tripod: resumed from {saved} at step 2" in out, out[-3000:]
    with open(os.path.join(cut_dir, "metrics.jsonl")) as f:
        after = f.readlines()
    assert after[:3] == before, "the resumed process rewrote the steps the killed one had logged"
    want, got = metrics(ref_dir), metrics(cut_dir)
    assert [m["step"] for m in got] == [0, 1, 2, 3]
    # 4 prompts / mini-batch 2 = 2 optimizer steps per PPO step, 6 in all; the logged LR is that of each step's
    # last update (optimizer steps 1, 3, 5): warm-up 0 -> 1e-3 over 2 steps, then cosine to 1e-4 (closed form)
    cosine = lambda k: 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * (k - 2) / (6 - 2)))  # noqa: E731
    assert [m["actor/lr"] for m in want[1:]] == pytest.approx([0.5e-3, cosine(3), cosine(5)], rel=1e-9)
    assert [m["critic/lr"] for m in want[1:]] == pytest.approx([1e-3 * (1 - k / 6) for k in (1, 3, 5)], rel=1e-9)
    assert [m.get("training/start_step") for m in got] == [None, 0, 0, 2]  # step 0 is validation only
    for a, b in zip(want, got):
        for k in COMPARED:
            if k in a:
                assert b[k] == pytest.approx(a[k], abs=1e-6), (a["step"], k)
    weights = final_actor_weights_of({ref_dir: 3, cut_dir: 3})
    w_ref, w_cut = weights[ref_dir], weights[cut_dir]
    for name in w_ref:
        assert torch.equal(w_ref[name], w_cut[name]), name


@pytest.mark.dist
def test_kill_while_deleting_an_old_checkpoint_resumes_from_the_newest(tmp_path):
    """`trainer.max_actor_ckpt_to_keep=1` / `max_critic_ckpt_to_keep=1`, a checkpoint every step, one rank: killed
    (SIGKILL) half-way through deleting global_step_1 once global_step_2 is complete (a planted 120 s wait after its
    actor weights went, before its actor optimizer state goes), then `trainer.resume=auto`: it must resume from
    global_step_2, never from the half-deleted checkpoint, clear what the kill left, keep only global_step_3 at the
    end and match an uninterrupted run bit for bit. A rule that deleted old checkpoints before the new one is complete
    (verl's: the previous ones beyond K-1 go before the save) leaves nothing to resume here and fails. The rule itself,
    and the crash states of a deletion, in closed form: tests/unit/test_checkpoint_retention.py."""
    setup = make_ppo_setup(tmp_path)
    common = GREEDY[1:] + ["actor_rollout_ref.rollout.do_sample=true", "trainer.save_freq=1",
                           "trainer.max_actor_ckpt_to_keep=1", "trainer.max_critic_ckpt_to_keep=1"]
    ref_dir, cut_dir = str(tmp_path / "uninterrupted"), str(tmp_path / "killed")
    args = tiny_overrides(setup, cut_dir, steps=3) + common
    ref = launch_world("tripod_commands.py", 1, json.dumps([["train", "recipes/defaults.yaml",
                                                             *tiny_overrides(setup, ref_dir, steps=3), *common]]),
                       log=tmp_path / "uninterrupted.log")
    job = launch_world("tripod_commands.py", 1, json.dumps([{
        "argv": ["train", "recipes/defaults.yaml", *args], "plant": "slow_checkpoint_delete"}]), log=tmp_path / "killed.log")
    ckpts = os.path.join(cut_dir, "checkpoints")
    half = os.path.join(ckpts, "global_step_1")
    deleting = os.path.join(half, "actor_optim.deleting")
    deadline = time.time() + 900
    while not os.path.exists(deleting) and time.time() < deadline:
        try:
            job.wait(timeout=0.2)
            break  # ended before the kill
        except subprocess.TimeoutExpired:
            pass
    job.kill()  # SIGKILL, while global_step_1 is being deleted
    job.wait()
    assert os.path.exists(deleting), (tmp_path / "killed.log").read_text()[-3000:]
    assert ref.wait(timeout=900) == 0, (tmp_path / "uninterrupted.log").read_text()[-5000:]
    assert sorted(os.listdir(half)) == sorted(["PRUNED", "actor_optim.deleting", "critic", "critic_optim", "rng",
                                               "trainer_state.json"])  # neither COMPLETE nor its actor weights
    assert os.path.exists(os.path.join(ckpts, "global_step_2", "COMPLETE"))
    assert [m["step"] for m in metrics(cut_dir)] == [0, 1, 2]

    resume_args = [a for a in args if not a.startswith("trainer.resume=")] + ["trainer.resume=auto"]
    out = tripod_in_one_world([["train", "recipes/defaults.yaml", *resume_args]], 1)
    assert f"tripod: resumed from {os.path.join(ckpts, 'global_step_2')} at step 2" in out, out[-3000:]
    assert os.listdir(ckpts) == ["global_step_3"] and os.listdir(os.path.join(ref_dir, "checkpoints")) == \
        ["global_step_3"]
    want, got = metrics(ref_dir), metrics(cut_dir)
    assert [m["step"] for m in got] == [0, 1, 2, 3]
    assert [m.get("training/start_step") for m in got] == [None, 0, 0, 2]
    for a, b in zip(want, got):
        for k in COMPARED:
            if k in a:
                assert b[k] == a[k], (a["step"], k)
    weights = final_actor_weights_of({ref_dir: 3, cut_dir: 3})
    for name, tensor in weights[ref_dir].items():
        assert torch.equal(tensor, weights[cut_dir][name]), name


def test_bad_data_stops_the_cli_at_start_with_one_line(tmp_path):
    """The real `tripod train` process on bad data: exit code 2 and one line, before any rank process could print.
    Every other bad input is a row of tests/multiprocess/test_bad_inputs.py's table, checked in-process (this
    file's five other subprocess cases duplicated rows of it: empty file, prompts too long, unknown data source,
    mini-batch not dividing, rollout TP not dividing)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    setup = make_ppo_setup(tmp_path)
    bad = str(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"prompt": ["What is 1+1?"], "data_source": ["arithmetic"]}), bad)
    proc = _train(tiny_overrides(setup, str(tmp_path / "run")) + [f"data.train_files={bad}"], timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "reward_model" in proc.stdout, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tripod train: error: "), proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout  # one line: refused before any rank process could print
