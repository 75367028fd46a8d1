#!/usr/bin/env python
"""The demo's PPO run with LoRA on the actor and the critic against the same run at full parameters, on CPU.

    flock /tmp/tripod-heavy.lock .venv/bin/python scripts/bench_lora.py [--steps 5] [--rank 16]

Both runs are recipes/demo/smollm2-135m-arithmetic.yaml (SmolLM2-135M, PPO with a GAE critic and a k3 KL reward,
2 gloo ranks, DP2) on the demo's prompts (scripts/demo.py prepares model and data when they are missing), with the
same threads per rank (`--threads`, default 1), the same seed and batches, validation and checkpoints off; the LoRA
run adds `actor_rollout_ref.model.lora` and `critic.model.lora` (rank `--rank`, alpha 2 x rank, all-linear) and
nothing else (same learning rates: the timing and the memory do not depend on them). Each run is its own 2-rank
world, set up as `tripod train` sets one up (engine/preflight.py's checks and thread count, huge-page allocations as
the CLI turns them on). Measured on every rank:

- peak RSS (VmHWM) of the whole process (build included), and of the steps alone (VmHWM reset after the build);
- the peak RSS of each trainer stage (reshard, gen, ref, update_actor, ...; bench_memory.py's sampler, 10 ms);
- the long-lived bytes per model after the last step (bench_memory.py's accounting: parameters, DDP gradient
  buffers, fp32 main weights, Adam states);
- each step's wall time (the mean leaves out step 1, the warm-up);
- the weight sync per step: the bytes of the generation shard the rollout engine loads (copied, or views of the
  actor's parameters where they alias), the bytes LoRA's merge computes (W + scale * B @ A) and holds at once
  (the hybrid engine's merge_stats), any `rollout/*bytes*` metric the trainer reports, and the actor's adapter
  bytes (what an adapter-only sync would move; computed from the adapter parameters, not measured).

Prints markdown tables (record them in bench/RESULTS.md); `--json PATH` also writes the raw numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))  # bench_memory's sampler and per-model accounting

from bench_memory import StageRSS, _measure_worker  # noqa: E402

MiB = 1 << 20
MODEL_DIR = os.path.join(REPO, "outputs", "models", "smollm2-135m-instruct")
DATA_DIR = os.path.join(REPO, "outputs", "demo_data")
RECIPE = os.path.join(REPO, "recipes", "demo", "smollm2-135m-arithmetic.yaml")


def _bench_on_rank(config_yaml: str, out_prefix: str) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from tripod.engine.config import TripodConfig
    from tripod.engine.logging import tracker
    from tripod.engine.trainer import PPOTrainer
    from tripod.parallel.convert import model_chunks
    from tripod.parallel.lora import lora_adapters
    from tripod.runtime.memory import peak_rss_bytes, reset_peak_rss, rss_bytes

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TripodConfig), OmegaConf.create(config_yaml)))
    stages = StageRSS()
    timer_call = tracker.Timer.__call__
    tracker.Timer.__call__ = lambda self, name: stages(name, timer_call(self, name))
    with stages("build"):
        trainer = PPOTrainer(cfg)
    build_peak, built = peak_rss_bytes(), rss_bytes()
    reset_peak_rss()

    sync: dict[str, float] = {"loads": 0, "shard_bytes": 0, "copied_bytes": 0, "merged_bytes": 0,
                              "merge_peak_bytes": 0}
    engine = trainer.weight_sync.engine
    load = engine.load_weights
    actor_storages = {p.untyped_storage().data_ptr() for p in trainer.actor.module.parameters()}

    def counted_load(shard):
        sync["loads"] += 1
        sync["shard_bytes"] += nbytes(shard.values())
        sync["copied_bytes"] += nbytes(t for t in shard.values() if t.untyped_storage().data_ptr() not in actor_storages)
        stats = getattr(trainer.hybrid, "merge_stats", None)  # LoRA's merge of this sync (parallel/lora/merge.py)
        if stats is not None:
            sync["merged_bytes"] += stats.merged_total
            sync["merge_peak_bytes"] = max(sync["merge_peak_bytes"], stats.merged_peak + stats.delta_peak)
        return load(shard)

    engine.load_weights = counted_load
    steps, bytes_metrics = [], {}
    trainer.source.start(0)
    for _ in range(cfg.trainer.total_training_steps):
        start = time.perf_counter()
        metrics = trainer.train_step()
        wall = time.perf_counter() - start
        trainer.step += 1
        trainer.source.updated(trainer.step)
        bytes_metrics.update({k: v for k, v in metrics.items() if k.startswith("rollout/") and "bytes" in k})
        steps.append({"wall_s": wall, "peak_rss": peak_rss_bytes(), "rss": rss_bytes(),
                      **{k: v for k, v in metrics.items() if k.startswith("timing_s/")}})
    stages.stop()
    adapters = [p for a in lora_adapters(model_chunks(trainer.actor.model)) for p in a.parameters()]
    models = {"actor": trainer.actor, "critic": trainer.critic, "reference": trainer.ref}
    per_model = {}
    for name, w in models.items():
        if w is not None:
            per_model[name] = _measure_worker(w)
            per_model[name]["trainable_params"] = nbytes(p for p in w.module.parameters() if p.requires_grad)
    result = {"rank": dist.get_rank(), "build_peak_rss": build_peak, "built_rss": built,
              "steps_peak_rss": peak_rss_bytes(), "steps": steps, "stages": stages.peaks, "models": per_model,
              "sync": {**sync, "adapter_bytes": nbytes(adapters), "adapter_params": sum(p.numel() for p in adapters)},
              "bytes_metrics": bytes_metrics}
    with open(f"{out_prefix}.rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)


def run(label: str, overrides: list[str], root: str) -> dict:
    from tripod.engine.cli.train import rank_environment
    from tripod.engine.config import config_to_yaml
    from tripod.engine.launch import detect_launch, run_distributed
    from tripod.engine.preflight import prepare_train

    cfg, world = prepare_train(RECIPE, overrides, detect_launch())
    os.environ.update(rank_environment(cfg))
    prefix = os.path.join(root, label)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    run_distributed(world, _bench_on_rank, config_to_yaml(cfg), prefix)
    ranks = []
    for r in range(world):
        with open(f"{prefix}.rank{r}.json") as f:
            ranks.append(json.load(f))
    return {"label": label, "ranks": ranks, "wall_s": time.perf_counter() - start, "load": (load_before,
            os.getloadavg()[0]), "steps": cfg.trainer.total_training_steps, "threads": cfg.trainer.threads_per_rank}


def mean_step(res: dict) -> float:
    """Mean wall time of steps 2.. (step 1 is the warm-up), the slowest rank's per step."""
    walls = [max(r["steps"][i]["wall_s"] for r in res["ranks"]) for i in range(1, res["steps"])]
    return statistics.mean(walls)


