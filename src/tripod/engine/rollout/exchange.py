"""Rollout rows moved as tensors from the replica that generated them to the ranks that need them.

Owns the three parts of that move, each usable alone:

- `plan_transfers`: which rank sends which of a replica's rows to which rank. Pure; every rank computes the same plan
  from the replicas' ranks, their row counts and the rows each rank needs. A rank never receives rows its own replica
  holds, gets every other row it needs exactly once, and a replica's senders take turns (destination modulo the
  replica's size), so its TP ranks share the sending. `check_plan` states those rules and raises on a broken plan.
- the wire format (`pack_rows` / `unpack_rows`): one flat uint8 buffer per message, in this order: the rows' rollout
  log-probs (float32, concatenated), their tokens (int16 when the replica's largest token id fits, else int32),
  one finish-reason code per row (uint8), and for a multi-turn rollout each token's code (uint8: who wrote it,
  engine/agent/loop.py). The receiver knows the rows' lengths already (`exchange_rollout` shares
  every replica's lengths first, a few bytes a row), so nothing else travels and nothing is pickled.
- `exchange_rollout`: one small all_gather of every replica's lengths and largest token id, then which rows each
  rank needs (every row, or, where the caller's `needs(lengths)` names this rank's rows, a one-byte-a-row all_gather
  of every rank's choice), then the plan's messages point to point (isend / irecv, all posted before any wait), then
  `assemble` puts the rows in global order.

A rank whose PPO batch is whole (engine/workers/batch.py) needs every row; a batch sharded by DP rank
(engine/workers/row_shards.py) needs only the rows its update gets, which it names from the rows' lengths alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from tripod.engine.rollout.base import FINISH_LENGTH, FINISH_STOP

FINISH_CODES = {FINISH_STOP: 0, FINISH_LENGTH: 1}
FINISH_NAMES = {code: name for name, code in FINISH_CODES.items()}


@dataclass(frozen=True)
class Transfer:
    """`src` sends the rows `rows` (global row ids, ascending, all of one replica) to `dst`."""
    src: int
    dst: int
    replica: int
    rows: tuple[int, ...]


def replica_offsets(replica_rows: Sequence[int]) -> list[int]:
    """Global row id of each replica's first row, plus the total: replica i holds rows [off[i], off[i + 1])."""
    out = [0]
    for rows in replica_rows:
        out.append(out[-1] + int(rows))
    return out


def plan_transfers(replica_ranks: Sequence[Sequence[int]], replica_rows: Sequence[int],
                   needs: Sequence[Sequence[int]]) -> list[Transfer]:
    """The messages that give every rank `needs[rank]` (global row ids) which its own replica does not hold.

    `replica_ranks[i]`: the global ranks of rollout replica i (each holds all of the replica's rows);
    `replica_rows[i]`: how many rows replica i generated (rows are numbered replica after replica)."""
    off = replica_offsets(replica_rows)
    home = {r: i for i, ranks in enumerate(replica_ranks) for r in ranks}
    plan = []
    for dst, wanted in enumerate(needs):
        wanted = sorted(set(int(g) for g in wanted))
        for i, ranks in enumerate(replica_ranks):
            if home.get(dst) == i:
                continue
            rows = tuple(g for g in wanted if off[i] <= g < off[i + 1])
            if rows:
                plan.append(Transfer(src=int(ranks[dst % len(ranks)]), dst=dst, replica=i, rows=rows))
    return plan


def check_plan(plan: Sequence[Transfer], replica_ranks: Sequence[Sequence[int]], replica_rows: Sequence[int],
               needs: Sequence[Sequence[int]]) -> None:
    """Raise ValueError unless every rank gets each row it needs and its replica lacks exactly once, from a rank of
    the replica that holds it, and nothing else."""
    off = replica_offsets(replica_rows)
    home = {r: i for i, ranks in enumerate(replica_ranks) for r in ranks}
    owner = lambda g: next(i for i in range(len(replica_rows)) if off[i] <= g < off[i + 1])  # noqa: E731
    got: dict[tuple[int, int], int] = {}
    for t in plan:
        for g in t.rows:
            if not 0 <= g < off[-1] or owner(g) != t.replica or t.src not in replica_ranks[t.replica]:
                raise ValueError(f"{t.src} -> {t.dst}: row {g} is not held by sender {t.src}")
            got[(t.dst, g)] = got.get((t.dst, g), 0) + 1
    want = {(dst, int(g)) for dst, rows in enumerate(needs) for g in rows if owner(int(g)) != home.get(dst)}
    extra = sorted(k for k in got if k not in want)
    missing = sorted(k for k in want if k not in got)
    twice = sorted(k for k, c in got.items() if c > 1)
    if extra or missing or twice:
        raise ValueError(f"bad transfer plan: (rank, row) sent but not needed {extra[:5]}, needed but not sent "
                         f"{missing[:5]}, sent more than once {twice[:5]}")


