"""The measured side of `tripod bench`, run on every rank: `PPOTrainer.train_step` exactly as `tripod train` runs
it (no checkpoints, no validation), one raw record per step written by rank 0 for `tripod.engine.bench.summary`.

A record holds the step's wall time, the trainer's own stage timers (`timing_s/*`), the tokens it processed and
the matmul FLOPs of each stage by the transformer count of `tripod.engine.throughput.PerfCounter`, so MFU and tokens/s
are computed afterwards from numbers that are all in the file.
"""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

# timing_s/<key> written by PPOTrainer.train_step, in step order; "other" is the step minus their sum
STAGES = ("reshard", "gen", "reward", "wait_rollout", "old_log_prob", "ref", "values", "adv", "update_critic",
          "update_actor")


def stage_flops(perf, tokens: float, response: float, rows: int, timings: dict[str, float],
                ppo_epochs: int, model_tokens: float | None = None, gen_tokens: float | None = None) -> dict[str, float]:
    """Matmul FLOPs of each timed stage of one step (forward 2x, forward+backward 6x params per token), over the
    tokens the models really ran (`model_tokens`: a shared prompt once; `gen_tokens`: the rollout's prefill runs
    each prompt once); both default to `tokens` (every row's prompt + response)."""
    seq = tokens / max(rows, 1)
    run = tokens if model_tokens is None else model_tokens
    fwd = run * perf.flops_per_token(seq, False)
    fwd_bwd = run * perf.flops_per_token(seq, True)
    gen = (tokens if gen_tokens is None else gen_tokens) * perf.flops_per_token(seq, False)
    out = {"gen": gen + perf.head_flops(response, False),  # prefill + decode; the LM head on generated tokens
           "old_log_prob": fwd + perf.head_flops(response, False),
           "ref": fwd + perf.head_flops(response, False),
           "values": fwd,
           "update_actor": ppo_epochs * (fwd_bwd + perf.head_flops(response, True)),
           "update_critic": ppo_epochs * fwd_bwd}
    return {k: v for k, v in out.items() if f"timing_s/{k}" in timings}


def step_record(index: int, warmup: bool, wall_s: float, metrics: dict[str, float], rows: int, prompts: int,
                perf, ppo_epochs: int) -> dict:
    timings = {k: float(v) for k, v in metrics.items() if k.startswith("timing_s/")}
    total = int(round(metrics["perf/total_num_tokens"]))
    response = int(round(metrics["response_length/mean"] * rows))
    return {"index": index, "warmup": warmup, "wall_s": wall_s,
            "step_s": timings.get("timing_s/step", wall_s),
            "stages_s": {k: timings[f"timing_s/{k}"] for k in STAGES if f"timing_s/{k}" in timings},
            "prompts": prompts, "samples": rows, "prompt_tokens": total - response, "response_tokens": response,
            "model_tokens": int(round(metrics.get("perf/model_tokens", total))),
            "flops": stage_flops(perf, total, response, rows, timings, ppo_epochs, metrics.get("perf/model_tokens"),
                                 metrics.get("perf/gen_tokens")),
            "score_mean": float(metrics.get("critic/score/mean", 0.0)),
            "nonzero_adv_frac": metrics.get("critic/advantages/nonzero_frac")}


def bench_on_rank(config_yaml: str, steps: int, warmup: int, raw_path: str) -> None:
    """Build the trainer from the resolved recipe, run warmup + steps train steps, write the raw records. With the
    rollout on ranks of its own (rollout.n_gpus_per_node), those ranks serve it (engine/async_rollout/) and the
    records count them in the world: throughput per device is per rank of either kind."""
    from omegaconf import OmegaConf

    from tripod.engine.config import TripodConfig

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TripodConfig), OmegaConf.create(config_yaml)))
    if not cfg.separate_rollout:
        return _bench(cfg, None, steps, warmup, raw_path)
    from tripod.engine.async_rollout.bridge import split_world
    from tripod.engine.async_rollout.server import RolloutServer

    with split_world(cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node) as placement:
        if placement.is_trainer:
            _bench(cfg, placement, steps, warmup, raw_path)
        else:
            RolloutServer(cfg, placement).serve()


