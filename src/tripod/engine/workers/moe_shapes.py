"""One micro-batch shape over the ranks whose MoE layers exchange tokens.

megatron's allgather token dispatcher (MoEAllGatherTokenDispatcher.token_dispatch, megatron-core 0.16.1) gathers
every rank's [tokens, hidden] over its `tp_ep_group` (expert tensor x expert model parallel ranks) with an
all_gather of equal-size parts: the ranks of that group run each micro-batch at the same [rows, seq], and the same
number of micro-batches. Those ranks belong to different DP ranks (EP > 1), whose micro-batches hold other rows and
pack to other shapes (shared-prompt or padding-free packing lays out each rank's rows by their own prompts and
lengths), so a call agrees on its shape first: `uniform_shapes` takes the largest rows and seq of every micro-batch
over the group (one all_reduce MAX), and refuses in one line on every rank when the micro-batch counts differ.
`with_rows` pads a micro-batch's model rows up to the agreed count: a packed layout gains rows of pad ids, each
slot seeing only itself; plain rows become the same rows as a layout (`plain_layout`: causal mask, positions
0..S-1, the output slots they read) plus those pad rows. No loss or head reads a pad row or slot (`gather` never
points there), so log-probs, losses and gradients are the unpadded ones; pad tokens do pass the routers, as the
seq padding of plain rows always did (MegatronWorker.can_pack keeps packing off when routers keep token statistics).

`agreed_count` does the same for a token budget's micro-batch count (ppo_workers._token_budget_microbatches): the
group runs the largest count any of its ranks needs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tripod.engine.workers.batch import PPOBatch
from tripod.engine.workers.packing import PackedRows


def token_exchange_group(layout, moe: bool):
    """The group megatron's MoE dispatcher gathers tokens over (tp_ep), or None where it is one rank / no MoE."""
    if not moe or layout.ep * layout.etp == 1:
        return None
    return layout.pg_collection.tp_ep


def uniform_shapes(mbs: list[PPOBatch], packs: list, seqs: list[int], layout, device: torch.device
                   ) -> tuple[list, list[int], int | None]:
    """(packs, seqs, rows): every micro-batch of the call at one [rows, seq], agreed over the token-exchange group;
    rows None where nothing needs equal rows (one rank exchanges tokens, one pipeline stage).

    At PP > 1 micro-batches whose packed row counts differ run as plain rows (pipeline stages exchange [S, rows, H]
    and megatron's variable_seq_lengths varies the sequence only)."""
    rows_of = [p.input_ids.shape[0] if p is not None else mb.size for p, mb in zip(packs, mbs)]
    if layout.pp > 1 and len(set(rows_of)) > 1:
        packs = [None] * len(mbs)
        seqs = [mb["input_ids"].shape[1] for mb in mbs]
        rows_of = [mb.size for mb in mbs]
    rows, seq = max(rows_of), max(seqs)
    group = token_exchange_group(layout, True)
    if group is not None:
        rows, seq = _agree(group, layout, device, len(mbs), rows, seq)
    return packs, [seq] * len(mbs), rows if group is not None or layout.pp > 1 else None


def with_rows(mb: PPOBatch, rows: int | None) -> PackedRows | None:
    """The packed layout (None: plain rows) `mb` runs as, grown to `rows` model rows (module docstring)."""
    packed = mb.packed
    have = packed.input_ids.shape[0] if packed is not None else mb.size
    if rows is None or have >= rows:
        return packed
    packed = packed if packed is not None else plain_layout(mb)
    if packed.cu_seqlens is not None:
        raise ValueError("a THD layout is one model row; it cannot take pad rows")
    extra, seq = rows - have, packed.seq
    ids = torch.nn.functional.pad(packed.input_ids, (0, 0, 0, extra))
    alone = ~torch.eye(seq, dtype=torch.bool, device=packed.mask.device)  # a pad slot sees itself only
    mask = torch.cat([packed.mask, alone.expand(extra, 1, seq, seq)])
    positions = packed.positions
    if positions.dim() == 2:
        positions = torch.cat([positions, torch.arange(seq, device=positions.device).expand(extra, seq)])
    return PackedRows(ids, mask, positions, packed.gather)


def plain_layout(mb: PPOBatch) -> PackedRows:
    """`mb`'s plain rows (already padded to their run length) as a packed layout: what run() does for plain rows."""
    ids = mb["input_ids"]
    n, seq = ids.shape
    causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).triu(1)
    rows = torch.arange(n, device=ids.device)[:, None]
    return PackedRows(ids, causal.expand(n, 1, seq, seq), torch.arange(seq, device=ids.device),
                      rows * seq + mb.response_positions().to(ids.device))


def agreed_count(layout, moe: bool, count: int, device: torch.device) -> int:
    """The largest of `count` over the token-exchange group (`count` itself where there is none)."""
    group = token_exchange_group(layout, moe)
    if group is None:
        return count
    t = torch.tensor([count], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def _agree(group, layout, device: torch.device, count: int, rows: int, seq: int) -> tuple[int, int]:
    t = torch.tensor([rows, seq, count, -count], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    most, fewest = int(t[2]), -int(t[3])
    if most != fewest:
        raise ValueError(
            f"{layout.name}: this call runs {count} micro-batches on this rank and {fewest}..{most} over the ranks "
            f"that exchange tokens in the MoE layers (expert_model_parallel_size={layout.ep} x "
            f"expert_tensor_parallel_size={layout.etp}); megatron's token dispatcher needs the same count on each: "
            "give every DP rank the same rows per micro-batch (ppo_micro_batch_size_per_gpu divides the rows per rank)")
    return int(t[0]), int(t[1])
