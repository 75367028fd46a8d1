"""The two PPO steps.

ppo_guarded  `tripod train` for 2 bf16 PPO steps (GAE critic, KL reference) of a small Qwen2-shaped model under
             TRIPOD_CHECK_DEVICES=1: every step fails on an op off the device; each step prints its DEVICE_CHECK line.
ppo          GRPO at a real size, unguarded: a Qwen2.5-0.5B-shaped model (recipes/model_configs) with random bf16
             weights made here, 64 responses of up to 1024 tokens (a random model answers to the full length),
             2 steps through `PPOTrainer.train_step` as `tripod train` runs it (the second is the measured one),
             then one checkpoint; next to `tripod plan`'s memory prediction for the same config.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from gpu_check_steps import REPO, Context, child_env

GUARDED_STEPS = 2
REAL_MODEL = os.path.join(REPO, "recipes", "model_configs", "Qwen--Qwen2.5-0.5B-Instruct.json")


def run_guarded(ctx: Context) -> dict:
    from tripod.engine.data.tiny_ppo import make_ppo_setup, tiny_overrides
    size = {} if ctx.dry else dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    work = os.path.join(ctx.work, "guarded")
    setup = make_ppo_setup(work, data_suffix=".jsonl", **size)  # JSON lines: no pyarrow needed
    run_dir = os.path.join(work, "run")
    args = tiny_overrides(setup, run_dir, steps=GUARDED_STEPS) + [
        f"trainer.device={ctx.device}", "trainer.val_before_train=false", "data.val_files=[]",
        "actor_rollout_ref.actor.megatron.param_dtype=bf16", "trainer.logger=[jsonl]", "trainer.save_freq=-1"]
    proc = subprocess.run([sys.executable, "-m", "tripod", "train", "recipes/defaults.yaml", *args], cwd=REPO,
                          env=child_env({"TRIPOD_CHECK_DEVICES": "1"}), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError("tripod train failed:\n" + proc.stdout[-4000:])
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    checks = [ln for ln in proc.stdout.splitlines() if ln.startswith("DEVICE_CHECK")]
    off = sum(int(ln.rsplit("ops_off_device=", 1)[1].split()[0]) for ln in checks)
    if len(checks) != GUARDED_STEPS or off:
        raise RuntimeError(f"expected {GUARDED_STEPS} device-checked steps with 0 ops off the device, saw {checks}")
    keys = ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "timing_s/step")
    return {"steps": GUARDED_STEPS, "device_checked_steps": len(checks), "ops_off_device": off,
            "per_step": [{k: m.get(k) for k in keys} for m in metrics if m.get("step", 0) > 0]}


def summary_guarded(r: dict) -> str:
    return f"{r['device_checked_steps']} steps device-checked, ops off device = {r['ops_off_device']}"


def make_real_model(ctx: Context) -> tuple[str, str]:
    """A random bf16 Qwen2.5-0.5B-shaped checkpoint (dry run: 2 layers, hidden 64) with tripod's character
    tokenizer; the prompts as JSON lines. Returns (model dir, prompts file)."""
    import torch
    import transformers

    from tripod.engine.data import make_arithmetic_rows, write_prompt_parquet
    from tripod.engine.data.char_tokenizer import char_tokenizer

    with open(REAL_MODEL) as f:
        cfg = {k: v for k, v in json.load(f).items() if not k.startswith("_") and k != "architectures"}
    if ctx.dry:
        cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)
    cfg.update(max_position_embeddings=2048, use_sliding_window=False)
    out = os.path.join(ctx.work, "real", "model")
    with torch.device(ctx.device):  # initialised where it is fast; saved in bf16
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg)).to(torch.bfloat16)
    model.save_pretrained(out)
    char_tokenizer().save_pretrained(out)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # this process keeps only its context while the trainer's rank runs
    rows = make_arithmetic_rows(64, seed=0, max_digits=2, instruction="Answer as #### N.", split="train")
    data = os.path.join(ctx.work, "real", "train.jsonl")
    write_prompt_parquet(rows, data)
    return out, data


def real_overrides(ctx: Context, model: str, data: str) -> list[str]:
    prompts, n, response = (2, 4, 16) if ctx.dry else (8, 8, 1024)
    return [f"data.train_files={data}", "data.val_files=[]", "data.max_prompt_length=64",
            f"data.max_response_length={response}", f"data.train_batch_size={prompts}", "data.shuffle=false",
            f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.n={n}",
            "actor_rollout_ref.rollout.temperature=1.0", f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={n}", "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.megatron.param_dtype=bf16", "algorithm.adv_estimator=grpo",
            "algorithm.use_kl_in_reward=false", "trainer.total_training_steps=2", "trainer.n_gpus_per_node=1",
            f"trainer.device={ctx.device}", f"trainer.default_local_dir={os.path.join(ctx.work, 'real', 'run')}",
            "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.test_freq=-1",
            "trainer.logger=[]", "trainer.resume=disable"]


def plan_prediction(ctx: Context, model: str, overrides: list[str]) -> dict:
    """`tripod plan`'s numbers for this run: the memory plan's peak device bytes over the step's phases (CUDA) or
    the process's host peak (CPU), parallel/memory_plan.py + parallel/memory_phases.py."""
    from tripod.engine.config import load_config
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_phases import phase_memory
    from tripod.parallel.memory_plan import plan_from_config
    from tripod.runtime.offload import flags_of

    cfg = load_config(os.path.join(REPO, "recipes", "defaults.yaml"), overrides)
    plan = plan_from_config(cfg, 1, arch_from_hf(model), gpu_memory_gb=None if ctx.dry else 139.0)
    arc = cfg.actor_rollout_ref
    offload = {"actor": flags_of(arc.actor.megatron, True),
               "reference": flags_of(arc.ref.megatron, False, arc.ref.offload)}
    phases = phase_memory(plan, offload)
    peak = max(phases, key=lambda p: p.device)
    return {"plan_peak_gb": (peak.device if not ctx.dry else plan.host_peak()) / 2 ** 30,
            "plan_peak_phase": peak.phase if not ctx.dry else "host peak (CPU)",
            "plan_device_total_gb": plan.device_total() / 2 ** 30}


