"""Mixed precision and the distributed optimizer (parallel/precision.py): bf16 against fp32, distributed against
non-distributed optimizer, and a distributed-optimizer checkpoint resumed at another layout.

The bf16 bounds. bf16 keeps 8 significant bits (7 stored + the implicit one), so one rounding to nearest has
relative error at most u = 2**-8 (fp32: 24 bits, 2**-24). Where the bf16 model rounds, on the path of one value,
in megatron's local spec on CPU with tripod's SDPA core attention (parallel/sdpa_attention.py): per layer 23 times --
the input RMSNorm (its output, its weight), the QKV GEMM (output, weight, bias add, bias), RoPE (cos/sin cast,
product, sum), SDPA (torch's CPU flash kernel keeps the scores and the softmax in fp32 and rounds twice: the
probabilities cast to bf16 for the product with V, and its output; megatron's own attention rounded three times:
scores, softmax, probs x V), the out-projection (output, weight), the residual add, the pre-MLP RMSNorm (2), fc1
(output, weight), SiLU, x up, fc2 (output, weight), the residual add -- plus the embedding, the final norm (2) and
the head (GEMM output, weight): K = 23*L + 5. After the two Adam updates (lr 1e-4) the runs have also taken different
steps: Adam moves every element by ~lr in its gradient's sign, and the signs differ where a gradient is within bf16
noise of 0. To first order that changes an output by at most the fp32 step's own change of it, |x1 - x0| (fp32 run),
which the bound adds for the after-update quantities (measured: without it one log-prob of 40 reached 5.2 sigma).
These roundings are independent, mean-zero and uniform within +-u, so their sum has standard deviation
sigma = sqrt(K/3) * u relative to the scale of what is rounded (RMS-normalised activations carry each one to the
output with gain ~1; the worst case, all K of one sign, is K * u, 7x more for L = 2). The bound is LAMBDA = 5 sigma:
a sum of ~60 such terms is Gaussian to within the tail used, P(|N| > 5) = 6e-7 per value, < 1e-4 per run of ~150.
The scale of a log-prob's error is its token's logits, not the log-prob: a log-prob is a bf16 logit minus an fp32
logsumexp of bf16 logits, |logp| ~ log(vocab) ~ 5 while the tiny model's logits are ~0.4 (the worker measures their
RMS per token with the fp32 HF model). Measured (L = 2, 40 response tokens): worst log-prob error 0.86 sigma
(median 0.42), values 0.48 sigma, with megatron's attention; 1.12 (median 0.32) and 0.55 with SDPA (2026-12-02).
The old bound, K*u*max|logp| with 13L+4 roundings (11.7% of |logp| ~ 6.2, 0.73), was ~20x this one (5 sigma x
logit RMS ~ 0.03) and passed the logits of the bf16 path scaled by 1.25 (max error 0.26), which this bound fails at
29 sigma. One extra bf16 rounding of the log-probs stays within it (worst 2.6
sigma, median 0.87): a single rounding is below what a bound on K roundings can resolve. Values are scaled by
max|value|; the losses and grad norms, relative, by 5 sigma.
The test also asserts that bf16 is really different from fp32 (so the bound is not trivially met by an fp32 run).
"""
import json
import os
import re

import pytest
import torch

from tests.helpers.common import make_tiny_hf_model, run_torchrun
from tests.helpers.ppo_setup import make_ppo_setup, tiny_overrides
from tests.helpers.trainer_runs import REL, env, metric_violations, train_in_worlds, train_together

U_BF16 = 2.0 ** -8
LAMBDA = 5.0


def _roundings(num_layers: int) -> int:
    """K: bf16 roundings on the path of one output value (module docstring)."""
    return 23 * num_layers + 5


def _bf16_sigma(num_layers: int) -> float:
    """Standard deviation of the sum of K independent roundings, each uniform within +-u, relative to the scale."""
    return (_roundings(num_layers) / 3) ** 0.5 * U_BF16


