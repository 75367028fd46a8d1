"""The rollout engine's life cycle in one place: resume -> load -> generate -> release, for every backend.

    sync = WeightSync(hybrid, rollout_engine, actor_model)
    responses = sync.generate_all(prompts, params, timer)   # the trainer's only call into the rollout engine

`generate_all` is the rollout boundary: it takes the whole batch's prompts, splits them among the rollout DP
replicas (each replica = one rollout TP group), generates this replica's share (`generate`) and all-gathers the
responses, so every rank returns every prompt's responses in prompt order.

`generate` re-reserves the engine's memory (`resume_memory`: SGLang requires it after
`release_memory_occupation`; the embedded engine re-allocates its weight buffers), gathers the generation shard
from the actor's training shards in the rollout dtype (parallel/hybrid_engine: straight into the engine's buffers
when it has them, so no second copy exists; or, when rollout TP == training TP, PP == 1 and the dtypes agree, as
views of the actor's parameters, so no copy at all), loads it, generates, and always releases the engine's weights and
KV cache before training resumes, also when generation fails.

Also here: the bucketing behind the SGLang push (`hf_buckets`, `gather_bucket_full`, `flatten_by_dtype`). SGLang's
loaders take full HF tensors and shard them themselves, so, as slime's `update_weights_from_tensor` path does,
each bucket's tensors are all-gathered over the rollout TP group (every rank holds at most one bucket of full
tensors, never the whole model on one rank), flattened into one tensor per dtype, and each rank hands its own
flattened bucket to the SGLang TP worker on its GPU (CUDA IPC handles, gathered to the group's first rank).
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

import torch
import torch.distributed as dist

from tripod.engine.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from tripod.parallel.arch import ModelArch


class WeightSync:
    """Owns one rollout engine and the hybrid engine that feeds it from the actor's training shards."""

    def __init__(self, hybrid, engine: RolloutEngine, actor_model: torch.nn.Module):
        self.hybrid, self.engine, self.actor_model = hybrid, engine, actor_model
        self.events: list[str] = []  # the life cycle as it happened (tests and debugging read it)
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
                alias = self.hybrid.aliases_training_shard(self.actor_model)
                buffers = None if alias else self.engine.weight_buffers()
                shard = self.hybrid.to_rollout(self.actor_model, out=buffers)
                self.engine.load_weights(shard)
                del shard
                self.events.append("load")
            yield self.engine
        finally:
            self._release()

    def generate(self, prompts: list[list[int]], params: SamplingParams, timer=None) -> RolloutOutput:
        timed = timer if timer is not None else (lambda name: contextlib.nullcontext())
        with self.loaded(timer) as engine:
            with timed("gen"):
                out = engine.generate(prompts, params)
            self.events.append("generate")
        return out

    def generate_all(self, prompts: list[list[int]], params: SamplingParams, timer=None) -> list[list[int]]:
        """The rollout of a whole batch: each rollout DP replica generates its contiguous share of `prompts`
        (`replica_bounds`), and every rank gets every prompt's responses, in prompt order (n per prompt)."""
        replicas, mine = self.hybrid.rollout_dp_size, self.hybrid.rollout_dp_rank
        bounds = replica_bounds(len(prompts), replicas)
        out = self.generate(prompts[bounds[mine]:bounds[mine + 1]], params, timer)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, out.responses()))
        return join_replicas(gathered, replicas)


def replica_bounds(num_prompts: int, replicas: int) -> list[int]:
    """Start offsets of each rollout replica's share of `num_prompts` prompts, plus the end: replica i takes
    prompts[bounds[i]:bounds[i + 1]] (shares differ by at most one prompt)."""
    return [num_prompts * i // replicas for i in range(replicas + 1)]


def join_replicas(gathered: list[tuple[int, list[list[int]]]], replicas: int) -> list[list[int]]:
    """Every rank's (replica, responses) -> all responses in replica order (the ranks of one replica hold the same
    responses; any one of them stands for it)."""
    by_replica = dict(gathered)
    missing = [i for i in range(replicas) if i not in by_replica]
    if missing:
        raise RuntimeError(f"no responses from rollout replica(s) {missing} of {replicas}")
    return [resp for i in range(replicas) for resp in by_replica[i]]


# ---- SGLang push: full HF tensors one bucket at a time, flattened per dtype ---------------------------------
def hf_buckets(arch: ModelArch, shard: dict[str, torch.Tensor], tp_size: int, bucket_bytes: int) -> list[list[str]]:
    """Megatron names of the generation shard in buckets whose FULL (TP-merged) size stays under `bucket_bytes`
    (a tensor larger than the budget gets a bucket of its own). Same order on every rank of the group."""
    from tripod.parallel.convert import family_of

    units: dict[str, list[str]] = {}  # tensors SGLang must receive in the same call stay in one bucket
    for name in sorted(shard):
        units.setdefault(_MLA_A_PROJ.sub(".<a_proj>.", name), []).append(name)
    buckets: list[list[str]] = [[]]
    size = 0
    for names in units.values():
        nbytes = 0
        for name in names:
            t = shard[name]
            nbytes += t.element_size() * int(torch.Size(family_of(arch).shape(arch, name)).numel()) \
                if tp_size > 1 else t.numel() * t.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].extend(names)
        size += nbytes
    return [b for b in buckets if b]


# SGLang's DeepSeek loader fuses q_a_proj with kv_a_proj_with_mqa (fused_qkv_a_proj_with_mqa) inside ONE load_weights
# call in the versions that keep the half it has seen in a per-call dict (`cached_a_proj = {}`), so a layer's two
# down projections must travel in the same bucket.
_MLA_A_PROJ = re.compile(r"\.linear_(?:q|kv)_down_proj\.")


def gather_bucket_full(arch: ModelArch, names: list[str], shard: dict[str, torch.Tensor], tp_group: Any,
                       tp_size: int) -> list[tuple[str, torch.Tensor]]:
    """[(HF name, full tensor)] of one bucket on EVERY rank of the rollout TP group (all-gather, then merge)."""
    from tripod.parallel.convert import family_of, megatron_to_hf

    out: list[tuple[str, torch.Tensor]] = []
    for name in names:
        local = shard[name].contiguous()
        if tp_size > 1:
            parts = [torch.empty_like(local) for _ in range(tp_size)]
            dist.all_gather(parts, local, group=tp_group)
        else:
            parts = [local]
        full = family_of(arch).merge(arch, name, parts)
        out.extend((hf, t.contiguous()) for hf, t in megatron_to_hf(arch, name, full))
    return out


def flatten_by_dtype(named: list[tuple[str, torch.Tensor]]) -> dict[torch.dtype, tuple[torch.Tensor, list[dict]]]:
    """{dtype: (one flat tensor, [{name, shape, dtype, start_idx, end_idx, numel}])} — the layout of SGLang's
    FlattenedTensorBucket metadata, so the receiver rebuilds each tensor as a view of the flat one."""
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        groups.setdefault(t.dtype, []).append((name, t))
    out = {}
    for dtype, items in groups.items():
        flat = torch.cat([t.reshape(-1) for _, t in items])
        meta, start = [], 0
        for name, t in items:
            meta.append(dict(name=name, shape=tuple(t.shape), dtype=dtype, start_idx=start,
                             end_idx=start + t.numel(), numel=t.numel()))
            start += t.numel()
        out[dtype] = (flat, meta)
    return out


def unflatten(flat: torch.Tensor, meta: list[dict]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of one `flatten_by_dtype` group (views into `flat`)."""
    return [(m["name"], flat[m["start_idx"]:m["end_idx"]].view(m["shape"])) for m in meta]
