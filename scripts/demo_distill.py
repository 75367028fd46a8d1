#!/usr/bin/env python
"""`make demo-distill`: on-policy distillation on CPU: a teacher good at the demo's task distilled into the untrained
student, with verl's `distillation.*` keys.

1. The teacher: `make demo`'s PPO-trained SmolLM2-135M (outputs/demo's last checkpoint, exported to HF with
   `tripod export`); where that run is absent, `make demo` runs first (about 4 minutes).
2. The student: the untrained SmolLM2-135M-Instruct (`make demo`'s base model) on the same one-digit arithmetic.
3. `tripod train` with distillation.enabled: every step the student samples 4 answers per prompt, the frozen teacher
   (a megatron model on its own layout: here PP2, the student at DP2) scores them with its top-16 log-probs at every
   response position, and the student's loss is verl's forward_kl_topk alone (use_task_rewards=false: the task's
   reward is computed and logged, never trained on). No critic, no reference.
4. Greedy held-out reward (exact `#### N`, 64 problems none of which is in training) of the student before and
   after, and of the teacher (a validation-only run of the teacher's weights), printed with the wall time.

Extra `key=value` arguments go to the distillation run, e.g. `distillation.distillation_loss.loss_mode=k1
distillation.distillation_loss.use_policy_gradient=true`.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo import DATA_DIR, MODEL_DIR, RECIPE, REPO, run, write_data  # noqa: E402  (make demo's model and problems)

PPO_RUN = os.path.join(REPO, "outputs", "demo")
OUT = os.path.join(REPO, "outputs", "demo_distill")
TEACHER_DIR = os.path.join(OUT, "teacher_hf")

DISTILL = [
    "distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={TEACHER_DIR}",
    # the teacher on a layout of its own: 2 pipeline stages (SmolLM2's 9 heads rule out TP2), the student at DP2
    "distillation.teacher_models.teacher_model.megatron.pipeline_model_parallel_size=2",
    "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=16",
    "distillation.distillation_loss.use_task_rewards=false",
    "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",  # no critic, no reference: the teacher only
    "trainer.total_training_steps=8", "trainer.test_freq=4", "trainer.experiment_name=smollm2-135m-distill",
]


def last_checkpoint(run_dir: str) -> str | None:
    root = os.path.join(run_dir, "checkpoints")
    steps = [d for d in os.listdir(root) if d.startswith("global_step_")] if os.path.isdir(root) else []
    done = [d for d in steps if os.path.exists(os.path.join(root, d, "COMPLETE"))]
    return os.path.join(root, max(done, key=lambda d: int(d.split("_")[-1]))) if done else None


def make_teacher(py: str) -> None:
    """The PPO demo's trained actor as an HF directory (with the student's tokenizer files)."""
    if os.path.isfile(os.path.join(TEACHER_DIR, "config.json")):
        return
    ckpt = last_checkpoint(PPO_RUN)
    if ckpt is None:
        print(f"no finished `make demo` run in {PPO_RUN}: running it first for the teacher", flush=True)
        run([py, "scripts/demo.py"])
        ckpt = last_checkpoint(PPO_RUN)
        assert ckpt is not None, f"make demo left no checkpoint in {PPO_RUN}"
    run([py, "-m", "tripod", "export", os.path.join(ckpt, "actor"), TEACHER_DIR])
    for name in os.listdir(MODEL_DIR):  # the student's tokenizer, chat template and generation config
        src, dst = os.path.join(MODEL_DIR, name), os.path.join(TEACHER_DIR, name)
        if name != "config.json" and not name.endswith(".safetensors") and os.path.isfile(src) \
                and not os.path.exists(dst):
            shutil.copy(src, dst)


def val_rewards(run_dir: str) -> list[tuple[int, float]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [(m["step"], m["val/reward_mean"]) for m in map(json.loads, f) if "val/reward_mean" in m]


def metric_series(run_dir: str, key: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [m[key] for m in map(json.loads, f) if key in m]


def main(overrides: list[str]) -> int:
    start = time.time()
    py = sys.executable
    run([py, "scripts/prepare_smollm2.py", "--out", MODEL_DIR])
    write_data()
    make_teacher(py)
    common = [f"data.train_files={DATA_DIR}/train.parquet", f"data.val_files={DATA_DIR}/test.parquet",
              "trainer.logger=[console,jsonl]"]
    teacher_run = os.path.join(OUT, "teacher_eval")
    t0 = time.time()
    run([py, "-m", "tripod", "train", RECIPE, f"actor_rollout_ref.model.path={TEACHER_DIR}", *common,
         f"trainer.default_local_dir={teacher_run}", "trainer.val_only=true", "algorithm.adv_estimator=grpo",
         "algorithm.use_kl_in_reward=false"])
    teacher_s = time.time() - t0
    student_run = os.path.join(OUT, "student")
    t0 = time.time()
    run([py, "-m", "tripod", "train", RECIPE, f"actor_rollout_ref.model.path={MODEL_DIR}", *common,
         f"trainer.default_local_dir={student_run}", *DISTILL, *overrides])
    distill_s = time.time() - t0
    (_, teacher), = val_rewards(teacher_run)[-1:]
    val = val_rewards(student_run)
    (s0, before), (s1, after) = val[0], val[-1]
    losses = metric_series(student_run, "distillation/loss")
    print(f"\nheld-out reward (greedy, exact '#### N' match, {DATA_DIR}/test.parquet, 64 problems):")
    print(f"  teacher (make demo's PPO actor):       {teacher:.3f}")
    print(f"  student before distillation (step {s0}): {before:.3f}")
    for step, reward in val[1:-1]:
        print(f"  student at step {step}:                  {reward:.3f}")
    print(f"  student after distillation (step {s1}):  {after:.3f}   change {after - before:+.3f}")
    if losses:
        print(f"distillation/loss (forward KL over the teacher's top-16): step 1 {losses[0]:.3f} -> "
              f"step {len(losses)} {losses[-1]:.3f}")
    print(f"distillation run {distill_s:.0f} s, teacher evaluation {teacher_s:.0f} s, total {time.time() - start:.0f} s; "
          f"run directory: {student_run}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
