"""The colocated rollout engine's weights in one place: resume -> load -> (generate) -> release, for every backend.

    sync = WeightSync(hybrid, rollout_engine, actor_model)
    with sync.loaded(timer) as engine:                       # the actor's current weights in the engine
        engine.generate(prompts, params)                     # (engine/rollout/generators.py does this per batch)

WeightSync moves weights only: which rows are generated, single-turn or by the agent loop, and how they reach the
other ranks is the generator's (engine/rollout/generators.py), which gets `loaded` as its session.

`loaded` re-reserves the engine's memory (`resume_memory`: SGLang requires it after
`release_memory_occupation`; the embedded engine re-allocates its weight buffers), gathers the generation shard
from the actor's training shards in the rollout dtype (parallel/hybrid_engine: straight into the engine's buffers
when it has them, so no second copy exists; or, when rollout TP == training TP, PP == 1 and the dtypes agree, as
views of the actor's parameters, so no copy at all), loads it, generates, and always releases the engine's weights and
KV cache before training resumes, also when generation fails.

With LoRA and `lora.merge=false` (vLLM only) the engine serves the adapters itself: the base weights go in on the
first load, then each load moves only the adapters (engine/rollout/vllm_lora.py). `take_metrics` reports the bytes of
weights handed to the engine (rollout/weight_sync_bytes), in both modes.

The SGLang backend's own bucketing of that push lives with it (engine/rollout/sglang_buckets.py).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from tripod.engine.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from tripod.engine.rollout.vllm_lora import tensor_bytes


class WeightSync:
    """Owns one rollout engine and the hybrid engine that feeds it from the actor's training shards."""

    def __init__(self, hybrid, engine: RolloutEngine, actor_model: torch.nn.Module):
        self.hybrid, self.engine, self.actor_model = hybrid, engine, actor_model
        self.events: list[str] = []  # the life cycle as it happened (tests and debugging read it)
        self.sync_bytes = 0  # bytes of weights handed to the engine since `take_metrics` (rollout/weight_sync_bytes)
        self._base_loaded = False  # an engine serving the adapters (lora.merge=false) gets the base once
        self._release()  # training runs first: start with nothing reserved

    def _release(self) -> None:
        self.engine.release_memory()
        self.events.append("release")

    @contextlib.contextmanager
    def loaded(self, timer=None) -> Iterator[RolloutEngine]:
        """resume -> load the actor's current weights; yields the engine; release on exit (also on error)."""
        timed = timer if timer is not None else (lambda name: contextlib.nullcontext())
        try:
            with timed("reshard"):
                self.engine.resume_memory()
                self.events.append("resume")
                # the engine reads the actor's parameters directly when the layouts coincide; else it gets a
                # gathered shard, written straight into its own buffers when it has them
                if getattr(self.engine, "serves_adapters", False):
                    self._load_adapters()
                else:
                    alias = self.hybrid.aliases_training_shard(self.actor_model)
                    buffers = None if alias else self.engine.weight_buffers()
                    shard = self.hybrid.to_rollout(self.actor_model, out=buffers)
                    self.engine.load_weights(shard)
                    self.sync_bytes += tensor_bytes(shard)
                    del shard
                self.events.append("load")
            yield self.engine
        finally:
            self._release()

    def _load_adapters(self) -> None:
        """lora.merge=false: the base weights on the first load only, then this step's adapters alone."""
        from tripod.engine.rollout.vllm_lora import adapter_payload

        if not self._base_loaded:
            shard = self.hybrid.to_rollout(self.actor_model, merge=False)
            self.engine.load_weights(shard)
            self.sync_bytes += tensor_bytes(shard)
            self._base_loaded = True
            del shard
        tensors, config = adapter_payload(self.actor_model, self.hybrid.arch, self.hybrid.plan.dtype)
        self.engine.load_adapter(tensors, config)
        self.sync_bytes += tensor_bytes(tensors)

    def take_metrics(self) -> dict[str, float]:
        """rollout/weight_sync_bytes: bytes of weights this rank handed its rollout engine since the last call (the
        generation shard: merged weights, or with lora.merge=false the adapters, plus the base on the first load)."""
        out, self.sync_bytes = {"rollout/weight_sync_bytes": float(self.sync_bytes)}, 0
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams, timer=None) -> RolloutOutput:
        """One engine call with the actor's current weights, loaded and released around it (a single replica's
        rows: tests and tools; a step's rollout goes through engine/rollout/generators.py)."""
        timed = timer if timer is not None else (lambda name: contextlib.nullcontext())
        with self.loaded(timer) as engine:
            with timed("gen"):
                out = engine.generate(prompts, params)
            self.events.append("generate")
        return out