@pytest.mark.dist
def test_bf16_and_distributed_optimizer_against_fp32(tmp_path):
    layers = 2
    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", seed=5, num_hidden_layers=layers)
    out = run_torchrun("precision_worker.py", 2, hf_dir, timeout=600).stdout
    # each rank prints one JSON object; on a shared pipe one rank's line can be glued onto the other's
    found = [json.JSONDecoder().raw_decode(out, m.end())[0] for m in re.finditer(r"PREC rank=\d+ ", out)]
    assert len(found) == 2, out[-3000:]
    allocated = [{name: rank.pop("allocated") for name, rank in r.items() if isinstance(rank, dict)} for r in found]
    # activations are each rank's own: the LM head runs at its rows' real response tokens only
    saved = [{name: rank.pop("saved_bytes") for name, rank in r.items() if isinstance(rank, dict)} for r in found]
    runs = found[0]
    assert found[1] == runs  # both DP ranks see the same gathered results (each holds its own optimizer shard)
    fp32, distopt, bf16 = runs["fp32"], runs["fp32_distopt"], runs["bf16"]
    assert fp32["optimizer"] == "FP32Optimizer" and distopt["optimizer"] == "DistributedOptimizer"
    assert bf16["param_dtype"] == "torch.bfloat16" and bf16["main_dtype"] == "torch.float32"  # fp32 main weights
    for rank_allocated in allocated:
        _check_memory_plan_against_megatron(hf_dir, rank_allocated)

    # distributed optimizer == plain optimizer: same arithmetic, only the owner of each update differs
    for key in ("logp0", "logp1", "values0", "values1"):
        torch.testing.assert_close(torch.tensor(distopt[key]), torch.tensor(fp32[key]), rtol=1e-6, atol=1e-6)
    for key in ("pg_loss", "vf_loss", "actor_grad_norm", "critic_grad_norm"):
        assert distopt[key] == pytest.approx(fp32[key], rel=1e-6), key

    for key in ("logp0", "logp1", "values0", "values1"):
        a, b = torch.tensor(fp32[key]), torch.tensor(bf16[key])
        err = (a - b).abs()
        # after the updates: the two runs' Adam steps may differ by up to the fp32 step's own effect (docstring)
        step = (a - torch.tensor(fp32[key[:-1] + "0"])).abs() if key.endswith("1") else torch.zeros_like(a)
        if key.startswith("logp"):
            scale = torch.tensor(runs["logit_rms"])  # per token; 0 past each response's end, where logp is 0
        else:
            scale = torch.full_like(a, a.abs().max().item())
        live = scale > 0
        sigmas = (err - step).clamp(min=0)[live] / (_bf16_sigma(layers) * scale[live])
        print(f"BF16 {key} max|diff| {err.max().item():.4g} worst (|diff| - |fp32 step|)/sigma "
              f"{sigmas.max().item():.3g} (bound {LAMBDA:g}), median {sigmas.median().item():.3g}, scale mean "
              f"{scale[live].mean().item():.4g}, max|x| {a.abs().max().item():.4g}")
        assert err.max().item() > 0, key
        assert sigmas.max().item() <= LAMBDA, (key, sigmas.max().item())
    bound = LAMBDA * _bf16_sigma(layers)  # 8.1% for L = 2 (the old first-order 11.7%); measured <= 0.44%
    for key in ("pg_loss", "vf_loss", "actor_grad_norm", "critic_grad_norm"):
        print(f"BF16 {key} rel diff {abs(bf16[key] / fp32[key] - 1):.4g}")
        assert bf16[key] == pytest.approx(fp32[key], rel=bound), key

    # the memory plan's activations (parallel/memory_plan.py) against the bytes autograd really saved for one
    # micro-batch of 2 rows; the formula counts every saved tensor, so only tiny ones (RoPE tables shared between
    # layers, the pipeline's bookkeeping) differ: 5%. The plan's default counts the attention the model runs (SDPA's
    # fused kernel on CPU too: no [b, heads, s, s] probabilities). At these ~14 tokens the two attentions' plans
    # differ by only 3% (fp32) / 9% (bf16); tests/unit/test_sdpa_model.py tells them apart at 65 tokens.
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import activation_bytes

    arch = arch_from_hf(hf_dir)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        planned = activation_bytes(arch, 1, 1, 2, runs[name]["seq"], dtype)
        for rank_saved in saved:  # the plan is the upper bound: its head input is every token's hidden state, the
            # run's the rows of its real response tokens (fewer on a rank whose responses are shorter)
            assert rank_saved[name] <= planned <= 1.06 * rank_saved[name], (str(dtype), planned, rank_saved[name])


