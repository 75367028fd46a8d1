"""The rollout engine's life cycle in one place: resume -> load -> generate -> release, for every backend.

    sync = WeightSync(hybrid, rollout_engine, actor_model)
    rows = sync.generate_rows(prompts, params, timer)       # the trainer's only call into the rollout engine
    rows.responses, rows.log_probs, rows.finish_reasons      # every row of the batch (or the rows `needs` names)

`generate_rows` is the rollout boundary: it takes the whole batch's prompts, splits them among the rollout DP
replicas (each replica = one rollout TP group), generates this replica's share (`generate`) and moves the responses
with their rollout log-probs and finish reasons to the other ranks as tensors, point to point
(engine/rollout/exchange.py: nothing pickled), so every rank returns every prompt's rows in prompt order.

`generate` re-reserves the engine's memory (`resume_memory`: SGLang requires it after
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
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from tripod.engine.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from tripod.engine.rollout.exchange import exchange_rollout
from tripod.engine.rollout.vllm_lora import tensor_bytes
from tripod.parallel.moe_arch import MoEArch


class WeightSync:
    """Owns one rollout engine and the hybrid engine that feeds it from the actor's training shards."""

    def __init__(self, hybrid, engine: RolloutEngine, actor_model: torch.nn.Module, agent=None):
        """`agent`: engine/agent/rollout.py's AgentRollout, which then generates the rows (multi-turn)."""
        self.hybrid, self.engine, self.actor_model, self.agent = hybrid, engine, actor_model, agent
        self.events: list[str] = []  # the life cycle as it happened (tests and debugging read it)
        self.last_routed: list[torch.Tensor] | None = None  # the last generate's per-row experts (routing_record.py)
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
        timed = timer if timer is not None else (lambda name: contextlib.nullcontext())
        with self.loaded(timer) as engine:
            with timed("gen"):
                out = engine.generate(prompts, params)
            self.events.append("generate")
        self.last_routed = out.routed_experts  # MoE: this replica's rows' experts, when the engine records them
        return out

    def generate_rows(self, prompts: list[list[int]], params: SamplingParams, timer=None,
                      needs: Callable[[list[int]], list[int] | None] | None = None,
                      extra_infos: list[dict] | None = None) -> GatheredRollout:
        """The rollout of a whole batch: each rollout DP replica generates its contiguous share of `prompts`
        (`replica_bounds`), and every rank gets every prompt's responses with their rollout log-probs and finish
        reasons, in prompt order (n per prompt); or, where `needs(every row's response length)` names this rank's
        rows (exchange.exchange_rollout), those and its replica's own. With an agent (multi-turn) it runs the rows,
        `extra_infos` (each prompt's extra_info: tools_kwargs, interaction_kwargs) going to its tools. Collective over
        the world."""
        if self.agent is not None:
            return self.agent.generate_rows(self, prompts, params, timer, needs, extra_infos)
        recording = getattr(self.engine, "record_routing", False)  # the same on every rank
        return generate_rows(lambda share: self.generate(share, params, timer), prompts,
                             self.hybrid.plan.rollout_tp_groups, self.hybrid.rollout_dp_rank, needs,
                             routing_of=self.hybrid.arch.moe if recording else None)


def generate_rows(generate: Callable[[list[list[int]]], RolloutOutput], prompts: list[list[int]],
                  replica_ranks: list[list[int]], mine: int,
                  needs: Callable[[list[int]], list[int] | None] | None = None,
                  routing_of: MoEArch | None = None) -> GatheredRollout:
    """`WeightSync.generate_rows` for any set of rollout replicas (`replica_ranks[i]`: replica i's ranks in this
    world; `mine`: this rank's replica): `generate(share)` runs this replica's contiguous share of `prompts`, then
    the rows move to the ranks that need them (exchange.exchange_rollout). `routing_of`: the model's MoE layout when
    the engine records each token's experts (R3): every row's record then reaches every rank
    (routing_record.gather_rollout_routing). Collective over the world."""
    bounds = replica_bounds(len(prompts), len(replica_ranks))
    out = generate(prompts[bounds[mine]:bounds[mine + 1]])
    responses = out.responses()
    # one float32 CPU tensor per row, as long as its response (RolloutOutput pads with 0 past each length)
    log_probs = [out.log_probs[i, : len(r)].detach().float().cpu().clone() for i, r in enumerate(responses)]
    rows = GatheredRollout(*exchange_rollout(replica_ranks, mine, responses, log_probs, list(out.finish_reasons),
                                             needs))
    if routing_of is not None:
        from tripod.engine.rollout.routing_record import gather_rollout_routing

        rows.routed_experts = gather_rollout_routing(out.routed_experts, replica_ranks, routing_of)
    return rows


@dataclass
class GatheredRollout:
    """A whole batch's rollout on every rank, row i*n + j = sample j of prompt i: the response tokens, the rollout
    engine's log-prob of each (float32 [len(response)], the convention of engine/rollout/base.py) and the finish
    reason ("stop" / "length"); every row's response length. Where `rows` names the rows this rank needed (a batch
    sharded by DP rank) the other rows are None, except those its own rollout replica generated."""
    responses: list[list[int] | None]
    log_probs: list[torch.Tensor | None]
    finish_reasons: list[str | None]
    lengths: list[int] | None = None
    rows: list[int] | None = None
    token_codes: list[torch.Tensor | None] | None = None  # multi-turn: who wrote each token (engine/agent/loop.py)
    routed_experts: list[torch.Tensor] | None = None  # R3: every row's experts, on every rank (routing_record.py)


def replica_bounds(num_prompts: int, replicas: int) -> list[int]:
    """Start offsets of each rollout replica's share of `num_prompts` prompts, plus the end: replica i takes
    prompts[bounds[i]:bounds[i + 1]] (shares differ by at most one prompt)."""
    return [num_prompts * i // replicas for i in range(replicas + 1)]
