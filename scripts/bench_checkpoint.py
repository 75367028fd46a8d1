#!/usr/bin/env python
"""What a checkpoint costs a run, on this machine: peak memory per rank during saves against the peak during steps,
the step time with a save every step against none, the save's seconds and bytes.

Two workloads on SmolLM2-135M-Instruct (the demo's model, `scripts/demo.py --prepare-only` makes it), 2 ranks x 1 thread:
    grpo  GRPO, 4 prompts x 8 samples x 24 response tokens
    demo  the demo recipe (PPO with a GAE critic: two models saved)
each run three ways with the same seed and --steps steps:
    none        trainer.save_freq=-1 (the one end-of-run save comes after the last step's metrics)
    sync        a save every step, synchronous
    async       a save every step, trainer.async_save=true
A sampler polls every process of the run every 0.1 s: each rank's RSS (VmRSS) and, separately, the resident memory
of its child processes (their USS: pages they do not share with the rank). The peak during steps is the `none` run's
peak before its end-of-run save; the peak during saves is the saving runs' peak over the whole run.
Step time is the mean wall time per step (timing_s/step plus the save's blocking seconds, timing_s/checkpoint).

    flock /tmp/tripod-heavy.lock .venv/bin/python scripts/bench_checkpoint.py [--steps 5] [--workloads grpo,demo]
Record the table in bench/RESULTS.md with the machine and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(REPO, "outputs", "models", "smollm2-135m-instruct")
DATA = os.path.join(REPO, "outputs", "demo_data")
GiB = 2 ** 30

WORKLOADS = {
    "grpo": [os.path.join(REPO, "recipes", "defaults.yaml"), "algorithm.adv_estimator=grpo",
             "data.train_batch_size=4", "data.max_prompt_length=96", "actor_rollout_ref.rollout.n=8",
             "actor_rollout_ref.rollout.response_length=24", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.val_before_train=false"],
    "demo": [os.path.join(REPO, "recipes", "demo", "smollm2-135m-arithmetic.yaml"), "trainer.val_before_train=false"],
}
MODES = {"none": ["trainer.save_freq=-1"], "sync": ["trainer.save_freq=1"],
         "async": ["trainer.save_freq=1", "trainer.async_save=true"]}


class TreeSampler(threading.Thread):
    """Polls the launcher's process tree: its rank processes (the children `tripod train` spawns) and their
    descendants. Keeps the time series of (a save has begun, rank RSS list, children USS list)."""

    def __init__(self, root_pid: int, ckpt_root: str, period: float = 0.1):
        super().__init__(daemon=True)
        self.root, self.period, self.samples, self.stop = psutil.Process(root_pid), period, [], threading.Event()
        self.ckpt_root = ckpt_root

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                ranks = [p for p in self.root.children() if "spawn_main" in " ".join(p.cmdline())]
                ranks_rss, kids = [], []
                for r in ranks:
                    ranks_rss.append(r.memory_info().rss)
                    kids.append(sum(_uss(k) for k in r.children(recursive=True)))
                self.samples.append((os.path.isdir(self.ckpt_root), ranks_rss, kids))
            except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
                pass
            time.sleep(self.period)


def _uss(p: psutil.Process) -> int:
    try:
        return p.memory_full_info().uss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


def checkpoint_gb(root: str) -> float:
    """The mean size of the checkpoints under `root`."""
    dirs = [os.path.join(root, d) for d in os.listdir(root)]
    return sum(os.path.getsize(os.path.join(p, f)) for d in dirs for p, _, fs in os.walk(d) for f in fs) / len(dirs) / GiB


def run(workload: str, mode: str, root: str, steps: int) -> dict:
    run_dir = os.path.join(root, f"{workload}-{mode}")
    recipe, *overrides = WORKLOADS[workload]
    cmd = [sys.executable, "-m", "tripod", "train", recipe, f"actor_rollout_ref.model.path={MODEL}",
           f"data.train_files={DATA}/train.parquet", f"data.val_files={DATA}/test.parquet", *overrides,
           *MODES[mode], f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.n_gpus_per_node=2",
           "trainer.threads_per_rank=1", "trainer.logger=[jsonl]", "trainer.resume=disable", "trainer.seed=1",
           f"trainer.default_local_dir={run_dir}"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = TreeSampler(proc.pid, os.path.join(run_dir, "checkpoints"))
    sampler.start()
    out, _ = proc.communicate()
    sampler.stop.set()
    sampler.join()
    if proc.returncode != 0:
        sys.exit(f"{workload}/{mode} failed:\n{out[-4000:]}")
    size = checkpoint_gb(os.path.join(run_dir, "checkpoints"))
    shutil.rmtree(os.path.join(run_dir, "checkpoints"))  # a checkpoint every step: gigabytes
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"timing_s/step"' in line]
    saved = (lambda r: r.get("timing_s/checkpoint", 0.0)) if mode != "none" else (lambda r: 0.0)  # not the end's
    samples = sampler.samples if mode != "none" else [s for s in sampler.samples if not s[0]]  # before the end's save
    return {
        "workload": workload, "mode": mode, "wall_s": time.monotonic() - start,
        "step_s": sum(r["timing_s/step"] + saved(r) for r in rows) / len(rows),
        "save_block_s": sum(saved(r) for r in rows) / len(rows),
        "write_s": max((r.get("timing_s/checkpoint_write", 0.0) for r in rows), default=0.0),
        "ckpt_gb": size,
        "rank_peak_gb": max(max(s[1]) for s in samples if s[1]) / GiB,
        "children_peak_gb": max(max(s[2]) for s in samples if s[2]) / GiB,
        "children_seen": any(any(s[2]) for s in samples),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--workloads", default="grpo,demo")
    p.add_argument("--modes", default="none,sync,async")
    args = p.parse_args()
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "demo.py"), "--prepare-only"], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)
    root = tempfile.mkdtemp(prefix="tripod-bench-ckpt-")
    load = os.getloadavg()[0]
    try:
        results = [run(w, m, root, args.steps) for w in args.workloads.split(",") for m in args.modes.split(",")]
    finally:
        shutil.rmtree(root, ignore_errors=True)  # a checkpoint every step: gigabytes
    print(f"\n{os.uname().nodename}: {os.cpu_count()} cores, load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after; {args.steps} steps, 2 ranks x 1 thread")
    print("| workload | saves | step s (with save) | vs none | save blocks s | write s | checkpoint GB | "
          "peak RSS GB/rank | vs steps' peak | children's own GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        base = next((b for b in results if b["workload"] == r["workload"] and b["mode"] == "none"), r)
        print(f"| {r['workload']} | {r['mode']} | {r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f}x | "
              f"{r['save_block_s']:.2f} | {r['write_s']:.2f} | {r['ckpt_gb']:.2f} | {r['rank_peak_gb']:.2f} | "
              f"{r['rank_peak_gb'] / base['rank_peak_gb']:.2f}x | {r['children_peak_gb']:.2f} |")


if __name__ == "__main__":
    main()