def mean_timing(res: dict, key: str) -> float:
    return statistics.mean(max(r["steps"][i].get(key, 0.0) for r in res["ranks"]) for i in range(1, res["steps"]))


def tables(full: dict, lora: dict) -> str:
    out = ["| | full parameters | LoRA actor + critic | LoRA / full |", "|---|---:|---:|---:|"]

    def row(name: str, f: float, lo: float, unit: str = "MiB", scale: float = MiB) -> None:
        ratio = f"{lo / f:.2f}" if f else "-"
        out.append(f"| {name} | {f / scale:.1f} {unit} | {lo / scale:.1f} {unit} | {ratio} |")

    for r in range(len(full["ranks"])):
        row(f"peak RSS rank {r}, whole run (VmHWM, build included)",
            max(full["ranks"][r]["build_peak_rss"], full["ranks"][r]["steps_peak_rss"]),
            max(lora["ranks"][r]["build_peak_rss"], lora["ranks"][r]["steps_peak_rss"]))
        row(f"peak RSS rank {r}, the steps only", full["ranks"][r]["steps_peak_rss"],
            lora["ranks"][r]["steps_peak_rss"])
        row(f"peak RSS rank {r}, the build", full["ranks"][r]["build_peak_rss"], lora["ranks"][r]["build_peak_rss"])
    row(f"mean step time, steps 2-{full['steps']} (step 1 = warm-up left out), slowest rank", mean_step(full),
        mean_step(lora), "s", 1.0)
    for key in ("timing_s/reshard", "timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/values",
                "timing_s/update_critic", "timing_s/update_actor"):
        row(f"  of which {key[9:]}", mean_timing(full, key), mean_timing(lora, key), "s", 1.0)
    fs, ls = full["ranks"][0]["sync"], lora["ranks"][0]["sync"]
    per = max(fs["loads"], 1), max(ls["loads"], 1)
    row("weight sync per step and replica: generation shard loaded", fs["shard_bytes"] / per[0],
        ls["shard_bytes"] / per[1])
    row("  of it copied (not views of the actor's parameters)", fs["copied_bytes"] / per[0],
        ls["copied_bytes"] / per[1])
    row("  merged bytes computed (W + scale * B @ A, in fp32 chunks)", fs["merged_bytes"] / per[0],
        ls["merged_bytes"] / per[1])
    row("  merge: most bytes alive at once (chunks + delta)", fs["merge_peak_bytes"], ls["merge_peak_bytes"])
    out.append(f"| adapter-only sync per step (computed: the actor's {ls['adapter_params']:,} adapter parameters "
               f"x {ls['adapter_bytes'] // max(ls['adapter_params'], 1)} B, not measured) | - | {ls['adapter_bytes'] / MiB:.2f} MiB | - |")
    for key in sorted(set(lora["ranks"][0]["bytes_metrics"]) | set(full["ranks"][0]["bytes_metrics"])):
        row(f"`{key}` (measured)", full["ranks"][0]["bytes_metrics"].get(key, 0.0),
            lora["ranks"][0]["bytes_metrics"].get(key, 0.0))
    out += ["", "Long-lived bytes per model after the last step, rank 0 (MiB):", "",
            "| run | model | params | of which trainable | grads | main | Adam states |", "|---|---|---:|---:|---:|---:|---:|"]
    for res in (full, lora):
        for name, m in res["ranks"][0]["models"].items():
            out.append(f"| {res['label']} | {name} | {m['params'] / MiB:.1f} | {m['trainable_params'] / MiB:.1f} | "
                       f"{m.get('grads', 0) / MiB:.1f} | {m.get('main_params', 0) / MiB:.1f} | "
                       f"{m.get('optim', 0) / MiB:.1f} |")
    out += ["", "Peak RSS by stage, rank 0 (MiB):", ""]
    for res in (full, lora):
        st = res["ranks"][0]["stages"]
        out.append(f"- {res['label']}: " + ", ".join(f"{k} {v / MiB:.0f}" for k, v in st.items()))
    for res in (full, lora):
        out.append(f"- {res['label']}: {res['wall_s']:.0f} s wall for build + {res['steps']} steps, "
                   f"{res['threads']} thread(s) per rank, load average {res['load'][0]:.2f} -> {res['load'][1]:.2f}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of actor and critic (alpha = 2 x rank)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank, both runs")
    p.add_argument("--json", metavar="PATH", help="also write the raw numbers as JSON")
    args = p.parse_args()
    from tripod.engine.launch import default_huge_page_allocations

    default_huge_page_allocations()  # as `tripod train` does for the ranks it spawns
    if not (os.path.exists(os.path.join(DATA_DIR, "train.parquet")) and os.path.isdir(MODEL_DIR)):
        subprocess.run([sys.executable, os.path.join(REPO, "scripts", "demo.py"), "--prepare-only"], check=True)
    with tempfile.TemporaryDirectory(prefix="tripod-bench-lora-") as root:
        base = [f"actor_rollout_ref.model.path={MODEL_DIR}", f"data.train_files={DATA_DIR}/train.parquet",
                "data.val_files=[]", "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
                "trainer.logger=[jsonl]", f"trainer.total_training_steps={args.steps}",
                f"trainer.threads_per_rank={args.threads}", f"trainer.default_local_dir={root}/run"]
        lora = [f"{k}.lora.{v}" for k in ("actor_rollout_ref.model", "critic.model")
                for v in (f"rank={args.rank}", f"alpha={2 * args.rank}", "target_modules=[all-linear]")]
        full = run("full", base, root)
        print(f"full: {full['wall_s']:.0f} s", flush=True)
        adapted = run(f"LoRA r{args.rank}", base + lora, root)
    text = tables(full, adapted)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([full, adapted], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