def token_dtype(max_token_id: int) -> torch.dtype:
    return torch.int16 if max_token_id < 2 ** 15 else torch.int32


def pack_rows(responses: Sequence[Sequence[int]], log_probs: Sequence[torch.Tensor], finish_reasons: Sequence[str],
              tokens_as: torch.dtype, token_codes: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """Rows -> one uint8 buffer: log-probs float32, tokens `tokens_as`, finish codes uint8, then each token's code
    (uint8) when `token_codes` is given (see the module docstring)."""
    flat = [t for r in responses for t in r]
    logp = torch.cat([lp.detach().float().cpu().reshape(-1) for lp in log_probs]) if log_probs else torch.zeros(0)
    if logp.numel() != len(flat):
        raise ValueError(f"{len(flat)} tokens but {logp.numel()} rollout log-probs")
    tokens = torch.tensor(flat, dtype=torch.int64).to(tokens_as)
    codes = torch.tensor([FINISH_CODES[f] for f in finish_reasons], dtype=torch.uint8)
    parts = [logp.contiguous().view(torch.uint8), tokens.view(torch.uint8), codes]
    if token_codes is not None:
        parts.append(torch.cat([c.to(torch.uint8).cpu().reshape(-1) for c in token_codes]) if token_codes
                     else torch.zeros(0, dtype=torch.uint8))
        if parts[-1].numel() != len(flat):
            raise ValueError(f"{len(flat)} tokens but {parts[-1].numel()} token codes")
    return torch.cat(parts)


def message_bytes(lengths: Sequence[int], tokens_as: torch.dtype, with_codes: bool = False) -> int:
    """Size of `pack_rows` of rows with these response lengths (`with_codes`: token codes included)."""
    total = int(sum(lengths))
    return total * 4 + total * torch.tensor([], dtype=tokens_as).element_size() + len(lengths) + total * with_codes


def unpack_rows(buf: torch.Tensor, lengths: Sequence[int], tokens_as: torch.dtype, with_codes: bool = False
                ) -> tuple[list, ...]:
    """`pack_rows`' buffer of rows with these lengths -> (responses, log-probs, finish reasons[, token codes])."""
    if buf.numel() != message_bytes(lengths, tokens_as, with_codes):
        raise ValueError(f"a message of {buf.numel()} bytes for rows of {message_bytes(lengths, tokens_as, with_codes)}")
    total, width = int(sum(lengths)), torch.tensor([], dtype=tokens_as).element_size()
    logp = buf[: 4 * total].view(torch.float32)
    tokens = buf[4 * total: 4 * total + width * total].view(tokens_as).tolist()
    end = 4 * total + width * total + len(lengths)
    codes = buf[4 * total + width * total: end].tolist()
    responses, log_probs, token_codes, start = [], [], [], 0
    for n in lengths:
        responses.append(tokens[start: start + n])
        log_probs.append(logp[start: start + n])
        token_codes.append(buf[end + start: end + start + n].clone())
        start += n
    finish = [FINISH_NAMES[c] for c in codes]
    return (responses, log_probs, finish, token_codes) if with_codes else (responses, log_probs, finish)


def assemble(n_rows: int, local_rows: Sequence[int], local: tuple[list, ...],
             received: Sequence[tuple[Sequence[int], tuple[list, ...]]], wanted: Sequence[int] | None = None
             ) -> tuple[list, ...]:
    """(responses, log-probs, finish reasons[, token codes]: as many fields as `local`) of rows 0..n_rows-1 from this rank's own rows (`local_rows`, their
    data `local`) and the messages it received ((rows, data) each); every row of `wanted` (default: all) must come
    exactly once, a row outside it stays None."""
    out: list = [[None] * n_rows for _ in range(len(local))]
    seen = [False] * n_rows
    if wanted is not None:
        seen = [True] * n_rows
        for g in wanted:
            seen[g] = False
    for rows, data in [(local_rows, local), *received]:
        for k, g in enumerate(rows):
            if seen[g]:
                raise ValueError(f"rollout row {g} arrived twice")
            seen[g] = True
            for field in range(len(local)):
                out[field][g] = data[field][k]
    if not all(seen):
        raise ValueError(f"rollout rows {[g for g, s in enumerate(seen) if not s][:8]} never arrived")
    return tuple(out)


def exchange_rollout(replica_ranks: Sequence[Sequence[int]], mine: int, responses: list[list[int]],
                     log_probs: list[torch.Tensor], finish_reasons: list[str],
                     needs: Callable[[list[int]], list[int] | None] | None = None,
                     token_codes: list[torch.Tensor] | None = None) -> tuple[list, ...]:
    """This replica's rows -> the rows each rank needs, in replica order (collective over the world): (responses,
    log-probs, finish reasons, every row's response length, the rows this rank needed or None for all); with
    `token_codes` (every rank passes them or none does) the rows' token codes come fourth. A row
    neither needed nor generated by this rank's replica is None. `needs(lengths)` (every row's response length -> this rank's rows,
    or None for all; it may run collectives: every rank calls it at the same point) decides what each rank gets.
    The messages travel on the rank's device (runtime/device.py: NCCL needs CUDA tensors; gloo runs take the CPU)."""
    from tripod.runtime.device import current_device

    me, world, dev = dist.get_rank(), dist.get_world_size(), current_device()
    replicas = len(replica_ranks)
    # every replica's row count, largest token id and lengths: two small int64 all_gathers (each rank sends its own
    # replica's; the ranks of a replica send the same)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(responses)], dtype=torch.int64, device=dev))
    header = torch.zeros(max(int(s) for s in sizes) + 2, dtype=torch.int64)
    header[0] = len(responses)
    header[1] = max((t for r in responses for t in r), default=0)
    header[2: 2 + len(responses)] = torch.tensor([len(r) for r in responses], dtype=torch.int64)
    headers = [torch.empty_like(header, device=dev) for _ in range(world)]
    dist.all_gather(headers, header.to(dev))
    headers = [h.cpu() for h in headers]
    first = [int(ranks[0]) for ranks in replica_ranks]
    rows_of = [int(headers[first[i]][0]) for i in range(replicas)]
    lengths = [headers[first[i]][2: 2 + rows_of[i]].tolist() for i in range(replicas)]
    dtypes = [token_dtype(int(headers[first[i]][1])) for i in range(replicas)]
    off = replica_offsets(rows_of)
    every = [n for replica in lengths for n in replica]
    wanted = needs(every) if needs is not None else None
    if wanted is None:
        need_of: list = [range(off[-1])] * world
    else:  # every rank's rows, one byte a row (the callers decide alike whether rows are named, see `needs`)
        flags = torch.zeros(off[-1], dtype=torch.uint8)
        flags[torch.tensor(wanted, dtype=torch.long)] = 1
        everyone = [torch.empty_like(flags, device=dev) for _ in range(world)]
        dist.all_gather(everyone, flags.to(dev))
        need_of = [f.cpu().nonzero().squeeze(-1).tolist() for f in everyone]
    plan = plan_transfers(replica_ranks, rows_of, need_of)
    coded = token_codes is not None
    pending, outbox, inbox = [], [], []
    for t in plan:
        if t.src == me:
            local = [g - off[mine] for g in t.rows]
            outbox.append(pack_rows([responses[k] for k in local], [log_probs[k] for k in local],
                                    [finish_reasons[k] for k in local], dtypes[mine],
                                    None if token_codes is None else [token_codes[k] for k in local]).to(dev))
            pending.append(dist.isend(outbox[-1], dst=t.dst))
        if t.dst == me:
            row_lengths = [lengths[t.replica][g - off[t.replica]] for g in t.rows]
            buf = torch.empty(message_bytes(row_lengths, dtypes[t.replica], coded), dtype=torch.uint8, device=dev)
            pending.append(dist.irecv(buf, src=t.src))
            inbox.append((t, row_lengths, buf))
    for work in pending:
        work.wait()
    del outbox  # the sends are done with their buffers
    received = [(t.rows, unpack_rows(buf.cpu(), row_lengths, dtypes[t.replica], coded))
                for t, row_lengths, buf in inbox]
    own = list(range(off[mine], off[mine + 1]))  # kept whether needed or not: the replica scores its own rows
    wanted = None if wanted is None else sorted(set(int(g) for g in wanted))
    local = (responses, log_probs, finish_reasons) + ((token_codes,) if coded else ())
    rows = assemble(off[-1], own, local, received,
                    None if wanted is None else sorted(set(wanted) | set(own)))
    return (*rows, every, wanted)