def _check_memory_plan_against_megatron(hf_dir, allocated) -> None:
    """The memory plan's params / grads / main_params / optim rows for the actor (TP1 x DP2) against the bytes megatron
    allocated (tests/multiprocess/workers/precision_worker.py allocated_bytes). Exact, except for the padding megatron
    adds with the distributed optimizer: each tensor starts at a multiple of 64 elements and each bucket ends at a
    multiple of lcm(DP, 128) elements, so the grad buffer holds at most 64 * tensors + 128 * buckets elements more
    than the parameters, and a DP shard of it (which the optimizer's state follows) differs from numel / DP by at most
    that padding."""
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import ModelMemory

    arch = arch_from_hf(hf_dir)
    for name, dtype, dist_opt in (("fp32", torch.float32, False), ("fp32_distopt", torch.float32, True),
                                  ("bf16", torch.bfloat16, True)):
        real = allocated[name]
        plan = ModelMemory("actor", 1, 1, 2, dtype, True, dist_opt).compute(arch)
        print(f"MEMORY {name} plan {plan.rows} allocated {real}")
        assert real["params"] == plan.rows["params"], (name, real, plan.rows)
        pad = (64 * real["tensors"] + 128 * real["buckets"]) if dist_opt else 0
        assert 0 <= real["grads"] - plan.rows["grads"] <= 4 * pad, (name, "grads", real, plan.rows)
        measured_pad = real["grads"] // 4 - plan.numel  # elements of padding in this rank's grad buffer
        for row, per_elem in (("main_params", 4 if dtype != torch.float32 else 0), ("optim", 8)):
            assert abs(real[row] - plan.rows[row]) <= per_elem * measured_pad, (name, row, real, plan.rows)


# ---- trainer runs: the distributed optimizer across layouts, and resuming its checkpoint at another layout -----
COMPARED = ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm", "critic/score/mean",
            "response_length/mean")
GREEDY = ["actor_rollout_ref.rollout.do_sample=false", "actor_rollout_ref.rollout.n=1",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.response_length=6",
          "trainer.val_before_train=false"]


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {m["step"]: m for m in map(json.loads, f)}


RECOMPUTE = ["actor_rollout_ref.actor.megatron.recompute_granularity=full",  # same math, less memory
             "critic.megatron.recompute_granularity=selective"]
DIST_OPT = ["actor_rollout_ref.actor.megatron.use_distributed_optimizer=true",
            "critic.megatron.use_distributed_optimizer=true"]


def _dp2_args(tmp_path, setup, extra=()):
    """(TP1,PP1,DP2) with the distributed optimizer (auto at DP=2) and activation recomputation, a checkpoint after
    every step (run it under the device guard: `_DEVICE_ENV`, checked by `_check_device_guard`)."""
    return tiny_overrides(setup, str(tmp_path / "dp2"), world=2, steps=2) + GREEDY + RECOMPUTE + DIST_OPT + \
        list(extra) + ["trainer.save_freq=1"]


_DEVICE_ENV = {"TRIPOD_CHECK_DEVICES": "1"}


def _check_device_guard(log_dir) -> None:
    with open(os.path.join(log_dir, "dp2.log")) as f:
        out = f.read()
    assert out.count("DEVICE_CHECK") == 2 and "ops_off_device=0" in out, out[-2000:]  # every step, rank 0


