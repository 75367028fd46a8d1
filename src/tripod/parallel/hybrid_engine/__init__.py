"""The 3D-HybridEngine: every PPO step the actor's training shards (TP=t, PP=p, DP=d) become rollout shards
(TP=tg, PP=1) by a zero-redundancy gather inside micro-DP groups, and the rollout copy is released afterwards.

- plan.py       who gathers what from whom; bytes and peak memory per rank (pure arithmetic)
- layout_checks.py  which layout pairs it can reshard: one line per problem, before any model is built
- regroup.py    rollout TP that training TP does not divide: groups across DP replicas, point-to-point plan
- transport.py  executing the plan: bucketed broadcasts (point to point for regroup.py); the naive full gather
- engine.py     `HybridEngine`: the per-step round trip around a rollout engine
"""
from tripod.parallel.hybrid_engine.layout_checks import validate_layouts
from tripod.parallel.hybrid_engine.plan import (
    ReshardPlan,
    ReshardPlanError,
    build_reshard_plan,
    reshard_plan_from_config,
)
from tripod.parallel.hybrid_engine.transport import MicroDPGather, TransferStats, naive_full_gather

__all__ = ["ReshardPlan", "ReshardPlanError", "build_reshard_plan", "reshard_plan_from_config", "validate_layouts", "MicroDPGather",
           "TransferStats", "naive_full_gather"]
