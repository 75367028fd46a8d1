"""Validation of the PPO trainer: greedy (actor_rollout_ref.rollout.val_kwargs) generation over data.val_files in
batches of data.val_batch_size prompts, scored by the run's reward functions.

Returns `val/reward_mean` and `val/<data_source>/reward_mean`; with multi-turn on, the validation rows' own agent
metrics under `val/` (val/tool/call_rate, val/tool/parse_frac, val/multi_turn/turns_mean, ...: engine/agent/rollout.py),
each row's tools getting its extra_info (tools_kwargs, interaction_kwargs) as in training. `trainer.val_only` runs
this once and stops (verl's key).
"""
from __future__ import annotations

from typing import Any

from tripod.engine.logging import Timer, validation_samples


def validate(trainer: Any) -> dict[str, float]:
    """The validation metrics (rank-identical); `trainer.val_samples` gets the logged generations (rank 0)."""
    t = trainer
    if t.val_set is None:
        return {}
    t.generator.take_metrics()  # a training step's turns are not validation's
    params = t.sampling_params(True, -1)
    size = t.cfg.data.val_batch_size or len(t.val_set)
    scores: list[float] = []
    by_source: dict[str, list[float]] = {}
    t.val_samples = []
    want = t.cfg.trainer.log_val_generations if t.rank == 0 else 0
    for start in range(0, len(t.val_set), size):
        prompts = t.val_set.batch(list(range(start, min(start + size, len(t.val_set)))))
        t.offload.enter("rollout")
        generated = t.generator.generate_rows(prompts, params, Timer())
        responses = generated.responses
        batch_scores, _ = t.scorer(prompts, generated)
        t.val_samples += validation_samples(t.tokenizer, prompts.input_ids, responses, batch_scores, params.n,
                                            prompts.ground_truths, limit=want - len(t.val_samples))
        scores += batch_scores
        rep_sources = [s for s in prompts.data_sources for _ in range(params.n)]
        for s, x in zip(rep_sources, batch_scores):
            by_source.setdefault(s, []).append(x)
    out = {"val/reward_mean": sum(scores) / len(scores)}
    out.update({f"val/{s}/reward_mean": sum(v) / len(v) for s, v in by_source.items()})
    out.update({f"val/{k}": v for k, v in t.generator.take_metrics().items()})
    return out
