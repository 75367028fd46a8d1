"""Mixed precision and the distributed optimizer (engine/precision.py): bf16 against fp32, distributed against
non-distributed optimizer, and a distributed-optimizer checkpoint resumed at another layout.

The bf16 bound. bf16 keeps 8 significant bits, so each rounding has relative error at most u = 2**-8. A forward pass
of an L-layer model rounds each value at most K = 13*L + 4 times on its path (per layer: input norm, Q, K, V,
attention probabilities, attention output, output projection, residual add, second norm, gate, up, SiLU*up, down
projection; plus the embedding, final norm and the two halves of the head). To first order these errors add, so a
bf16 output x' of an fp32 output x obeys |x' - x| <= K * u * max|x|. After the updates the same bound applies: the
weights are fp32 main weights rounded once more to bf16 (already counted), and with lr = 1e-4 the Adam steps,
whose direction can differ for near-zero gradients, move an output by far less than K*u*max|x| (0.12 relative).
The test also asserts that bf16 is really different from fp32 (so the bound is not trivially met by an fp32 run).
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers.common import DIST_DIR, REPO_ROOT, make_tiny_hf_model, run_torchrun
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import metric_violations

U_BF16 = 2.0 ** -8


def _bf16_bound(num_layers: int) -> float:
    return (13 * num_layers + 4) * U_BF16


@pytest.mark.dist
def test_bf16_and_distributed_optimizer_against_fp32(tmp_path):
    layers = 2
    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", seed=5, num_hidden_layers=layers)
    out = run_torchrun("precision_worker.py", 2, hf_dir, timeout=600).stdout
    # each rank prints one JSON object; on a shared pipe one rank's line can be glued onto the other's
    found = [json.JSONDecoder().raw_decode(out, m.end())[0] for m in re.finditer(r"PREC rank=\d+ ", out)]
    assert len(found) == 2, out[-3000:]
    runs = found[0]
    assert found[1] == runs  # both DP ranks see the same gathered results
    fp32, distopt, bf16 = runs["fp32"], runs["fp32_distopt"], runs["bf16"]
    assert fp32["optimizer"] == "FP32Optimizer" and distopt["optimizer"] == "DistributedOptimizer"
    assert bf16["param_dtype"] == "torch.bfloat16" and bf16["main_dtype"] == "torch.float32"  # fp32 main weights

    # distributed optimizer == plain optimizer: same arithmetic, only the owner of each update differs
    for key in ("logp0", "logp1", "values0", "values1"):
        torch.testing.assert_close(torch.tensor(distopt[key]), torch.tensor(fp32[key]), rtol=1e-6, atol=1e-6)
    for key in ("pg_loss", "vf_loss", "actor_grad_norm", "critic_grad_norm"):
        assert distopt[key] == pytest.approx(fp32[key], rel=1e-6), key

    bound = _bf16_bound(layers)
    for key in ("logp0", "logp1", "values0", "values1"):
        a, b = torch.tensor(fp32[key]), torch.tensor(bf16[key])
        diff = (a - b).abs().max().item()
        assert 0 < diff <= bound * a.abs().max().item(), (key, diff, bound * a.abs().max().item())
    for key in ("pg_loss", "vf_loss", "actor_grad_norm", "critic_grad_norm"):
        assert bf16[key] == pytest.approx(fp32[key], rel=bound), key

    # the memory plan's activations (parallel/memory_plan.py) against the bytes autograd really saved for one
    # micro-batch of 2 rows; the formula counts every saved tensor, so only tiny ones (RoPE tables shared between
    # layers, the pipeline's bookkeeping) differ: 5%
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import activation_bytes

    arch = arch_from_hf(hf_dir)
    for run, dtype in ((fp32, torch.float32), (bf16, torch.bfloat16)):
        planned = activation_bytes(arch, 1, 1, 2, run["seq"], dtype)
        assert planned == pytest.approx(run["saved_bytes"], rel=0.05), (str(dtype), planned, run["saved_bytes"])


# ---- trainer runs: the distributed optimizer across layouts, and resuming its checkpoint at another layout -----
COMPARED = ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm", "critic/score/mean",
            "response_length/mean")
GREEDY = ["actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.n=1",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.response_length=6",
          "trainer.val_before_train=false"]


def _train(args, env=None, timeout=900, hooks=False):
    run_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **(env or {}))
    run_env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), run_env.get("PYTHONPATH", "")])
    cli = [str(DIST_DIR / "train_with_hooks.py")] if hooks else ["-m", "tripod"]
    proc = subprocess.run([sys.executable, *cli, "train", "recipes/defaults.yaml", *args], cwd=REPO_ROOT,
                          env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-5000:]
    return proc.stdout


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {m["step"]: m for m in map(json.loads, f)}


def _dp2_run(tmp_path, setup, extra=()):
    """(TP1,PP1,DP2) with the distributed optimizer (auto at DP=2) and activation recomputation, a checkpoint after
    every step, run under the device guard."""
    dp_dir = str(tmp_path / "dp2")
    recompute = ["actor_rollout_ref.actor.megatron.recompute_granularity=full",  # same math, less memory
                 "critic.megatron.recompute_granularity=selective"]
    dist_opt = ["actor_rollout_ref.actor.megatron.use_distributed_optimizer=true",
                "critic.megatron.use_distributed_optimizer=true"]
    out = _train(tiny_overrides(setup, dp_dir, world=2, steps=2) + GREEDY + recompute + dist_opt + list(extra)
                 + ["trainer.save_freq=1"],
                 env={"TRIPOD_CHECK_DEVICES": "1"})
    assert out.count("DEVICE_CHECK") == 2 and "ops_off_device=0" in out, out[-2000:]  # every step, rank 0
    return dp_dir


@pytest.mark.dist
def test_distributed_optimizer_equals_plain_optimizer_across_layouts(tmp_path):
    """(1,1,1) with the plain optimizer vs (TP1,PP1,DP2) with the distributed optimizer and recomputation."""
    setup = make_ppo_setup(tmp_path)
    base_dir = str(tmp_path / "base")
    # Adam with eps=1 (>> sqrt(v) here) makes each update ~lr * momentum, linear in the gradient, so the rounding-level
    # gradient differences of the two layouts stay rounding-level in the weights (plain Adam would blow a 1e-9
    # difference of a near-zero gradient up to an lr-sized step); metrics then agree within trainer_runs' bound
    linear_adam = ["actor_rollout_ref.actor.optim.eps=1.0", "critic.optim.eps=1.0"]
    _train(tiny_overrides(setup, base_dir, world=1, steps=2) + GREEDY + linear_adam)
    base, dp2 = _metrics(base_dir), _metrics(_dp2_run(tmp_path, setup, linear_adam))
    rows = lambda runs: [runs[s] for s in sorted(runs)]  # noqa: E731  (step -> metrics) as logged
    violations = metric_violations(rows(base), rows(dp2))
    assert not violations, violations


def _resume(setup, run_dir, ckpt, tp, plant=None):
    """Resume `ckpt` for its step 2 at TP`tp` x DP`2/tp` with the distributed optimizer (and the DP2 run's
    recomputation), optionally with a planted bug (tests/multiprocess/workers/train_with_hooks.py); returns the metrics by step."""
    same = ["actor_rollout_ref.actor.megatron.recompute_granularity=full",
            "critic.megatron.recompute_granularity=selective",
            "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true",
            "critic.megatron.use_distributed_optimizer=true"]
    _train(tiny_overrides(setup, str(run_dir), world=2, tp=tp, steps=2) + GREEDY + same + [f"trainer.resume={ckpt}"],
           env={"TRIPOD_TEST_PLANT": plant} if plant else None, hooks=plant is not None)
    return _metrics(str(run_dir))


@pytest.mark.dist
def test_distributed_optimizer_checkpoint_resumes_at_another_layout(tmp_path):
    """The DP2 run's step-1 checkpoint (distributed optimizer, megatron's fully_reshardable state) resumed for step 2:
    at the same layout bit for bit the uninterrupted step 2 (a load is a copy, the reductions run in the same order);
    at TP2 x DP1 within trainer_runs' layout bound. The bound holds with plain Adam here: step 2's first mini-batch
    depends on the loaded weights only (REL), and the one Adam update before its second mini-batch can be amplified
    only on elements whose gradient is at rounding level, which move the metrics by about |g| * lr, far below REL.
    A planted bug (the shared Adam step megatron's loader leaves behind) breaks that bound."""
    setup = make_ppo_setup(tmp_path)
    dp_dir = _dp2_run(tmp_path, setup)
    ckpt = os.path.join(dp_dir, "checkpoints", "global_step_1")
    dp2 = _metrics(dp_dir)
    same = _resume(setup, tmp_path / "dp2_resumed", ckpt, tp=1)
    assert sorted(same) == [2], sorted(same)  # started at the saved step, did not redo step 1
    assert {k: same[2][k] for k in COMPARED} == {k: dp2[2][k] for k in COMPARED}
    tp2 = _resume(setup, tmp_path / "tp2_resumed", ckpt, tp=2)
    violations = metric_violations([dp2[2]], [tp2[2]])
    assert not violations, violations
    planted = _resume(setup, tmp_path / "tp2_planted", ckpt, tp=2, plant="adam_step_shared")
    assert metric_violations([dp2[2]], [planted[2]]), "the check missed a shared Adam step"
