"""Merged weights for the rollout, made lazily: W + alpha / rank * B @ A of an adapted weight is computed only when the
hybrid engine's transport reads it (parallel/hybrid_engine/transport.py `read_into`), one row chunk of at most a
bucket at a time, and dropped as soon as the chunk is copied into its bucket or the generation shard.

`merged_shard` wraps every adapted weight of this rank's training shard in a `MergedWeight`. Reading a slice:

    delta = adapter.local_delta_weight()          # the whole tensor's, computed shard-locally (a column-parallel B's
                                                  # rows times the replicated A; a row-parallel B times this shard's
                                                  # columns of A); kept until the transport reads another tensor
    chunk = float32(W[rows]) + float32(delta[rows])   # <= one bucket of fp32, a fresh tensor (never the parameter)
    dst[rows] = chunk rounded once to W's dtype       # then cast to the rollout dtype as every weight is

so the values are those an eager merge of the whole tensor gives, bit for bit, and a rank never holds a second copy
of its shard's adapted weights: at most one tensor's delta plus one chunk (`merge_peak_bytes`, the memory plan's
`lora_merged`). The delta is not computed per chunk because a matmul of another shape rounds differently (BLAS and
cuBLAS choose kernels by shape), and the merged values must not depend on the bucket size.

`MergeStats` measures what is alive: every merged chunk and delta is counted until Python frees it
(`weakref.finalize`), so a caller that keeps merged tensors shows up in the peak (tests/multiprocess/test_lora_sync.py).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from tripod.parallel.lora.apply import lora_adapters


@dataclass
class MergeStats:
    """Bytes of merged chunks (W + delta, in fp32 and rounded) and of deltas alive during one sync, and their peaks."""

    merged_live: int = 0
    merged_peak: int = 0
    delta_live: int = 0
    delta_peak: int = 0
    merged_total: int = 0  # every merged byte produced (a tensor read twice counts twice)

    def track(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        n = t.numel() * t.element_size()
        live = getattr(self, f"{kind}_live") + n
        setattr(self, f"{kind}_live", live)
        setattr(self, f"{kind}_peak", max(getattr(self, f"{kind}_peak"), live))
        if kind == "merged":
            self.merged_total += n
        weakref.finalize(t, self._free, kind, n)
        return t

    def _free(self, kind: str, n: int) -> None:
        setattr(self, f"{kind}_live", getattr(self, f"{kind}_live") - n)


def chunk_numel(bucket_bytes: int) -> int:
    """Elements of one merged chunk: its fp32 sum is at most one bucket."""
    return max(1, bucket_bytes // 4)


def merge_peak_bytes(largest_numel: int, dtype: torch.dtype, bucket_bytes: int) -> int:
    """The most the lazy merge holds at once on a rank whose largest adapted weight has `largest_numel` elements of
    `dtype`: while `local_delta_weight` runs, its parts' product and the combined, scaled delta (2 x the tensor);
    afterwards the delta plus one chunk's fp32 sum and, for a 16-bit weight, its rounded copy."""
    e = torch.empty((), dtype=dtype).element_size()
    chunk = min(largest_numel, chunk_numel(bucket_bytes))
    return largest_numel * e + max(largest_numel * e, chunk * (4 + (e if e != 4 else 0)))


class _DeltaCache:
    """The delta of the adapter read last (one at a time: the previous one is freed before the next is made)."""

    def __init__(self, stats: MergeStats):
        self.stats, self.adapter, self.delta = stats, None, None

    def get(self, adapter) -> torch.Tensor:
        if self.adapter is not adapter:
            self.adapter, self.delta = None, None
            self.delta = self.stats.track(adapter.local_delta_weight().detach(), "delta")
            self.adapter = adapter
        return self.delta


class MergedWeight:
    """One adapted weight of the training shard, merged when read; has the weight's shape, dtype and device."""

    def __init__(self, weight: torch.Tensor, adapter, cache: _DeltaCache, max_chunk: int):
        self.weight, self.adapter, self.cache, self.max_chunk = weight, adapter, cache, max_chunk
        self.shape, self.dtype, self.device = weight.shape, weight.dtype, weight.device

    def copy_into(self, slices: tuple[slice, ...], dst: torch.Tensor) -> None:
        """dst <- merged weight[slices], in row chunks of at most `max_chunk` elements."""
        slices = self._full(slices)
        start, stop, _ = slices[0].indices(self.weight.shape[0])
        rows = stop - start
        if rows <= 0:
            return
        step = max(1, self.max_chunk // max(1, dst.numel() // rows))
        for a in range(0, rows, step):
            b = min(rows, a + step)
            dst[a:b].copy_(self._merge((slice(start + a, start + b),) + slices[1:]))

    def __getitem__(self, slices) -> torch.Tensor:
        """The merged values of `slices` as one new tensor (in one piece: for checks, not the transport)."""
        return self._merge(self._full(slices if isinstance(slices, tuple) else (slices,)))

    def _full(self, slices: tuple[slice, ...]) -> tuple[slice, ...]:
        return tuple(slices) + (slice(None),) * (self.weight.dim() - len(slices))

    def _merge(self, slices: tuple[slice, ...]) -> torch.Tensor:
        with torch.no_grad():
            delta = self.cache.get(self.adapter)[slices]
            total = self.cache.stats.track(self.weight[slices].to(torch.float32, copy=True), "merged")
            total += delta  # float32(W) + float32(delta), on the fresh copy
            out = total.to(self.weight.dtype)
            return out if out is total else self.cache.stats.track(out, "merged")


def merged_shard(model, shard: dict[str, torch.Tensor], names_of: dict[int, str], bucket_bytes: int,
                 stats: MergeStats | None = None) -> dict[str, torch.Tensor | MergedWeight]:
    """`shard` ({global name: this rank's weight}) with every adapted weight replaced by a `MergedWeight` (merged in
    chunks whose fp32 sum is at most `bucket_bytes`); `names_of`: id(parameter) -> its global name
    (parallel.convert.global_params)."""
    from tripod.parallel.convert import model_chunks

    cache = _DeltaCache(stats if stats is not None else MergeStats())
    for adapter in lora_adapters(model_chunks(model)):
        name = names_of.get(id(adapter.base_weight[0]))
        if name in shard:
            shard[name] = MergedWeight(shard[name], adapter, cache, chunk_numel(bucket_bytes))
    return shard
