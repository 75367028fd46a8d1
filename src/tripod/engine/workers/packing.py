"""Shared-prompt packing: the rows of a micro-batch that share a prompt run that prompt through the model once.

GRPO / RLOO batches hold n responses per prompt. Causal attention makes the prompt's hidden states independent
of what follows it, so the n copies of the prompt in n rows compute the same thing n times (for SmolLM2 GRPO,
8 prompts x 4 samples: ~80% of the tokens are prompt). Packing lays each group of rows with the same prompt out as
one model row

    [pad ... pad | prompt (P tokens) | response 1 (R slots) | response 2 | ... | response k]

with an explicit attention mask (each response block sees the group's real prompt tokens and itself, causally; pad
keys are never visible) and RoPE positions per slot (prompt slot s -> s, slot t of every response block ->
P_max + t). Attention with RoPE depends only on position differences, so every token sees exactly the keys and
relative positions it sees in its own unpacked row (whose positions are a constant shift of these): the log-probs,
values and gradients are the unpacked ones up to float rounding (the prompt's gradient is the sum over its
responses, summed in another order). tests/multiprocess/test_packing.py checks that against the unpacked model.

`PackedRows.gather` maps every original row's response token t to the flat index (packed row * S + slot) of the
output that predicts it, so the heads (log-probs from the hidden state, values) read the same positions as before.
Padding-free packing (`pack_without_padding`, verl's use_remove_padding) goes further: each unit (a prompt with its
responses when prompts are shared, else one row) is laid out without padding, `prompt | response 1 | response 2 ...`,
each response exactly as long as it is, at the positions of its own unpacked row (prompt 0..P-1, response P..), and
several units share a model row, first-fit by decreasing length into rows as long as the longest unit: a
block-diagonal mask keeps the units apart. Rows only pad at their tails. The positions are then per row, [G, S].

Works with the local (non-Transformer-Engine) spec's core attention (tripod's SDPA one, parallel/sdpa_attention.py,
or megatron's for MLA), which applies an arbitrary mask; the worker turns it off elsewhere (see
MegatronWorker.can_pack). Transformer Engine takes no mask but sequences packed in THD format: `pack_thd` lays
every row out without padding in one model row and gives the `cu_seqlens` that megatron's `PackedSeqParams` carries
(parallel/model.py's `packed_seq_params`); a THD sequence sees only itself, so there the prompts are not shared.
That path is built and unit-tested on CPU only (tests/unit/test_thd_packing.py): the TE forward itself has not run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tripod.engine.workers.batch import PPOBatch
from tripod.parallel.response_span import response_span


@dataclass
class PackedRows:
    input_ids: torch.Tensor   # [G, S] token ids (pad slots hold the pad id)
    mask: torch.Tensor | None  # [G, 1, S, S] bool, True = masked (megatron's convention); None for THD
    positions: torch.Tensor   # [S] RoPE position of each slot, the same for every packed row; or [G, S] per row
    gather: torch.Tensor      # [N, R] flat index (packed row * S + slot) of the output predicting response token t
    cu_seqlens: torch.Tensor | None = None  # THD (`pack_thd`): [sequences + 1] int32 offsets in the one model row

    @property
    def seq(self) -> int:
        return self.input_ids.shape[1]

    def padded_to(self, seq: int) -> "PackedRows":
        """The same packing with S grown to `seq` (extra slots: pad ids, masked as keys, at positions S...)."""
        g, s = self.input_ids.shape
        if s == seq:
            return self
        extra = seq - s
        ids = torch.nn.functional.pad(self.input_ids, (0, extra))
        mask = None
        if self.mask is not None:
            mask = torch.ones(g, 1, seq, seq, dtype=torch.bool, device=self.mask.device)
            mask[:, :, :s, :s] = self.mask
            pad = torch.arange(s, seq, device=mask.device)  # index on the mask's device (a host index syncs)
            mask[:, :, pad, pad] = False  # a pad query sees itself (no empty row)
        tail = torch.arange(s, seq, device=self.positions.device)
        positions = torch.cat([self.positions, tail.expand(*self.positions.shape[:-1], extra)], dim=-1)
        # THD: the added slots are one more sequence of their own (it sees only itself; its outputs are never read)
        cu = None if self.cu_seqlens is None else torch.cat([self.cu_seqlens, self.cu_seqlens.new_full((1,), seq)])
        rows = self.gather // s
        return PackedRows(ids, mask, positions, rows * seq + self.gather % s, cu)


def prompt_groups(mb: PPOBatch) -> list[list[int]]:
    """Rows grouped by identical prompt (same length and tokens), groups in order of first appearance."""
    ids, lens = mb["input_ids"], mb["prompt_lens"].tolist()
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(lens):
        groups.setdefault(tuple(ids[i, :p].tolist()), []).append(i)
    return list(groups.values())


def pack_shared_prompts(mb: PPOBatch, pad_id: int = 0) -> PackedRows | None:
    """The packed layout of `mb`, or None when no two rows share a prompt (nothing to save)."""
    groups = prompt_groups(mb)
    if len(groups) == mb.size:
        return None
    ids, lens, resp = mb["input_ids"], mb["prompt_lens"], mb["responses"]
    dev = ids.device
    resp_lens = response_span(mb["response_mask"])
    r_all = resp.shape[1]
    width = max(int(resp_lens.max()), 1)           # response slots per block: the longest response
    p_max = int(lens.max())
    k_max = max(len(g) for g in groups)
    seq = p_max + k_max * width
    n_groups = len(groups)

    input_ids = torch.full((n_groups, seq), pad_id, dtype=ids.dtype, device=dev)
    key_ok = torch.zeros(n_groups, seq, dtype=torch.bool, device=dev)     # real token in this slot
    block = torch.full((seq,), -1, dtype=torch.long, device=dev)          # response block of a slot (-1: prompt)
    block[p_max:] = torch.arange(k_max, device=dev).repeat_interleave(width)
    t_in_block = torch.zeros(seq, dtype=torch.long, device=dev)
    t_in_block[p_max:] = torch.arange(width, device=dev).repeat(k_max)
    gather = torch.empty(mb.size, r_all, dtype=torch.long, device=dev)
    t = torch.arange(r_all, device=dev)
    for g, rows in enumerate(groups):
        p = int(lens[rows[0]])
        input_ids[g, p_max - p:p_max] = ids[rows[0], :p]
        key_ok[g, p_max - p:p_max] = True
        for j, i in enumerate(rows):
            start = p_max + j * width
            n_resp = int(resp_lens[i])
            input_ids[g, start:start + n_resp] = resp[i, :n_resp]
            key_ok[g, start:start + n_resp] = True
            # token 0 is predicted by the last prompt slot, token t > 0 by slot t - 1 of the block; tokens past
            # the block (padding of `responses`, masked in every loss) read the block's last slot
            slot = torch.where(t == 0, torch.full_like(t, p_max - 1), start + (t - 1).clamp(max=width - 1))
            gather[i] = g * seq + slot

    q_block, k_block = block[:, None], block[None, :]
    slots = torch.arange(seq, device=dev)
    causal = slots[None, :] <= slots[:, None]
    same_block = (q_block == k_block) & (q_block >= 0)
    sees = (k_block < 0) | same_block                                     # prompt keys, or its own block
    visible = causal[None] & sees[None] & key_ok[:, None, :]
    visible |= torch.eye(seq, dtype=torch.bool, device=dev)[None]         # no query row is empty
    positions = torch.where(block < 0, slots, p_max + t_in_block)
    return PackedRows(input_ids, ~visible[:, None], positions, gather)


def first_fit_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Unit indices per row: first fit by decreasing length into rows of `capacity` slots (ties in input order)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for u in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        g = next((g for g, room in enumerate(free) if room >= lengths[u]), None)
        if g is None:
            rows.append([])
            free.append(capacity)
            g = len(rows) - 1
        rows[g].append(u)
        free[g] -= lengths[u]
    return rows


def pack_without_padding(mb: PPOBatch, share_prompts: bool, pad_id: int = 0) -> PackedRows | None:
    """The padding-free layout of `mb` (module docstring): units are prompt groups (`share_prompts`) or single rows,
    each `prompt | its responses at their own lengths`, packed several to a model row. None when every unit would
    sit alone in its row and no prompt is shared (the plain rows, trimmed, are the same thing)."""
    groups = prompt_groups(mb) if share_prompts else [[i] for i in range(mb.size)]
    unit_lens = _unit_lengths(mb, groups)
    seq = max(max(unit_lens), 1)
    rows = first_fit_rows(unit_lens, seq)
    if len(rows) == mb.size:
        return None
    return _lay_out(mb, groups, unit_lens, rows, seq, pad_id)


def pack_thd(mb: PPOBatch, pad_id: int = 0, with_mask: bool = False) -> PackedRows:
    """Transformer Engine's THD layout of `mb`: every row (`prompt | response`, no padding) one after the other in
    ONE model row [1, T], in row order, and `cu_seqlens` [rows + 1], the offset of each row's tokens: what megatron's
    `PackedSeqParams(qkv_format="thd")` carries (parallel/model.py, `packed_seq_params`). Each row attends causally
    to itself alone and takes RoPE positions 0..len-1, as megatron's THD path does from cu_seqlens; prompts are not
    shared (a sequence of THD sees only itself). `with_mask`: also the equivalent block-diagonal mask (tests)."""
    groups = [[i] for i in range(mb.size)]
    unit_lens = _unit_lengths(mb, groups)
    out = _lay_out(mb, groups, unit_lens, [list(range(mb.size))], max(sum(unit_lens), 1), pad_id, with_mask)
    lens = torch.tensor(unit_lens, dtype=torch.int32, device=out.input_ids.device)
    out.cu_seqlens = torch.cat([lens.new_zeros(1), lens.cumsum(0, dtype=torch.int32)])
    return out


def _unit_lengths(mb: PPOBatch, groups: list[list[int]]) -> list[int]:
    """Tokens of each unit: its prompt once plus each of its responses at its own length."""
    lens, resp_lens = mb["prompt_lens"].tolist(), response_span(mb["response_mask"]).tolist()
    return [lens[u[0]] + sum(resp_lens[i] for i in u) for u in groups]


def _lay_out(mb: PPOBatch, groups: list[list[int]], unit_lens: list[int], rows: list[list[int]], seq: int,
             pad_id: int = 0, with_mask: bool = True) -> PackedRows:
    """Units `groups` (lengths `unit_lens`) laid out without padding in model rows of `seq` slots, row g holding
    the units `rows[g]` in that order (module docstring); the block-diagonal mask unless `with_mask` is off."""
    ids, lens, resp = mb["input_ids"], mb["prompt_lens"].tolist(), mb["responses"]
    resp_lens = response_span(mb["response_mask"]).tolist()
    dev, r_all = ids.device, resp.shape[1]
    n_rows = len(rows)
    input_ids = torch.full((n_rows, seq), pad_id, dtype=ids.dtype, device=dev)
    positions = torch.zeros(n_rows, seq, dtype=torch.long, device=dev)
    unit = torch.full((n_rows, seq), -1, dtype=torch.long, device=dev)   # which unit a slot holds (-1: tail pad)
    block = torch.full((n_rows, seq), -1, dtype=torch.long, device=dev)  # response block in its unit (-1: prompt)
    gather = torch.empty(mb.size, r_all, dtype=torch.long, device=dev)
    t = torch.arange(r_all, device=dev)
    for g, members in enumerate(rows):
        at = 0
        for u in members:
            first, p = groups[u][0], lens[groups[u][0]]
            input_ids[g, at:at + p] = ids[first, :p]
            positions[g, at:at + p] = torch.arange(p, device=dev)
            unit[g, at:at + unit_lens[u]] = u
            last_prompt, at = at + p - 1, at + p
            for j, i in enumerate(groups[u]):
                n = resp_lens[i]
                input_ids[g, at:at + n] = resp[i, :n]
                positions[g, at:at + n] = p + torch.arange(n, device=dev)
                block[g, at:at + n] = j
                # token 0 is predicted by the prompt's last slot, token t > 0 by slot t - 1 of the block; tokens past
                # the response (padding of `responses`, masked in every loss) read its last slot
                slot = torch.where(t == 0, torch.full_like(t, last_prompt),
                                   (at + (t - 1).clamp(max=max(n - 1, 0))).clamp(max=seq - 1))
                gather[i] = g * seq + slot
                at += n
    if not with_mask:
        return PackedRows(input_ids, None, positions, gather)
    slots = torch.arange(seq, device=dev)
    causal = slots[None, :] <= slots[:, None]
    same_unit = (unit[:, :, None] == unit[:, None, :]) & (unit[:, None, :] >= 0)
    sees = (block[:, None, :] < 0) | (block[:, :, None] == block[:, None, :])  # the unit's prompt, or its own block
    visible = causal[None] & same_unit & sees
    visible |= torch.eye(seq, dtype=torch.bool, device=dev)[None]              # no query row is empty
    return PackedRows(input_ids, ~visible[:, None], positions, gather)


def pad_rows_to(mb: PPOBatch, seq: int) -> PPOBatch:
    """`mb` with input_ids and attention_mask right-padded to `seq` tokens (unpacked rows of a fixed-shape call)."""
    ids = mb["input_ids"]
    if ids.shape[1] == seq:
        return mb
    out = dict(mb.tensors)
    out["input_ids"] = torch.nn.functional.pad(ids, (0, seq - ids.shape[1]))
    out["attention_mask"] = torch.nn.functional.pad(mb["attention_mask"], (0, seq - ids.shape[1]))
    return PPOBatch(out, mb.meta)
