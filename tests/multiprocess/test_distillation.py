"""On-policy distillation on gloo worlds (issue 48).

* The teacher's scores do not depend on its layout: a teacher bigger than the student at TP2 gives the same
  log-probs and top-k (values and ids) as at TP1, both equal to its HF float64 forward, and the TP1 student's
  top-k KL against either is the same (tests/multiprocess/workers/teacher_layout_check.py); a planted bug (top-k
  ids left in a TP rank's local vocab coordinates) fails it.
* `tripod train` with distillation.enabled: a 2-rank run (student at TP1 x DP2, a bigger teacher at TP2) logs
  verl's distillation/* metrics for the top-k loss; a teacher with another tokenizer is refused in one line naming
  its key, before any model is built.
"""
import json
import os
import re

import pytest

from tests.helpers.common import make_tiny_hf_model, run_torchrun
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import train

TEACHER_SIZE = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2)


def _teacher_like(setup, tmp_path, name="teacher", tokenizer=True):
    """A teacher of another size than the setup's student, with the student's tokenizer files (or none)."""
    from transformers import AutoTokenizer

    path = make_tiny_hf_model(tmp_path, "qwen2", seed=9, subdir=name, max_position_embeddings=256, vocab_size=128,
                              **TEACHER_SIZE)
    if tokenizer:
        AutoTokenizer.from_pretrained(setup["model"]).save_pretrained(path)
    return path


@pytest.mark.dist
def test_teacher_scores_are_the_same_at_tp2_and_tp1(tmp_path):
    teacher = make_tiny_hf_model(tmp_path, "qwen2", seed=3, subdir="teacher", vocab_size=96, **TEACHER_SIZE)
    student = make_tiny_hf_model(tmp_path, "qwen2", seed=4, subdir="student", vocab_size=96, num_hidden_layers=1)
    out = run_torchrun("teacher_layout_check.py", 2, teacher, student, timeout=600).stdout
    seen = set(re.findall(r"TEACHER (\S+ \S+)", out))
    assert {"TP1 logp", "TP2 logp", "TP1 topk_ids", "TP2 topk_ids", "TP2 topk_logp", "student_kl TP1-vs-TP2"} <= seen, \
        out[-3000:]


@pytest.mark.dist
def test_teacher_layout_check_fails_on_local_topk_ids(tmp_path):
    teacher = make_tiny_hf_model(tmp_path, "qwen2", seed=3, subdir="teacher", vocab_size=96, **TEACHER_SIZE)
    student = make_tiny_hf_model(tmp_path, "qwen2", seed=4, subdir="student", vocab_size=96, num_hidden_layers=1)
    with pytest.raises(AssertionError) as failed:
        run_torchrun("teacher_layout_check.py", 2, teacher, student, timeout=600, env={"PLANT": "local_ids"})
    assert "teacher at TP2: topk" in str(failed.value) and "teacher at TP1" not in str(failed.value), \
        str(failed.value)[-2000:]


def _distill_args(setup, teacher, run_dir, *extra):
    args = tiny_overrides(setup, run_dir, world=2)
    args = [a for a in args if not a.startswith(("algorithm.adv_estimator", "algorithm.use_kl_in_reward"))]
    return args + ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
                   "distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={teacher}",
                   "distillation.teacher_models.teacher_model.megatron.tensor_model_parallel_size=2", *extra]


@pytest.mark.dist
def test_train_with_a_top_k_teacher_logs_verls_metrics(tmp_path):
    setup = make_ppo_setup(tmp_path)
    teacher = _teacher_like(setup, tmp_path)
    run_dir = str(tmp_path / "run")
    proc = train(_distill_args(setup, teacher, run_dir, "distillation.distillation_loss.loss_mode=forward_kl_topk",
                               "distillation.distillation_loss.topk=8",
                               "distillation.distillation_loss.use_task_rewards=false"))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "distillation: teacher teacher_model" in proc.stdout and "TP2" in proc.stdout, proc.stdout[-2000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if "distillation/loss" in m]
    assert len(steps) == 2, steps
    for m in steps:
        assert 0 <= m["distillation/loss_min"] <= m["distillation/loss_max"], m
        assert 0 < m["distillation/loss"] <= m["distillation/loss_max"] + 1e-6, m
        assert 0 < m["distillation/overlap_ratio"] <= 1 and 0 < m["distillation/teacher_mass"] <= 1 + 1e-5, m
        assert m["timing_s/teacher"] > 0


@pytest.mark.dist
def test_a_teacher_with_another_tokenizer_is_refused_by_key(tmp_path):
    from tripod.engine.data.char_tokenizer import char_tokenizer

    setup = make_ppo_setup(tmp_path)
    teacher = _teacher_like(setup, tmp_path, tokenizer=False)
    char_tokenizer(extra_chars=["é"]).save_pretrained(teacher)  # one more token: another vocabulary
    proc = train(_distill_args(setup, teacher, str(tmp_path / "run")))
    assert proc.returncode != 0
    lines = [x for x in proc.stdout.splitlines() if "its tokenizer differs" in x]
    assert lines and "distillation.teacher_models.teacher_model.model_path=" in lines[0], proc.stdout[-2000:]
    assert "building" not in proc.stdout.lower()
