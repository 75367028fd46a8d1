"""The PPO trainer end to end on a tiny model: layout equivalence, exact resume after SIGKILL, fail-fast inputs."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from ppo_setup import make_ppo_setup, tiny_overrides
from utils import REPO_ROOT

TRIPOD = [sys.executable, "-m", "engine.cli"]
COMPARED = ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm", "actor/ppo_kl",
            "critic/score/mean", "response_length/mean", "actor/lr", "critic/lr")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return env


def _train(args, timeout=600, **popen):
    return subprocess.run([*TRIPOD, "train", "recipes/defaults.yaml", *args], cwd=REPO_ROOT, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, **popen)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _export(ckpt, out):
    proc = subprocess.run([*TRIPOD, "export", ckpt, out], cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return load_file(os.path.join(out, "model.safetensors"))


GREEDY = ["actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.n=1",
          "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
          "actor_rollout_ref.rollout.response_length=6"]


@pytest.mark.dist
def test_layouts_give_the_same_training(tmp_path):
    """3 PPO steps at (TP,PP,DP) = (1,1,1), (2,2,1), (1,2,2), and with token-budget micro-batches: same losses,
    grad norms, rollouts and weights."""
    setup = make_ppo_setup(tmp_path)
    runs = {}
    dynamic = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=70"]
    for tp, pp, world, extra in ((1, 1, 1, []), (2, 2, 4, []), (1, 2, 4, []), (1, 1, 1, dynamic)):
        run_dir = str(tmp_path / f"run_tp{tp}pp{pp}w{world}{'dyn' if extra else ''}")
        proc = _train(tiny_overrides(setup, run_dir, world=world, tp=tp, pp=pp, steps=3) + GREEDY + extra)
        assert proc.returncode == 0, proc.stdout[-5000:]
        runs[(tp, pp, world, bool(extra))] = (run_dir, _metrics(run_dir))
    base_dir, base = runs[(1, 1, 1, False)]
    base_w = _export(os.path.join(base_dir, "checkpoints", "global_step_3", "actor"), str(tmp_path / "hf_base"))
    for key, (run_dir, metrics) in runs.items():
        assert [m["step"] for m in metrics] == [0, 1, 2, 3]
        for want, got in zip(base, metrics):
            for k in COMPARED:
                if k in want:
                    assert got[k] == pytest.approx(want[k], abs=1e-5, rel=1e-5), (key, want["step"], k)
        if key != (1, 1, 1, False):
            weights = _export(os.path.join(run_dir, "checkpoints", "global_step_3", "actor"),
                              str(tmp_path / f"hf_{key}"))
            assert weights.keys() == base_w.keys()
            for name in base_w:
                torch.testing.assert_close(weights[name], base_w[name], atol=1e-5, rtol=1e-4, msg=name)
    assert base[-1]["actor/pg_loss"] != 0.0 and base[-1]["critic/vf_loss"] > 0.0


@pytest.mark.dist
def test_resume_after_sigkill_is_exact(tmp_path):
    setup = make_ppo_setup(tmp_path)
    # a decaying LR schedule: a resume that did not restore the scheduler would train step 3 at a different LR
    schedule = ["actor_rollout_ref.actor.optim.lr_warmup_steps=2", "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
                "actor_rollout_ref.actor.optim.min_lr_ratio=0.1", "critic.optim.lr_decay_style=linear"]
    common = GREEDY[1:] + ["actor_rollout_ref.rollout.do_sample=true", "trainer.save_freq=1"] + schedule
    ref_dir, cut_dir = str(tmp_path / "uninterrupted"), str(tmp_path / "killed")
    proc = _train(tiny_overrides(setup, ref_dir, steps=3) + common)
    assert proc.returncode == 0, proc.stdout[-5000:]

    args = tiny_overrides(setup, cut_dir, steps=3) + common
    job = subprocess.Popen([*TRIPOD, "train", "recipes/defaults.yaml", *args], cwd=REPO_ROOT, env=_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    marker = os.path.join(cut_dir, "checkpoints", "global_step_2", "COMPLETE")
    deadline = time.time() + 600
    while not os.path.exists(marker) and job.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(job.pid, signal.SIGKILL)  # between the checkpoints of step 2 and step 3
    job.wait()
    assert os.path.exists(marker), "the run never completed its step-2 checkpoint"
    assert not os.path.exists(os.path.join(cut_dir, "checkpoints", "global_step_3"))
    # debris a crash can leave: a half-written save and a directory without its COMPLETE marker
    os.makedirs(os.path.join(cut_dir, "checkpoints", "tmp_global_step_3", "actor"))
    os.makedirs(os.path.join(cut_dir, "checkpoints", "global_step_99", "actor"))

    resume_args = [a for a in args if not a.startswith("trainer.resume=")] + ["trainer.resume=auto"]
    proc = _train(resume_args)
    assert proc.returncode == 0, proc.stdout[-5000:]
    want, got = _metrics(ref_dir), _metrics(cut_dir)
    assert [m["step"] for m in got] == [0, 1, 2, 3]
    # 4 prompts / mini-batch 2 = 2 optimizer steps per PPO step, 6 in all; the logged LR is that of each step's
    # last update (optimizer steps 1, 3, 5): warm-up 0 -> 1e-3 over 2 steps, then cosine to 1e-4 (closed form)
    cosine = lambda k: 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * (k - 2) / (6 - 2)))  # noqa: E731
    assert [m["actor/lr"] for m in want[1:]] == pytest.approx([0.5e-3, cosine(3), cosine(5)], rel=1e-9)
    assert [m["critic/lr"] for m in want[1:]] == pytest.approx([1e-3 * (1 - k / 6) for k in (1, 3, 5)], rel=1e-9)
    for a, b in zip(want, got):
        for k in COMPARED:
            if k in a:
                assert b[k] == pytest.approx(a[k], abs=1e-6), (a["step"], k)
    w_ref = _export(os.path.join(ref_dir, "checkpoints", "global_step_3", "actor"), str(tmp_path / "hf_ref"))
    w_cut = _export(os.path.join(cut_dir, "checkpoints", "global_step_3", "actor"), str(tmp_path / "hf_cut"))
    for name in w_ref:
        assert torch.equal(w_ref[name], w_cut[name]), name


def _write_rows(path, rows):
    from engine.data import write_prompt_parquet
    write_prompt_parquet(rows, path)


@pytest.mark.parametrize("case", ["missing_column", "empty_file", "too_long", "unknown_source", "bad_batch",
                                  "rollout_tp"])
def test_bad_config_and_data_stop_at_start(tmp_path, case):
    import pyarrow as pa
    import pyarrow.parquet as pq
    setup = make_ppo_setup(tmp_path)
    args = tiny_overrides(setup, str(tmp_path / "run"))
    expect = {"missing_column": "reward_model", "empty_file": "empty", "too_long": "max_prompt_length",
              "unknown_source": "no reward function for data source", "bad_batch": "ppo_mini_batch_size",
              "rollout_tp": "tensor_model_parallel_size"}[case]
    bad = str(tmp_path / "bad.parquet")
    if case == "missing_column":
        pq.write_table(pa.table({"prompt": ["What is 1+1?"], "data_source": ["arithmetic"]}), bad)
    elif case == "empty_file":
        pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "data_source": pa.array([], pa.string()),
                                 "reward_model": pa.array([], pa.struct([("ground_truth", pa.string())]))}), bad)
    elif case == "unknown_source":
        _write_rows(bad, [{"data_source": "nope", "prompt": [{"role": "user", "content": "1+1?"}],
                           "reward_model": {"ground_truth": "2"}}] * 8)
    if case in ("missing_column", "empty_file", "unknown_source"):
        args.append(f"data.train_files={bad}")
    elif case == "too_long":
        args.append("data.max_prompt_length=4")
    elif case == "bad_batch":
        args.append("actor_rollout_ref.actor.ppo_mini_batch_size=3")
    elif case == "rollout_tp":
        args.append("actor_rollout_ref.rollout.tensor_model_parallel_size=3")
    start = time.time()
    proc = _train(args, timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert expect in proc.stdout, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout
    assert time.time() - start < 60  # refused before any model or process is started
