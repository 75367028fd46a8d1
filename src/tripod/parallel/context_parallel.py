"""Context parallelism (CP): the ranks of a CP group each run a part of every sequence of a micro-batch.

This module owns the sequence split, the core attention that lets a rank's queries see the whole sequence, and the
two collectives that put per-token results back together.

Split: megatron's load-balanced one (`get_batch_on_this_cp_rank`): the (padded) sequence of S slots is cut into 2*cp
chunks of S / (2*cp) and CP rank r holds chunks r and 2*cp-1-r, in that order (so every rank holds as many early,
cheap, as late, expensive causal rows). `local_slots` gives those slot indices; a rank runs the model on
input_ids[:, local_slots] with the RoPE positions of those slots (parallel/megatron_patches/gpt_model.py's
`rope_with_slot_positions`) and the rows `local_slots` of the [.., S, S] attention mask (queries local, keys global).

Attention: `ContextParallelAttention` (a subclass of whichever core attention the local spec uses: tripod's SDPA one,
parallel/sdpa_attention.py, on every device) all-gathers K and V over the CP group and reorders them into
global slot order: megatron's cp_comm_type="all_gather" semantics. The gather's backward all-reduces the K / V
gradient over the CP group and keeps this rank's slice (gloo has no reduce-scatter). That is the CPU / test path:
where Transformer Engine runs (installed, CUDA), parallel/model.py builds TE's layer spec with
context_parallel_size=cp and TE's own CP attention (ring by default) instead, which takes no mask
(docs/context_parallel.md). On the local spec the TransformerConfig keeps context_parallel_size=1 (megatron's local
attention refuses anything else) while the model's process-group collection carries the real CP group (megatron's
schedules split the activation shape by it and multiply the loss by its size; DDP and the optimizer reduce over
dp x cp).

Heads: a rank computes log-probs / values for the response tokens whose predicting position it holds; `sum_over_cp`
adds the zero-filled [N, R] tensors of the CP ranks (each token is held by exactly one), with an identity backward:
every CP rank then computes the same loss from the same full tensor, and each rank's gradient flows only into the
tokens it holds. Summed over dp x cp by DDP (and scaled back by the schedule's x cp), the gradient is CP1's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def padded_length(seq: int, cp: int, tp_sp: int = 1) -> int:
    """The sequence length a CP micro-batch runs: `seq` rounded up to a multiple of 2*cp (x tp with sequence
    parallelism, which splits each rank's part over TP). Right padding: real tokens never attend to it."""
    unit = 2 * cp * tp_sp
    return -(-seq // unit) * unit


def local_slots(seq: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Slot indices CP rank `rank` holds of a sequence of `seq` slots (chunks rank and 2*cp-1-rank of 2*cp)."""
    if seq % (2 * cp):
        raise ValueError(f"a sequence of {seq} slots does not split into 2*context_parallel_size={2 * cp} chunks")
    chunk = seq // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk, device=device),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)])


def global_order(seq: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Index that turns the CP ranks' parts, concatenated in rank order, into global slot order."""
    return torch.argsort(torch.cat([local_slots(seq, cp, r) for r in range(cp)])).to(device)


def held_positions(flat: torch.Tensor, seq: int, cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For global flat indices row * seq + slot: (held by this CP rank [bool], index into the rank's flattened
    [rows, seq / cp] output). The second is meaningful where the first is True."""
    chunk = seq // (2 * cp)
    row, slot = flat // seq, flat % seq
    part = slot // chunk
    held = (part == rank) | (part == 2 * cp - 1 - rank)
    local = slot % chunk + chunk * (part != rank).long()
    return held, row * (seq // cp) + local


def split_for_cp(input_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor | None, cp: int,
                 rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This CP rank's part of a micro-batch of S slots: input_ids [b, S] -> [b, S/cp], RoPE positions [S] or
    [b, S] -> [.., S/cp], boolean attention mask [b or 1, 1, S, S] -> [.., S/cp, S] (queries local, keys global);
    None stays None (Transformer Engine's CP attention: causal from its mask type)."""
    slots = local_slots(input_ids.shape[1], cp, rank, input_ids.device)
    mask = None if attention_mask is None else attention_mask[:, :, slots.to(attention_mask.device), :]
    return input_ids[:, slots], positions[..., slots.to(positions.device)], mask


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over `group` (rank order); backward: all-reduce the gradient, keep this rank's rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        ctx.group, ctx.rows, ctx.rank = group, x.shape[0], dist.get_rank(group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[S / cp, ...] parts of this CP group -> [S, ...] in global slot order (autograd-aware, see _GatherSequence)."""
    cp = dist.get_world_size(group)
    full = _GatherSequence.apply(x, group)
    return full.index_select(0, global_order(full.shape[0], cp, full.device))


class _SumOverCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def sum_over_cp(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of the CP ranks' zero-filled per-token tensors; the gradient passes through unchanged (module docstring)."""
    return _SumOverCP.apply(x, group)


def _cp_attention_class(base: type) -> type:
    class ContextParallelAttention(base):  # type: ignore[misc, valid-type]
        """Core attention of a CP rank: local queries, K / V all-gathered over the CP group into global slot order;
        the attention mask arrives as [.., S / cp, S] (rows: this rank's slots)."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            group = self.pg_collection.cp
            if group is not None and dist.get_world_size(group) > 1:
                if packed_seq_params is not None or attention_mask is None:
                    raise RuntimeError("context parallel attention needs an explicit [.., S/cp, S] attention mask "
                                       "and no packed_seq_params")
                key, value = gather_sequence(key, group), gather_sequence(value, group)
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)

    ContextParallelAttention.__name__ = f"ContextParallel{base.__name__}"
    return ContextParallelAttention


_CLASSES: dict[type, type] = {}


def is_allgather_cp(core_attention) -> bool:
    """Whether a core-attention module is tripod's all-gather CP attention (`use_cp_core_attention`)."""
    return type(core_attention) in _CLASSES.values()


def use_cp_core_attention(spec) -> None:
    """Wrap the core attention of every layer of a local spec (one layer spec or a decoder block spec) in
    `ContextParallelAttention`."""
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = layer.submodules.self_attention.submodules
        base = attention.core_attention
        if base not in _CLASSES:
            _CLASSES[base] = _cp_attention_class(base)
        attention.core_attention = _CLASSES[base]


def check_cp_config(arch, sections: list[tuple[str, object]]) -> None:
    """Preflight: refuse a `{key}.megatron` section whose context_parallel_size cannot run with `arch`, before any
    model is built (one line naming the key and the fix)."""
    for key, m in sections:
        cp = getattr(m, "context_parallel_size", 1)
        if cp > 1:
            check_cp_model(f"{key}.megatron.", cp, arch, str(getattr(m, "use_te", "auto")).strip().lower() == "true")


def check_cp_model(name: str, cp: int, arch, use_te: bool) -> None:
    """Refuse what context parallelism does not run (one line naming the key and the fix). `use_te`: the model is
    asked to run Transformer Engine's CP attention (`use_te=true`), which needs TE and CUDA here."""
    if cp == 1:
        return
    key = f"{name}context_parallel_size={cp}" if name.endswith(".") else f"{name} context_parallel_size={cp}"
    if getattr(arch, "moe", None) is not None or getattr(arch, "mla", None) is not None:
        raise ValueError(f"{key}: {arch.family} is an MoE / MLA model; context parallelism runs dense models only "
                         "(untested there); set it to 1")
    if use_te:
        from tripod.parallel.model import uses_transformer_engine

        if not uses_transformer_engine():
            raise ValueError(f"{key} with use_te=true runs Transformer Engine's CP attention, which needs TE and "
                             "CUDA (not both here); set use_te=auto (tripod's all-gather CP without TE) or false")