def _time_checkpoint(trainer, asynchronous: bool) -> dict[str, float]:
    """One trainer checkpoint after the measured steps, as fit() saves it (trainer.async_save): the seconds the step
    waits, the seconds until it is on disk, its size; then removed. Collective."""
    import shutil

    t0 = time.perf_counter()
    path = trainer.ckpt.save(trainer.step, trainer.state_dict(), trainer.trainable_workers(), asynchronous=asynchronous)
    blocking = time.perf_counter() - t0
    trainer.ckpt.wait()
    out = {"blocking_s": blocking, "total_s": time.perf_counter() - t0,
           "gb": sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2 ** 30
           if trainer.rank == 0 else 0.0}
    dist.barrier()
    if trainer.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return out


def _bench(cfg, placement, steps: int, warmup: int, raw_path: str) -> None:
    from tripod.engine.throughput import active_matmul_params, measure_peak_flops
    from tripod.engine.trainer import PPOTrainer
    from tripod.runtime.memory import peak_memory_gb

    t0 = time.perf_counter()
    trainer = PPOTrainer(cfg, placement)
    setup_s = time.perf_counter() - t0
    n = cfg.actor_rollout_ref.rollout.n
    records = []
    trainer.source.start(0)
    try:
        for i in range(warmup + steps):
            # what fit() does; the rollout's own ranks pick the prompts themselves
            prompts = next(iter(trainer.loader)) if placement is None else None
            dist.barrier()
            t0 = time.perf_counter()
            metrics = trainer.train_step(prompts)
            trainer.step += 1
            metrics.update(trainer.source.updated(trainer.step))  # what fit() does next (rollout on its own ranks)
            wall = time.perf_counter() - t0
            count = len(prompts.input_ids) if prompts is not None else cfg.data.train_batch_size
            records.append(step_record(i, i < warmup, wall, metrics, count * n, count, trainer.perf,
                                       cfg.actor_rollout_ref.actor.ppo_epochs))
            if trainer.rank == 0:
                r = records[-1]
                print(f"tripod bench: step {i + 1}/{warmup + steps}{' (warmup)' if r['warmup'] else ''} "
                      f"{r['step_s']:.2f} s  " + "  ".join(f"{k}={v:.2f}" for k, v in r["stages_s"].items()),
                      flush=True)
        peak_gb = peak_memory_gb()  # the steps' peak (the save's is not the step's)
        checkpoint = _time_checkpoint(trainer, cfg.trainer.async_save)
    finally:
        trainer.source.close()
        if trainer.rewards is not None:
            trainer.rewards.close()
    # the ceiling again, after the steps: a start-up measurement that shared its core with a neighbour reads low
    trainer.perf.peak = max(trainer.perf.peak, measure_peak_flops())
    ranks: list = [None] * trainer.world
    dist.all_gather_object(ranks, {"rank": trainer.rank, "peak_memory_gb": peak_gb,
                                   "threads": torch.get_num_threads(), "peak_flops": trainer.perf.peak})
    if trainer.rank == 0:
        arch = trainer.arch
        raw = {"records": records, "ranks": ranks, "setup_s": setup_s, "checkpoint": checkpoint,
               "world_size": trainer.world + (placement.rollout_ranks if placement else 0),
               "rollout_ranks": placement.rollout_ranks if placement else 0,
               "on_policy_old_log_probs_skipped": all("old_log_prob" not in r["stages_s"] for r in records),
               "model": {"path": cfg.actor_rollout_ref.model.path, "family": arch.family,
                         "layer_params": active_matmul_params(arch), "num_layers": arch.num_layers,
                         "hidden_size": arch.hidden_size, "vocab_size": arch.vocab_size}}
        os.makedirs(os.path.dirname(os.path.abspath(raw_path)), exist_ok=True)
        with open(raw_path, "w") as f:
            json.dump(raw, f, indent=1)