@pytest.mark.dist
def test_distributed_optimizer_equals_plain_optimizer_across_layouts(tmp_path):
    """(1,1,1) with the plain optimizer vs (TP1,PP1,DP2) with the distributed optimizer and recomputation (the two
    runs side by side: one thread per rank, so neither's arithmetic depends on the other)."""
    setup = make_ppo_setup(tmp_path)
    base_dir = str(tmp_path / "base")
    # Adam with eps=1 (>> sqrt(v) here) makes each update ~lr * momentum, linear in the gradient, so the rounding-level
    # gradient differences of the two layouts stay rounding-level in the weights (plain Adam would blow a 1e-9
    # difference of a near-zero gradient up to an lr-sized step); metrics then agree within trainer_runs' bound
    linear_adam = ["actor_rollout_ref.actor.optim.eps=1.0", "critic.optim.eps=1.0"]
    train_together({"base": tiny_overrides(setup, base_dir, world=1, steps=2) + GREEDY + linear_adam,
                    "dp2": _dp2_args(tmp_path, setup, linear_adam)}, str(tmp_path),
                   run_envs={"dp2": env(**_DEVICE_ENV)})
    _check_device_guard(tmp_path)
    base, dp2 = _metrics(base_dir), _metrics(str(tmp_path / "dp2"))
    rows = lambda runs: [runs[s] for s in sorted(runs)]  # noqa: E731  (step -> metrics) as logged
    violations = metric_violations(rows(base), rows(dp2))
    assert not violations, violations
    for m in dp2.values():  # each rank's own peak, gathered (a rank that logged nothing would read 0)
        peaks = [m[f"perf/peak_memory_gb/rank{r}"] for r in range(2)]
        assert all(p > 0.1 for p in peaks) and m["perf/peak_memory_gb/max"] == max(peaks), m


def _resume_args(setup, run_dir, ckpt, tp):
    """Resume `ckpt` for its step 2 at TP`tp` x DP`2/tp` with the distributed optimizer (and the DP2 run's
    recomputation)."""
    return tiny_overrides(setup, str(run_dir), world=2, tp=tp, steps=2) + GREEDY + RECOMPUTE + DIST_OPT + \
        [f"trainer.resume={ckpt}"]


