"""Each trainer rank's rows of a scored batch, straight from a rollout rank: nothing of a batch's tokens passes
through one trainer rank.

The head of a batch (messages.py: O(rows), no tokens) reaches every trainer rank first (rollout rank 0 -> trainer rank
0 -> a broadcast); from every row's lengths each trainer rank derives the rows it trains (the row-shard plan of the
colocated step, engine/workers/row_shards.py; every row where the plan keeps the batch whole: DP 1, dynamic sampling,
a reward model scoring on the trainer's ranks, an estimator that reads other ranks' rows). It then asks rollout rank
`t mod R` (trainer rank t; R rollout ranks, every one of which holds every row after the rollout's own exchange) for
exactly those rows and receives their body as one buffer on the device backend (`Placement.rows`: NCCL on GPU, gloo
on CPU). The sending is spread over min(T, R) rollout ranks, and trainer rank t receives its rows' bytes only.

    trainer rank t                                   rollout rank t mod R (`RowServer`, a thread)
    data  [batch, run, count, keep]  (tag REQUEST)  ->  waits until its scorer has the batch's body (`put`)
    data  the row ids, ascending     (tag ROW_IDS)  ->
    rows  <- the rows' body: tokens, log-probs, codes, experts (tag BODY; size known from the head on both sides)

A body stays on a rollout rank until each trainer rank it serves has asked for it once (`keep` requests, a
checkpoint taking the whole batch into its queue, do not count); a divergence-guard rollback's new run drops the
older runs' bodies. Trainer rank 0 ends every server with a STOP request after the last step.
"""
from __future__ import annotations

import threading

import torch

from tripod.engine.async_rollout.bridge import Placement, recv, send
from tripod.engine.async_rollout.messages import RowBody, body_bytes

REQUEST, ROW_IDS, BODY = 1, 2, 3  # tags: the data group's 0 carries the heads and the start messages
ALL, STOP = -1, -1  # a request's count for every row; its batch number for the end of the service


def server_of(trainer_rank: int, placement: Placement) -> int:
    """The rollout rank that serves trainer rank `trainer_rank`'s rows."""
    return trainer_rank % placement.rollout_ranks


def _row_device(placement: Placement) -> torch.device:
    if placement.row_group is placement.data:
        return torch.device("cpu")
    from tripod.runtime.device import current_device

    return current_device()


def request_rows(placement: Placement, trainer_rank: int, head: dict, rows: list[int] | None,
                 keep: bool = False) -> torch.Tensor:
    """(trainer rank `trainer_rank`) The body of `rows` (None: every row) of the batch `head` describes, from its
    rollout rank (see the module docstring); a host uint8 tensor of exactly `body_bytes(head, rows)` bytes."""
    src = placement.rollout_bridge_rank(server_of(trainer_rank, placement))
    ids = range(len(head["lengths"])) if rows is None else rows
    msg = torch.tensor([head["batch"], head["run"], ALL if rows is None else len(rows), int(keep)], dtype=torch.int64)
    send(placement.data, msg, src, tag=REQUEST)
    if rows:
        send(placement.data, torch.tensor(rows, dtype=torch.int64), src, tag=ROW_IDS)
    buf = torch.empty(body_bytes(head, ids), dtype=torch.uint8, device=_row_device(placement))
    if buf.numel():
        recv(placement.row_group, buf, src, tag=BODY)
    return buf.cpu()


def stop_servers(placement: Placement) -> None:
    """(trainer rank 0, after the last step) End every rollout rank's `RowServer`."""
    for r in range(placement.rollout_ranks):
        send(placement.data, torch.tensor([STOP, 0, 0, 0], dtype=torch.int64), placement.rollout_bridge_rank(r),
             tag=REQUEST)


class RowServer:
    """(rollout rank `rollout_rank`) Keeps each batch's `RowBody` and answers the trainer ranks' row requests, in a
    thread (see the module docstring)."""

    def __init__(self, placement: Placement, rollout_rank: int, device: torch.device) -> None:
        self.placement, self.device = placement, device
        self.clients = sum(1 for t in range(placement.trainer_ranks) if server_of(t, placement) == rollout_rank)
        self.bodies: dict[tuple[int, int], list] = {}  # (run, batch) -> [RowBody, requests still to come]
        self.cond = threading.Condition()
        self.sent_bytes = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def put(self, run: int, batch: int, body: RowBody) -> None:
        """Batch `batch` of run `run` is ready to serve (an older run's batches are dropped: never asked for)."""
        with self.cond:
            for key in [k for k in self.bodies if k[0] < run]:
                del self.bodies[key]
            if self.clients:
                self.bodies[(run, batch)] = [body, self.clients]
            self.cond.notify_all()

    def held(self) -> int:
        with self.cond:
            return len(self.bodies)

    def join(self) -> None:
        self._thread.join()

    def _serve(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        data = self.placement.data
        while True:
            req = torch.zeros(4, dtype=torch.int64)
            work = data.recv_anysource([req], REQUEST)
            work.wait()
            src = work._source_rank()
            batch, run, count, keep = req.tolist()
            if batch == STOP:
                return
            rows = None if count == ALL else \
                recv(data, torch.empty(count, dtype=torch.int64), src, tag=ROW_IDS).tolist() if count else []
            with self.cond:
                self.cond.wait_for(lambda: (run, batch) in self.bodies)
                entry = self.bodies[(run, batch)]
            body: RowBody = entry[0]
            buf = body.pack(range(len(body.token_offsets) - 1) if rows is None else rows)
            if buf.numel():
                send(self.placement.row_group, buf.to(self.device) if self.placement.row_group is not data else buf,
                     src, tag=BODY)
            self.sent_bytes += buf.numel()
            if not keep:
                with self.cond:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        self.bodies.pop((run, batch), None)
