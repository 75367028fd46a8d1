"""The SGLang backend's weight push, bucket by bucket (engine/rollout/sglang_engine.py calls it every PPO step).

SGLang's loaders take full HF tensors and shard them themselves, so, as slime's `update_weights_from_tensor` path
does, the generation shard is cut into buckets (`hf_buckets`: each bucket's FULL size under the budget), each bucket's
tensors are all-gathered over the rollout TP group and merged to HF tensors (`gather_bucket_full`: every rank holds
at most one bucket of full tensors, never the whole model on one rank), flattened into one tensor per dtype
(`flatten_by_dtype`: an fp32 router expert bias stays fp32 beside bf16 weights), and each rank hands its own flattened
bucket to the SGLang TP worker on its GPU (CUDA IPC handles, gathered to the group's first rank).
"""
from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist

from tripod.parallel.arch import ModelArch


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
