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

MiB = 1 << 20


def _storage_ptr(t) -> int:
    return t.untyped_storage().data_ptr()


def _ddp_buffers(worker) -> list:
    """megatron DDP's param-and-grad buffers of every model chunk of a training worker."""
    return [b for chunk in worker.model for b in chunk.buffers]


def _measure_worker(worker) -> dict[str, int]:
    params = list(worker.module.parameters())
    out = {"params": sum(p.numel() * p.element_size() for p in params)}
    if not worker.trainable:
        return out
    out["grads"] = sum(b.grad_data.numel() * b.grad_data.element_size() for b in _ddp_buffers(worker))
    model_storages = {_storage_ptr(p) for p in params} | {_storage_ptr(b.param_data) for b in _ddp_buffers(worker)
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


class StageRSS:
    """Peak RSS per trainer stage: a thread samples VmRSS every 10 ms and charges it to the innermost open stage
    (the trainer's Timer sections); `mark(name)` records the RSS at a point."""

    def __init__(self) -> None:
        import threading

        self.peaks: dict[str, int] = {}
        self.open: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def _rss() -> int:
        from tripod.runtime.memory import rss_bytes
        return rss_bytes()

    def _charge(self, name: str, rss: int) -> None:
        self.peaks[name] = max(self.peaks.get(name, 0), rss)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            if self.open:
                self._charge(self.open[-1], self._rss())

    def mark(self, name: str) -> None:
        self._charge(name, self._rss())

    @__import__("contextlib").contextmanager
    def __call__(self, name: str, inner=None):
        self.open.append(name)
        try:
            if inner is None:
                yield
            else:
                with inner:
                    yield
        finally:
            self._charge(name, self._rss())
            self.open.pop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _measure_activations(trainer, measured: dict, stages: "StageRSS") -> None:
    """Wrap the training pipeline runs: per model, the peak saved-activation bytes and the micro-batch shape."""
    from tripod.parallel import pipeline
    from tripod.runtime.memory import SavedTensorBytes

    original = pipeline.run_pipeline
    names = {id(w.model[0]): name for name, w in (("actor", trainer.actor), ("critic", trainer.critic))
             if w is not None}

    def run_pipeline(chunks, layout, microbatches, forward_step, *, forward_only, seq_length, micro_batch_size):
        name = names.get(id(chunks[0]))
        if forward_only or name is None:
            return original(chunks, layout, microbatches, forward_step, forward_only=forward_only,
                            seq_length=seq_length, micro_batch_size=micro_batch_size)
        w = trainer.actor if name == "actor" else trainer.critic
        exclude = {_storage_ptr(p) for p in w.module.parameters()} | {
            _storage_ptr(t) for b in _ddp_buffers(w) for t in (b.param_data, b.grad_data) if t is not None}
        with SavedTensorBytes(exclude) as saved, stages(f"{name} forward+backward"):
            out = original(chunks, layout, microbatches, forward_step, forward_only=forward_only,
                           seq_length=seq_length, micro_batch_size=micro_batch_size)
        prev = measured.get(name, {"activations": 0})
        if saved.peak >= prev["activations"]:
            measured[name] = {"activations": saved.peak, "seq": seq_length, "micro_batch": micro_batch_size}
        return out

    pipeline.run_pipeline = run_pipeline


def _staged(stages: "StageRSS", name: str, fn):
    with stages(name):
        return fn()


def _run_config(config_yaml: str, result_path: str) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from tripod.engine.config import TripodConfig
    from tripod.engine.trainer import PPOTrainer
    from tripod.runtime.memory import peak_rss_bytes, rss_bytes

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TripodConfig), OmegaConf.create(config_yaml)))
    stages = StageRSS()
    stages.mark("imports")
    with stages("build"):
        trainer = PPOTrainer(cfg)
    stages.mark("built")
    sync = trainer.weight_sync
    measured: dict[str, int] = {}
    original = sync.engine.generate

    def generate(prompts, params):  # inside WeightSync.loaded(): the generation shard is live here
        actor = {_storage_ptr(p) for p in trainer.actor.module.parameters()} | {
            _storage_ptr(b.param_data) for b in _ddp_buffers(trainer.actor) if getattr(b, "param_data", None) is not None}
        weights = getattr(sync.engine, "decoder").weights
        measured["generation_shard"] = sum(t.numel() * t.element_size() for t in weights.values()
                                           if _storage_ptr(t) not in actor)
        out = original(prompts, params)
        measured["kv_cache"] = sync.engine.last_kv_cache_bytes
        measured["prompt_len"] = max(len(p) for p in prompts)
        measured["sequences"] = len(prompts) * params.n
        return out

    sync.engine.generate = generate
    activations: dict[str, dict] = {}
    _measure_activations(trainer, activations, stages)
    for worker in (trainer.actor, trainer.critic):  # the optimizer step as its own stage
        if worker is not None:
            step = worker.step
            worker.step = lambda step=step, name=worker.name: _staged(stages, f"{name} optimizer step", step)
    from tripod.engine.logging import tracker
    timer_call = tracker.Timer.__call__
    tracker.Timer.__call__ = lambda self, name: stages(name, timer_call(self, name))
    trainer.train_step(next(iter(trainer.loader)))
    stages.stop()
    models = {"actor": trainer.actor, "critic": trainer.critic, "reference": trainer.ref}
    per_model = {name: _measure_worker(w) for name, w in models.items() if w is not None}
    for name, got in activations.items():
        per_model[name].update(got)
    if dist.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump({"models": per_model, "rollout": measured, "peak_rss": peak_rss_bytes(),
                       "rss": rss_bytes(), "stages": stages.peaks}, f)


