"""The memory plan's LoRA side (parallel/memory_plan.py): the adapter parameters one rank holds and the base weights
the rollout sync merges into new tensors, from the architecture, the layout and `model.lora` alone.

Adapter shapes are `LoraAdapter`'s (parallel/lora/adapter.py), one (A, B) pair per adapted HF part of a fused linear,
for a part of `rows` output rows of a linear of `in` input features, at rank r and (expert) TP t:

    column-parallel (linear_qkv, linear_fc1, MLA's projections): A [r, in] replicated, B [rows / t, r]
    row-parallel    (linear_proj, linear_fc2):                  A [r, in / t],          B [rows, r] replicated

so a rank holds r * (in + rows / t) or r * (in / t + rows) per part, in every adapted linear of its stage's layers,
and in each of its num_experts / EP experts of a routed-expert linear (t: the expert TP size there). The targets are
resolved as `apply_lora` resolves them (`resolve_targets`). With LoRA on, the rollout gets W + scale * B @ A, merged
lazily as the transport packs it (parallel/lora/merge.py): what that holds at once follows from the largest adapted
weight (`largest` below; `merge_peak_bytes`), not from all of them (`merged`: their numel, what the sync merges).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tripod.parallel.arch import ModelArch
from tripod.parallel.hybrid_engine.plan import actor_param_specs, local_shape
from tripod.parallel.lora.targets import LinearTarget, family_linears, resolve_targets

_EXPERT = re.compile(r"local_experts\.\d+\.")


@dataclass(frozen=True)
class LoraStage:
    """One rank's LoRA numbers on one PP stage: adapter parameters (dense, routed-expert), the numel of the
    adapted base weights the sync merges (dense + its experts) and of the largest of them."""

    adapters: int
    expert_adapters: int
    merged: int
    largest: int = 0


def part_adapter_numel(target: LinearTarget, part_rows: int, rank: int, tp: int) -> int:
    """Elements of one part's A and B on one rank (`tp`: the linear's TP size, expert TP for an expert)."""
    in_features = target.shape[1]
    if target.row_parallel:
        return rank * (in_features // tp) + part_rows * rank
    return rank * in_features + (part_rows // tp) * rank


def lora_stage_numel(arch: ModelArch, rank: int, target_modules, exclude_modules=(), *, tp: int, pp: int,
                     ep: int = 1, etp: int | None = None, first: int | None = None, last: int | None = None,
                     key: str = "model.lora") -> list[LoraStage]:
    """Per PP stage, what one rank of that stage holds of LoRA (expert counts already this rank's 1/ep share)."""
    chosen = resolve_targets(arch, list(target_modules), list(exclude_modules), key)
    linears = family_linears(arch)
    dense, experts, merged, merged_experts, largest = [0] * pp, [0] * pp, [0] * pp, [0] * pp, [0] * pp
    for spec in actor_param_specs(arch, tp, pp, first=first, last=last):
        if not spec.name.startswith("decoder.layers.") or not spec.name.endswith(".weight"):
            continue
        in_layer = spec.name.split(".", 3)[3][: -len(".weight")]  # `self_attention.linear_qkv`
        path = _EXPERT.sub("local_experts.{e}.", in_layer + ".")[:-1]  # as apply_lora names an expert's linear
        if path not in chosen:
            continue
        target = linears[path]
        t = (etp or tp) if spec.expert is not None else tp
        rows = dict(zip(target.parts, target.rows()))
        numel = sum(part_adapter_numel(target, rows[p], rank, t) for p in chosen[path])
        weight = 1
        for d in local_shape(spec, t):
            weight *= int(d)
        largest[spec.stage] = max(largest[spec.stage], weight)
        if spec.expert is not None:
            experts[spec.stage] += numel
            merged_experts[spec.stage] += weight
        else:
            dense[spec.stage] += numel
            merged[spec.stage] += weight
    if any(x % ep for x in experts + merged_experts):
        raise ValueError(f"expert_model_parallel_size={ep} must divide the number of experts")
    return [LoraStage(d, x // ep, m + mx // ep, big)
            for d, x, m, mx, big in zip(dense, experts, merged, merged_experts, largest)]


def value_head_numel(arch: ModelArch) -> int:
    """The critic's value head, trained in full beside its adapters (apply_lora's `keep_trainable`)."""
    return arch.hidden_size + (0 if arch.score_head else 1)
