"""Merged weights for the rollout: W + alpha / rank * B @ A of every adapted linear, on this rank's training shard.

The delta is computed shard-locally (the adapter's `local_delta_weight`: a column-parallel B's rows of this shard
times the replicated A, a row-parallel B times this shard's columns of A), in float32 and rounded once to the
weight's dtype, so no rank gathers anything the base weight's shard does not already hold. The hybrid engine then
reshards the merged tensors like the base ones (parallel/hybrid_engine/engine.py's `train_shard_from_model`).
Each merged tensor is a new one: while it lives, a rank holds the adapted weights of its shard twice.
"""
from __future__ import annotations

import torch

from tripod.parallel.lora.apply import lora_adapters


def merge_into_shard(model, shard: dict[str, torch.Tensor], names_of: dict[int, str]) -> dict[str, torch.Tensor]:
    """`shard` ({global name: this rank's weight}) with every adapted weight replaced by its merged copy;
    `names_of`: id(parameter) -> its global name (from parallel.convert.global_params)."""
    from tripod.parallel.convert import model_chunks

    with torch.no_grad():
        for adapter in lora_adapters(model_chunks(model)):
            name = names_of.get(id(adapter.base_weight[0]))
            if name in shard:
                w = shard[name]
                shard[name] = (w.float() + adapter.local_delta_weight().float()).to(w.dtype)
    return shard
