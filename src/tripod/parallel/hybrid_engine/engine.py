"""`HybridEngine`: the per-step round trip of the actor's weights between training and rollout.

    hybrid = HybridEngine(arch, actor_layout, rollout_tp=2)          # plan validated before any weight moves
    rollout_engine.load_weights(hybrid.to_rollout(actor_chunks))      # reshard -> the engine adopts the shard
    out = rollout_engine.generate(prompts, params)
    rollout_engine.release_memory()                                   # back to training; shards never written

The training shard is read straight from the megatron model's parameters (local layer index -> global), so nothing
is copied on the training side; the generation shard is either freed after rollout or, with `keep_buffer=True`,
kept as a reusable buffer for the next step (no allocation churn on GPU).
"""
from __future__ import annotations

import torch

from tripod.parallel.arch import ModelArch
from tripod.parallel.convert import global_params
from tripod.parallel.hybrid_engine.plan import ReshardPlan, build_reshard_plan
from tripod.parallel.hybrid_engine.transport import MicroDPGather


def train_shard_from_model(model, layout, arch: ModelArch, plan: ReshardPlan,
                           merge_stats=None, merge: bool = True) -> dict[str, torch.Tensor]:
    """This rank's training shard as {global megatron name: parameter data} (views, no copies).

    `model` is the actor's GPTModel or its list of virtual-pipeline chunks (DDP-wrapped or not). With LoRA the rollout
    gets W + scale * B @ A: each adapted weight is a `MergedWeight` (parallel/lora/merge.py), merged a bucket at a time
    as the transport reads it (counted in `merge_stats`), never written into the parameter; `merge=False`: the base
    weights alone (for a rollout engine that serves the adapters itself, engine/rollout/vllm_lora.py)."""
    wanted = {s.name for s in plan.owned_specs(_global_rank()) + plan.owned_expert_specs(_global_rank())}
    params = global_params(model)
    shard = {name: p.data for name, p in params.items() if name in wanted}
    if merge and any(".lora." in name for name in params):
        from tripod.parallel.lora.merge import merged_shard
        shard = merged_shard(model, shard, {id(p): name for name, p in params.items()}, plan.bucket_bytes,
                             merge_stats)
    missing = sorted(wanted - set(shard))
    if missing:
        raise ValueError(f"actor model on rank {_global_rank()} lacks parameters the rollout needs: {missing[:6]}")
    return shard


def _global_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank()


class HybridEngine:
    """Owns the resharding plan and the micro-DP / rollout-TP process groups for one actor layout."""

    def __init__(self, arch: ModelArch, actor_layout, rollout_tp: int, *, bucket_bytes: int = 64 << 20,
                 dtype: torch.dtype = torch.float32, keep_buffer: bool = False, vpp: int | None = None,
                 local_order: bool = True):
        import torch.distributed as dist
        self.arch, self.layout = arch, actor_layout
        # CP ranks hold the same shards as DP replicas: the plan's "DP" is DP x CP (tp-cp-dp-pp order keeps the
        # plan's tp-dp-pp arithmetic right, the replica index being cp_rank + cp * dp_rank)
        self.plan = build_reshard_plan(arch, actor_layout.tp, actor_layout.pp, actor_layout.dp * actor_layout.cp,
                                       rollout_tp,
                                       bucket_bytes=bucket_bytes, dtype=dtype, world_size=dist.get_world_size(),
                                       vpp=vpp or 1, ep=actor_layout.ep, etp=actor_layout.etp,
                                       first=actor_layout.first_stage_layers, last=actor_layout.last_stage_layers,
                                       local_order=local_order)
        if list(actor_layout.ranks) != list(range(dist.get_world_size())):
            raise ValueError("the hybrid engine reshards an actor laid over the whole world; "
                             f"actor ranks are {actor_layout.ranks}")
        self.gather = MicroDPGather(self.plan)
        self.keep_buffer = keep_buffer
        self._buffer: dict[str, torch.Tensor] | None = None
        self.merge_stats = None  # LoRA: the last `to_rollout`'s merged bytes alive (parallel/lora/merge.py MergeStats)

    @property
    def rollout_tp_group(self):
        return self.gather.rollout_tp_group

    @property
    def rollout_tp_order(self) -> list[int]:
        """This rank's rollout TP group, global ranks listed in rollout TP order (entry j holds slice j). When it is
        not the sorted order (rollout TP > training TP, local order: plan.py) the rollout engine must be told."""
        return self.plan.rollout_tp_group_of(_global_rank())

    @property
    def rollout_tp_rank(self) -> int:
        return self.plan.rollout_tp_rank(_global_rank())

    @property
    def rollout_dp_rank(self) -> int:
        """Index of this rank's rollout replica (rollout TP group) in the world."""
        me = _global_rank()
        return next(i for i, g in enumerate(self.plan.rollout_tp_groups) if me in g)

    @property
    def rollout_dp_size(self) -> int:
        return len(self.plan.rollout_tp_groups)

    def aliases_training_shard(self, model: torch.nn.Module) -> bool:
        """True when the generation shard IS this rank's training shard: rollout TP == training TP, PP == 1 and the
        rollout dtype is the parameters' dtype. Then `to_rollout` returns views of the parameters (no copy, no
        traffic); the rollout engine only reads them, and only between training phases."""
        p = self.plan
        same_experts = not p.expert_specs or (p.ep == 1 and (p.etp or p.tp) == p.tp)
        dtypes = p.generation_dtypes()
        from tripod.parallel.convert import model_chunks
        from tripod.parallel.lora import lora_adapters
        if any(True for _ in lora_adapters(model_chunks(model))):  # LoRA: W + scale * B @ A, never the parameters
            return False
        return p.pp == 1 and p.tp == p.rollout_tp and same_experts and all(
            t.dtype == dtypes[n] for n, t in train_shard_from_model(model, self.layout, self.arch, p).items())

    def to_rollout(self, model: torch.nn.Module, out: dict[str, torch.Tensor] | None = None,
                   merge: bool = True) -> dict[str, torch.Tensor]:
        """Gather this rank's generation shard (in the plan's dtype: the rollout dtype) from the actor's training
        shards; into `out` (e.g. the rollout engine's own buffers) when given; views of the parameters when the
        layouts and dtypes coincide (`aliases_training_shard`) and no `out` is given. `merge=False`: LoRA's base
        weights without the adapters."""
        from tripod.parallel.lora.merge import MergeStats

        self.merge_stats = MergeStats()
        shard = train_shard_from_model(model, self.layout, self.arch, self.plan, self.merge_stats, merge)
        if out is None and not self.keep_buffer and self.aliases_training_shard(model):
            return shard
        with torch.no_grad():
            gen = self.gather.gather(shard, out=out if out is not None else self._buffer)
        if self.keep_buffer:
            self._buffer = gen
        return gen