def run_real(ctx: Context) -> dict:
    from gpu_check_steps.ppo_rank import run_steps
    from tripod.engine.config import config_to_yaml
    from tripod.engine.launch import detect_launch, run_distributed
    from tripod.engine.preflight import prepare_train

    t0 = time.perf_counter()
    model, data = make_real_model(ctx)
    make_s = time.perf_counter() - t0
    overrides = real_overrides(ctx, model, data)
    cfg, _ = prepare_train(os.path.join(REPO, "recipes", "defaults.yaml"), overrides, detect_launch())  # its checks
    raw = os.path.join(ctx.work, "real", "steps.json")
    run_distributed(1, run_steps, config_to_yaml(cfg), raw)
    with open(raw) as f:
        r = json.load(f)
    last = r["steps"][-1]
    rows = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    response_tokens = last["response_length/mean"] * rows
    measured = ctx.earlier("roofline").get("matmul_TFLOPs")
    mfu = last.get("perf/mfu/actor")
    out = {"model": "Qwen2.5-0.5B-shaped" if not ctx.dry else "tiny Qwen2 (dry run)", "params": r["params"],
           "responses": rows, "response_tokens_mean": last["response_length/mean"], "make_model_s": make_s,
           "setup_s": r["setup_s"], "step_s": [s["timing_s/step"] for s in r["steps"]],
           "stages_s": {k[len("timing_s/"):]: v for k, v in last.items() if k.startswith("timing_s/")},
           "decode_tokens_per_s": response_tokens / last["timing_s/gen"],
           "throughput_tokens_per_s": last["perf/throughput"], "mfu_actor_spec": mfu,
           "spec_peak_TFLOPs": r["peak_flops"] / 1e12, "measured_peak_TFLOPs": measured,
           "mfu_actor_measured": mfu * r["peak_flops"] / (measured * 1e12) if mfu is not None and measured else None,
           "max_allocated_gb": r["max_allocated_gb"], "max_reserved_gb": r["max_reserved_gb"],
           "checkpoint_s": r["checkpoint"]["total_s"], "checkpoint_gb": r["checkpoint"]["gb"]}
    out.update(plan_prediction(ctx, model, overrides))
    return out


def summary_real(r: dict) -> str:
    st = " ".join(f"{k}={v:.1f}" for k, v in r["stages_s"].items() if k != "step")
    mm = f"{r['mfu_actor_measured']:.1%}" if r["mfu_actor_measured"] is not None else "n/a"
    return (f"{r['responses']} x {r['response_tokens_mean']:.0f} tok, step {r['stages_s'].get('step', 0):.1f} s "
            f"({st}); decode {r['decode_tokens_per_s']:.0f} tok/s, throughput {r['throughput_tokens_per_s']:.0f} "
            f"tok/s, MFU actor {r['mfu_actor_spec']:.1%} of spec / {mm} of measured; mem alloc "
            f"{r['max_allocated_gb']:.1f} reserved {r['max_reserved_gb']:.1f} vs plan {r['plan_peak_gb']:.1f} GiB "
            f"({r['plan_peak_phase']}); checkpoint {r['checkpoint_s']:.1f} s {r['checkpoint_gb']:.2f} GiB")
