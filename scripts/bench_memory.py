#!/usr/bin/env python
"""Memory per rank, planned (parallel/memory_plan.py) vs measured on live objects, on CPU.

    python scripts/bench_memory.py --tiny                  # fp32/bf16 x plain/distributed optimizer, tiny Qwen2
    flock /tmp/tripod-heavy.lock python scripts/bench_memory.py --demo outputs/models/smollm2-135m-instruct

Each configuration runs in a fresh 2-rank gloo world (DP=2, PPO with a GAE critic and a KL reference): the trainer
is built and one PPO step runs (rollout through WeightSync, old/ref log-probs, values, critic and actor updates).
Measured on rank 0, component by component: parameters (bytes of each model's parameters), gradients (megatron DDP
grad buffers), fp32 main weights (optimizer parameters not stored in a model parameter), optimizer states (Adam
moments), the generation shard's bytes beyond the actor's own parameters, and the KV cache the rollout allocated;
plus the process's peak RSS (VmHWM) for the whole run. Prints one markdown table: plan, measured, error per row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

MiB = 1 << 20


def _storage_ptr(t) -> int:
    return t.untyped_storage().data_ptr()


def _measure_worker(worker) -> dict[str, int]:
    params = list(worker.module.parameters())
    out = {"params": sum(p.numel() * p.element_size() for p in params)}
    if not worker.trainable:
        return out
    out["grads"] = sum(b.grad_data.numel() * b.grad_data.element_size() for b in worker.model.buffers)
    model_storages = {_storage_ptr(p) for p in params} | {_storage_ptr(b.param_data) for b in worker.model.buffers
                                                          if getattr(b, "param_data", None) is not None}
    opt = worker.optimizer
    inners = getattr(opt, "chained_optimizers", [opt])
    main, states = 0, 0
    for inner in inners:
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                if _storage_ptr(p) not in model_storages:
                    main += p.numel() * p.element_size()
                for v in inner.optimizer.state.get(p, {}).values():
                    if hasattr(v, "numel") and v.dim() > 0:
                        states += v.numel() * v.element_size()
    out["main_params"], out["optim"] = main, states
    return out


def _run_config(config_yaml: str, result_path: str) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from tripod.engine.config import TripodConfig
    from tripod.engine.trainer import PPOTrainer
    from tripod.parallel.hybrid_engine.memory import proc_status_kib

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TripodConfig), OmegaConf.create(config_yaml)))
    trainer = PPOTrainer(cfg)
    sync = trainer.weight_sync
    measured: dict[str, int] = {}
    original = sync.engine.generate

    def generate(prompts, params):  # inside WeightSync.loaded(): the generation shard is live here
        actor = {_storage_ptr(p) for p in trainer.actor.module.parameters()} | {
            _storage_ptr(b.param_data) for b in trainer.actor.model.buffers if getattr(b, "param_data", None) is not None}
        weights = getattr(sync.engine, "decoder").weights
        measured["generation_shard"] = sum(t.numel() * t.element_size() for t in weights.values()
                                           if _storage_ptr(t) not in actor)
        out = original(prompts, params)
        measured["kv_cache"] = sync.engine.last_kv_cache_bytes
        measured["prompt_len"] = max(len(p) for p in prompts)
        measured["sequences"] = len(prompts) * params.n
        return out

    sync.engine.generate = generate
    trainer.train_step(next(iter(trainer.loader)))
    models = {"actor": trainer.actor, "critic": trainer.critic, "reference": trainer.ref}
    per_model = {name: _measure_worker(w) for name, w in models.items() if w is not None}
    if dist.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump({"models": per_model, "rollout": measured, "peak_rss": proc_status_kib("VmHWM") * 1024,
                       "rss": proc_status_kib("VmRSS") * 1024}, f)


def run_config(overrides: list[str], label: str) -> dict:
    from tripod.engine.cli import run_distributed
    from tripod.engine.config import config_to_yaml, load_config, validate_config
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import kv_cache_bytes, plan_from_config

    cfg = load_config(os.path.join(REPO, "recipes", "defaults.yaml"), overrides)
    validate_config(cfg, 2)
    with tempfile.TemporaryDirectory(prefix="tripod-bench-memory-") as tmp:
        path = os.path.join(tmp, "result.json")
        run_distributed(2, _run_config, config_to_yaml(cfg), path)
        with open(path) as f:
            got = json.load(f)
    arch = arch_from_hf(cfg.actor_rollout_ref.model.path)
    plan = plan_from_config(cfg, 2, arch)
    r = got["rollout"]
    gdt = __import__("tripod.engine.precision", fromlist=["rollout_dtype"]).rollout_dtype(cfg.actor_rollout_ref.rollout.dtype,
                                                                                  "cpu")
    kv_plan = kv_cache_bytes(arch, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, r["sequences"],
                             r["prompt_len"] + cfg.actor_rollout_ref.rollout.response_length, gdt)
    rows = []
    for m in plan.models:
        for key, planned in m.rows.items():
            rows.append((f"{m.name} {key}", planned, got["models"][m.name][key]))
    rows.append(("generation shard (beyond the actor)", plan.generation_shard, r["generation_shard"]))
    rows.append(("KV cache", kv_plan, r["kv_cache"]))
    total_plan = sum(p for _, p, _ in rows)
    total_meas = sum(m for _, _, m in rows)
    rows.append(("sum of the rows", total_plan, total_meas))
    return {"label": label, "rows": rows, "peak_rss": got["peak_rss"], "rss": got["rss"]}


def table(results: list[dict]) -> str:
    lines = ["| configuration | component (rank 0) | plan MiB | measured MiB | error |", "|---|---|---:|---:|---:|"]
    for res in results:
        for name, planned, got in res["rows"]:
            err = "—" if planned == got == 0 else f"{100 * (planned - got) / max(got, 1):+.1f}%"
            lines.append(f"| {res['label']} | {name} | {planned / MiB:.1f} | {got / MiB:.1f} | {err} |")
        lines.append(f"| {res['label']} | **peak RSS (VmHWM), whole run** | | {res['peak_rss'] / MiB:.0f} | |")
    return "\n".join(lines)


def tiny_setup(tmp: str) -> list[str]:
    from ppo_setup import make_ppo_setup, tiny_overrides
    setup = make_ppo_setup(tmp)
    return tiny_overrides(setup, os.path.join(tmp, "run"), world=2, steps=1) + [
        "trainer.logger=[jsonl]", "trainer.val_before_train=false", "data.val_files=[]"]


def demo_setup(tmp: str, model: str) -> list[str]:
    from tripod.engine.data import make_arithmetic_rows, write_prompt_parquet
    rows = make_arithmetic_rows(16, seed=0, max_digits=1, ops=("+", "-"), allow_negative=False)
    path = os.path.join(tmp, "train.parquet")
    write_prompt_parquet(rows, path)
    recipe = os.path.join(REPO, "recipes", "demo", "smollm2-135m-arithmetic.yaml")
    from omegaconf import OmegaConf
    flat = OmegaConf.to_container(OmegaConf.load(recipe))
    out = []

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out.append(f"{prefix}{k}={json.dumps(v) if isinstance(v, list) else v}")
    walk(flat)
    return out + [f"actor_rollout_ref.model.path={model}", f"data.train_files={path}", "data.val_files=[]",
                  "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.total_training_steps=1",
                  f"trainer.default_local_dir={os.path.join(tmp, 'run')}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="fp32/bf16 x plain/distributed optimizer on a tiny model")
    p.add_argument("--demo", metavar="MODEL_DIR", help="the demo's SmolLM2-135M at DP=2 fp32: today's settings vs "
                                                        "distributed optimizer + reference offload (heavy: flock)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = []
    with tempfile.TemporaryDirectory(prefix="tripod-bench-memory-data-") as tmp:
        if args.tiny:
            base = tiny_setup(tmp)
            for dtype in ("fp32", "bf16"):
                for dist_opt in ("false", "true"):
                    label = f"tiny {dtype} distopt={dist_opt}"
                    results.append(run_config(base + [f"{k}.megatron.{f}" for k in ("actor_rollout_ref.actor", "critic")
                                                      for f in (f"param_dtype={dtype}",
                                                                f"use_distributed_optimizer={dist_opt}")],
                                              label))
                    print(table(results[-1:]), flush=True)
        if args.demo:
            base = demo_setup(tmp, args.demo)
            off = [f"{k}.megatron.use_distributed_optimizer=false" for k in ("actor_rollout_ref.actor", "critic")]
            for label, extra in (("135M fp32 plain optimizer", off),
                                 ("135M fp32 distopt + ref offload", ["actor_rollout_ref.ref.offload=true"])):
                results.append(run_config(base + extra, label))
                print(table(results[-1:]), flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