def _weights(run_dir, step, tmp_path):
    """Every tensor of a run's actor and critic checkpoint at `step` (megatron dist checkpoints: whole tensors at any
    layout), read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = {}
    for model in ("actor", "critic"):
        dst = str(tmp_path / f"{os.path.basename(str(run_dir))}_{step}_{model}.pt")
        dcp_to_torch_save(os.path.join(str(run_dir), "checkpoints", f"global_step_{step}", model, "model"), dst)
        out.update({f"{model}/{k}": v for k, v in torch.load(dst, weights_only=False).items()
                    if isinstance(v, torch.Tensor)})
    return out


def _real_rows(*tensors):
    """The tensors cut to their common leading block: a checkpoint saved at TP2 pads the vocabulary rows (embedding,
    output layer) to a multiple of 128 * TP, and those padding rows are not part of the model."""
    shape = [min(sizes) for sizes in zip(*(t.shape for t in tensors))]
    return [t[tuple(slice(0, k) for k in shape)] for t in tensors]


def _update_differences(w1, base, got):
    """Per model: ||U_got - U_base|| / ||U_base|| over all its tensors, U = w_2 - w_1 (step 2's update)."""
    out = {}
    for model in ("actor", "critic"):
        diff = update = 0.0
        for n in (n for n in base if n.startswith(model + "/") and base[n].is_floating_point()):
            a, b, c = (t.double() for t in _real_rows(w1[n], base[n], got[n]))
            diff += float((c - b).norm()) ** 2
            update += float((b - a).norm()) ** 2
        out[model] = (diff / update) ** 0.5
    return out


# Step 2's weight update at TP2 x DP1 against DP2's, relative: trainer_runs' layout bound REL (1.22e-3, fp32
# reductions of another order). Adam divides by sqrt(v), so a rounding-level gradient difference moves the update by
# about REL relative where v holds real gradients. Measured 2026-12-01: 4.5e-6 (actor) and 7.4e-7 (critic); with
# exp_avg_sq zeroed on load (the plant) 12,643 and 6,073.
UPDATE_REL = REL


@pytest.mark.dist
def test_distributed_optimizer_checkpoint_resumes_at_another_layout(tmp_path):
    """The DP2 run's step-1 checkpoint (distributed optimizer, megatron's fully_reshardable state) resumed for step 2:
    at the same layout bit for bit the uninterrupted step 2 (a load is a copy, the reductions run in the same order);
    at TP2 x DP1 within trainer_runs' layout bound. The bound holds with plain Adam here: step 2's first mini-batch
    depends on the loaded weights only (REL), and the one Adam update before its second mini-batch can be amplified
    only on elements whose gradient is at rounding level, which move the metrics by about |g| * lr, far below REL.
    Step 2's weight update is compared too (same layout: bit for bit; TP2: within UPDATE_REL). Planted bugs (the
    shared Adam step megatron's loader leaves behind, Adam's exp_avg_sq zeroed on load; both in
    tests/multiprocess/workers/train_with_hooks.py) break these bounds. The four resumes are independent: they run
    one after another in one 2-rank torchrun world (trainer_runs.train_in_worlds; the planted ones last)."""
    setup = make_ppo_setup(tmp_path)
    train_together({"dp2": _dp2_args(tmp_path, setup)}, str(tmp_path), run_envs={"dp2": env(**_DEVICE_ENV)})
    _check_device_guard(tmp_path)
    dp_dir = str(tmp_path / "dp2")
    ckpt = os.path.join(dp_dir, "checkpoints", "global_step_1")
    dp2 = _metrics(dp_dir)
    w1, w2 = _weights(dp_dir, 1, tmp_path), _weights(dp_dir, 2, tmp_path)
    resumes = {name: (tp, None) for name, tp in (("dp2_resumed", 1), ("tp2_resumed", 2))}
    resumes |= {"tp2_planted": (2, "adam_step_shared"), "tp2_no_exp_avg_sq": (2, "adam_exp_avg_sq_on_load")}
    train_in_worlds({name: (2, _resume_args(setup, tmp_path / name, ckpt, tp), plant)
                     for name, (tp, plant) in resumes.items()}, str(tmp_path))
    same, tp2, planted = (_metrics(str(tmp_path / n)) for n in ("dp2_resumed", "tp2_resumed", "tp2_planted"))
    assert sorted(same) == [2], sorted(same)  # started at the saved step, did not redo step 1
    assert {k: same[2][k] for k in COMPARED} == {k: dp2[2][k] for k in COMPARED}
    same_w = _weights(tmp_path / "dp2_resumed", 2, tmp_path)
    assert same_w.keys() == w2.keys() and all(torch.equal(same_w[n], w2[n]) for n in w2)  # bit for bit
    violations = metric_violations([dp2[2]], [tp2[2]])
    assert not violations, violations
    moved = _update_differences(w1, w2, _weights(tmp_path / "tp2_resumed", 2, tmp_path))
    print(f"resume at TP2: step-2 update differs from DP2's by {moved} (relative)")
    assert all(v <= UPDATE_REL for v in moved.values()), moved
    assert metric_violations([dp2[2]], [planted[2]]), "the check missed a shared Adam step"
    lost = _update_differences(w1, w2, _weights(tmp_path / "tp2_no_exp_avg_sq", 2, tmp_path))
    print(f"resume at TP2 with exp_avg_sq zeroed on load: step-2 update differs by {lost} (relative)")
    assert any(v > UPDATE_REL for v in lost.values()), f"the check missed Adam's exp_avg_sq lost on load: {lost}"
