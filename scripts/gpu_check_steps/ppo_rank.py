"""The real-size PPO step's rank function: `PPOTrainer.train_step` as `tripod train` runs it (engine/bench/runner.py
does the same for `tripod bench`), each step's metrics kept whole (timing_s/*, perf/throughput, perf/mfu/actor),
then one synchronous checkpoint timed and measured, and the allocator's peaks."""
from __future__ import annotations

import json
import time


def run_steps(config_yaml: str, out_path: str) -> None:
    import torch
    from omegaconf import OmegaConf

    from tripod.engine.bench.runner import _time_checkpoint
    from tripod.engine.config import TripodConfig
    from tripod.engine.trainer import PPOTrainer
    from tripod.runtime.memory import peak_memory_gb

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TripodConfig), OmegaConf.create(config_yaml)))
    t0 = time.perf_counter()
    trainer = PPOTrainer(cfg)
    setup_s = time.perf_counter() - t0
    steps = []
    trainer.source.start(0)
    try:
        for _ in range(cfg.trainer.total_training_steps):
            prompts = next(iter(trainer.loader))
            metrics = trainer.train_step(prompts)
            trainer.step += 1
            metrics.update(trainer.source.updated(trainer.step))
            steps.append({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))})
            print(f"gpu_check ppo: step {trainer.step} {metrics['timing_s/step']:.1f} s", flush=True)
        cuda = torch.cuda.is_available()
        allocated = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else peak_memory_gb()
        reserved = torch.cuda.max_memory_reserved() / 2 ** 30 if cuda else peak_memory_gb()
        checkpoint = _time_checkpoint(trainer, asynchronous=False)
    finally:
        trainer.source.close()
        if trainer.rewards is not None:
            trainer.rewards.close()
    if trainer.rank == 0:
        params = sum(p.numel() for chunk in trainer.actor.model for p in chunk.parameters())
        with open(out_path, "w") as f:
            json.dump({"steps": steps, "setup_s": setup_s, "checkpoint": checkpoint, "peak_flops": trainer.perf.peak,
                       "max_allocated_gb": allocated, "max_reserved_gb": reserved, "params": params}, f)
