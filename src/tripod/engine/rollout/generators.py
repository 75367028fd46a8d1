"""Rows out of a rollout engine, for the whole batch: what a step's rollout calls, on the trainer's ranks or on the
rollout's own.

    generator = SingleTurnGenerator(engine, replicas, session)      # or engine/agent/rollout.py's AgentRollout
    rows = generator.generate_rows(prompts, params, timer, needs)   # a Rollout (rows.py), collective over the world

`replicas` (`RolloutReplicas`) says which ranks form each rollout TP group and which is this rank's: each replica
generates its contiguous share of the prompts (`replica_bounds`) and the rows move to the ranks that need them
(engine/rollout/exchange.py: tensors, point to point, nothing pickled). `session(timer)` is the engine with the
weights it should generate with: on the trainer's ranks `WeightSync.loaded` (resume, reshard the actor's current
weights in, release after), on the rollout's own ranks the engine as it stands (engine/async_rollout/weights.py loads
each version between batches). Which generator a run uses is chosen once (engine/components.py) and handed to
whichever side generates.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

from tripod.engine.data.dataset import PromptBatch
from tripod.engine.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from tripod.engine.rollout.exchange import exchange_rollout
from tripod.engine.rollout.rows import Rollout
from tripod.parallel.moe_arch import MoEArch

Session = Callable[[Any], ContextManager[RolloutEngine]]
Needs = Callable[[list[int]], "list[int] | None"]


@dataclass(frozen=True)
class RolloutReplicas:
    """The rollout's TP groups in this world: `ranks[i]` replica i's global ranks, `mine` this rank's replica, `group`
    its process group (None at TP1), `tp_order` the slice order its engine takes (embedded engine; None: rank order)."""
    ranks: list[list[int]]
    mine: int
    group: Any = None
    tp_order: list[int] | None = None

    @classmethod
    def of_world(cls, world: int, rank: int, tp: int) -> "RolloutReplicas":
        """Consecutive TP groups over a whole world (the rollout's own ranks); every rank makes every group, in order."""
        import torch.distributed as dist

        ranks = [list(range(g * tp, (g + 1) * tp)) for g in range(world // tp)]
        groups = [dist.new_group(r) for r in ranks]
        return cls(ranks, rank // tp, groups[rank // tp] if tp > 1 else None)


def replica_bounds(num_prompts: int, replicas: int) -> list[int]:
    """Start offsets of each rollout replica's share of `num_prompts` prompts, plus the end: replica i takes
    prompts[bounds[i]:bounds[i + 1]] (shares differ by at most one prompt)."""
    return [num_prompts * i // replicas for i in range(replicas + 1)]


def generate_rows(generate: Callable[[list[list[int]]], RolloutOutput], prompts: PromptBatch,
                  replica_ranks: list[list[int]], mine: int, needs: Needs | None = None,
                  routing_of: MoEArch | None = None) -> Rollout:
    """The rows of a whole batch of `prompts` over any set of rollout replicas (`replica_ranks[i]`: replica i's ranks
    in this world; `mine`: this rank's replica): `generate(share)` runs this replica's contiguous share, then
    the rows move to the ranks that need them (exchange.exchange_rollout: every row, or where `needs(every row's
    response length)` names this rank's rows, those and its replica's own). `routing_of`: the model's MoE layout
    when the engine records each token's experts (R3): every row's record then reaches every rank
    (routing_record.gather_rollout_routing). Collective over the world."""
    bounds = replica_bounds(len(prompts), len(replica_ranks))
    out = generate(prompts.input_ids[bounds[mine]:bounds[mine + 1]])
    responses = out.responses()
    # one float32 CPU tensor per row, as long as its response (RolloutOutput pads with 0 past each length)
    log_probs = [out.log_probs[i, : len(r)].detach().float().cpu().clone() for i, r in enumerate(responses)]
    rows = Rollout.generated(prompts, *exchange_rollout(replica_ranks, mine, responses, log_probs,
                                                        list(out.finish_reasons), needs))
    if routing_of is not None:
        from tripod.engine.rollout.routing_record import gather_rollout_routing

        rows.routed_experts = gather_rollout_routing(out.routed_experts, replica_ranks, routing_of)
    return rows


def standing_engine(engine: RolloutEngine) -> Session:
    """The session of an engine whose weights are loaded between batches (the rollout's own ranks)."""
    return lambda timer=None: contextlib.nullcontext(engine)


def timed(timer: Any) -> Callable[[str], ContextManager]:
    return timer if timer is not None else (lambda name: contextlib.nullcontext())


class SingleTurnGenerator:
    """One `generate` call per batch share: the single-turn rollout (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, replicas: RolloutReplicas, session: Session,
                 routing_of: MoEArch | None = None) -> None:
        self.engine, self.replicas, self.session, self.routing_of = engine, replicas, session, routing_of

    def generate_rows(self, prompts: PromptBatch, params: SamplingParams, timer: Any = None,
                      needs: Needs | None = None) -> Rollout:
        def generate(share: list[list[int]]) -> RolloutOutput:
            with self.session(timer) as engine, timed(timer)("gen"):
                return engine.generate(share, params)
        return generate_rows(generate, prompts, self.replicas.ranks, self.replicas.mine, needs, self.routing_of)

    def take_metrics(self) -> dict[str, float]:
        return {}