def run_config(overrides: list[str], label: str) -> dict:
    from tripod.engine.config import load_config
    from tripod.engine.config_loading import config_to_yaml
    from tripod.engine.config_validation import validate_config
    from tripod.engine.launch import run_distributed
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import activation_bytes, kv_cache_bytes, plan_from_config

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
    gdt = __import__("tripod.parallel.precision", fromlist=["rollout_dtype"]).rollout_dtype(cfg.actor_rollout_ref.rollout.dtype,
                                                                                  "cpu")
    kv_plan = kv_cache_bytes(arch, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, r["sequences"],
                             r["prompt_len"] + cfg.actor_rollout_ref.rollout.response_length, gdt)
    rows = []
    for m in plan.models:
        for key, planned in m.rows.items():
            rows.append((f"{m.name} {key}", planned, got["models"][m.name][key]))
        if "activations" in got["models"][m.name]:  # planned at the measured micro-batch shape
            g = got["models"][m.name]
            rows.append((f"{m.name} activations (one micro-batch, {g['micro_batch']} x {g['seq']} tokens)",
                         activation_bytes(arch, m.tp, m.pp, g["micro_batch"], g["seq"], m.param_dtype,
                                          recompute=m.recompute, value_head=m.value_head), g["activations"]))
    rows.append(("generation shard (beyond the actor)", plan.generation_shard, r["generation_shard"]))
    rows.append(("KV cache", kv_plan, r["kv_cache"]))
    total_plan = sum(p for _, p, _ in rows)
    total_meas = sum(m for _, _, m in rows)
    rows.append(("sum of the rows", total_plan, total_meas))
    # the whole process: the plan's own estimate (parallel/memory_plan.py MemoryPlan.host_peak) at the measured shapes
    plan.kv_cache = kv_plan
    plan.activations = {name.split()[0]: planned for name, planned, _ in rows if " activations " in name}
    rows.append(("peak RSS (VmHWM) of the process", plan.host_peak(), got["peak_rss"]))
    return {"label": label, "rows": rows, "peak_rss": got["peak_rss"], "rss": got["rss"], "stages": got["stages"]}


def table(results: list[dict]) -> str:
    lines = ["| configuration | component (rank 0) | plan MiB | measured MiB | error |", "|---|---|---:|---:|---:|"]
    for res in results:
        for name, planned, got in res["rows"]:
            err = "—" if planned == got == 0 else f"{100 * (planned - got) / max(got, 1):+.1f}%"
            lines.append(f"| {res['label']} | {name} | {planned / MiB:.1f} | {got / MiB:.1f} | {err} |")
        lines.append(f"| {res['label']} | **peak RSS (VmHWM), whole run** | | {res['peak_rss'] / MiB:.0f} | |")
        stages = ", ".join(f"{k} {v / MiB:.0f}" for k, v in res.get("stages", {}).items())
        lines.append(f"| {res['label']} | peak RSS MiB by stage: {stages} | | | |")
    return "\n".join(lines)


def tiny_setup(tmp: str) -> list[str]:
    from tripod.engine.data.tiny_ppo import make_ppo_setup, tiny_overrides
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
                  "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[jsonl]",
                  "trainer.total_training_steps=1",
                  f"trainer.default_local_dir={os.path.join(tmp, 'run')}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="fp32/bf16 x plain/distributed optimizer on a tiny model")
    p.add_argument("--demo", metavar="MODEL_DIR", help="the demo's SmolLM2-135M at DP=2 fp32: today's settings vs "
                                                        "distributed optimizer + reference offload (heavy: flock)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--only", metavar="TEXT", help="--demo: only the configurations whose label contains TEXT")
    p.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), help="--tiny: only these parameter dtypes")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "0")  # RSS against the plan's bytes: no rounding to 2 MB pages
    results = []
    with tempfile.TemporaryDirectory(prefix="tripod-bench-memory-data-") as tmp:
        if args.tiny:
            base = tiny_setup(tmp)
            for dtype in (args.dtypes or ("fp32", "bf16")):
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
            micro8 = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]  # the recipe's earlier micro-batch
            for label, extra in (("135M fp32 plain optimizer, micro-batch 8", off + micro8),
                                 ("135M fp32 distopt, micro-batch 8", micro8),
                                 ("135M fp32 distopt + ref offload, recipe", ["actor_rollout_ref.ref.offload=true"])):
                if args.only and args.only not in label:
                    continue
                results.append(run_config(base + extra, label))
                print(table(results[-1:]), flush=True)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
