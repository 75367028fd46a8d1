"""The agent loop's model turns on the rollout engine: each row asks for its next turn when it is ready, and the
scheduler batches what the rows ask for.

    scheduler = TurnScheduler(engine, params, "per_row", rows=len(rows), share=share)
    out = await scheduler.generate(row, context_ids, max_new_tokens, seed)   # in row `row`'s coroutine: a TurnOutput
    scheduler.finished(row)                                                  # the row has no further turn
    await scheduler.drive()                                                  # beside the rows, until every row ended

`per_row` (multi_turn.scheduling's default): a row never waits for another row's tool. With the embedded engine and
vLLM the rows share a running batch (engine/rollout/running_batch.py: tripod's own decode batch, vLLM's scheduler):
a row joins at the next engine step and leaves when its turn ends. With SGLang, or when the embedded engine records
routing (R3), one generate call takes the rows that are ready whenever the engine is free.
`lockstep`: the turns of every live row in one batch, started once the last row's tools have answered: how the loop
ran before, kept for comparison (scripts/bench_agent.py).

Every turn samples from its row's own seed (`row_turn_seed`), so a row's tokens do not depend on which rows share its
batch: both modes give the same trajectories, up to the float rounding of other batch sizes.

On a replica of several TP ranks, the group's first rank runs the rows and decides every engine call; `share` hands
each decision to the other ranks, whose `follow` makes the same calls (the engines' collectives need them).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from tripod.engine.rollout.base import SamplingParams
from tripod.engine.rollout.running_batch import Request

SCHEDULING = ("per_row", "lockstep")  # actor_rollout_ref.rollout.multi_turn.scheduling
_DONE, _STEP, _CALL = "done", "step", "call"


def row_turn_seed(seed: int | None, row: int, turn: int) -> int | None:
    """The sampling seed of row `row`'s turn `turn`: turn 0 is the single-turn rollout's row seed (`seed + row`, as the
    vLLM and SGLang backends seed row `row` of a call), later turns a mix of the turn's."""
    if seed is None:
        return None
    return (seed if turn == 0 else (seed * 1_000_003 + turn) % (1 << 62)) + row


@dataclass
class TurnOutput:
    """A model turn as the engine generated it (not cut to the row's budget): ids, log-probs, finish reason, and the
    routing record of its call ([context + ids, MoE layers, k]) when the engine records one."""
    token_ids: list[int]
    log_probs: list[float]
    finish: str
    routed_experts: torch.Tensor | None = None


def running_batch(engine: Any, mode: str, params: SamplingParams) -> Any:
    """`engine`'s running batch for `mode` (engine/rollout/running_batch.py), or None: generate calls."""
    make = getattr(engine, "running_batch", None)
    return make(replace(params, n=1)) if mode == "per_row" and callable(make) else None


class TurnScheduler:
    """Batches the rows' model turns (see the module docstring); `rows`: how many rows will ask."""

    def __init__(self, engine: Any, params: SamplingParams, mode: str, rows: int,
                 share: Callable[[Any], Any] | None = None) -> None:
        if mode not in SCHEDULING:
            raise ValueError(f"multi_turn.scheduling={mode!r} must be one of {', '.join(SCHEDULING)}")
        self.engine, self.params, self.mode, self.share = engine, params, mode, share
        self.batch = running_batch(engine, mode, params)
        self.live = rows  # rows that have not finished
        self.pending: dict[int, tuple[Request, asyncio.Future]] = {}
        self.waiting: dict[int, asyncio.Future] = {}  # admitted to the running batch
        self._wake: asyncio.Event | None = None
        self.busy_s = 0.0  # wall time the engine was generating

    # ---- the rows' side ----------------------------------------------------------------------------------
    async def generate(self, row: int, context: list[int], max_new_tokens: int, seed: int | None) -> TurnOutput:
        future = asyncio.get_running_loop().create_future()
        self.pending[row] = (Request(row, list(context), int(max_new_tokens), seed), future)
        self._signal()
        return await future

    def finished(self, row: int) -> None:
        self.live -= 1
        self._signal()

    def _signal(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ---- the leader --------------------------------------------------------------------------------------
    def _take(self) -> list[tuple[Request, asyncio.Future]]:
        """The requests to start now: per_row all that wait; lockstep all live rows' at once, when the batch is idle."""
        idle = self.batch is None or not self.batch.live
        if self.mode == "lockstep" and not (idle and self.pending and len(self.pending) == self.live):
            return []
        taken = sorted(self.pending.items())
        self.pending = {}
        return [item for _, item in taken]

    async def drive(self) -> None:
        """Run the engine for the rows until every row has finished (the rendering rank)."""
        self._wake = asyncio.Event()
        try:
            while self.live:
                taken = self._take()
                if self.batch is not None and (taken or self.batch.live):
                    self._step(taken)
                    await asyncio.sleep(0)  # the rows whose turn ended, and the tools, run between decode steps
                elif taken:
                    await self._call(taken)
                else:
                    self._wake.clear()
                    await self._wake.wait()
        finally:
            if self.share is not None:
                self.share((_DONE, None))

    def _step(self, taken: list[tuple[Request, asyncio.Future]]) -> None:
        assert self.batch is not None
        requests = [request for request, _ in taken]
        if self.share is not None:
            self.share((_STEP, requests))
        self.waiting.update({request.key: future for request, future in taken})
        start = time.perf_counter()
        self.batch.admit(requests)
        ended = self.batch.step()
        self.busy_s += time.perf_counter() - start
        for done in ended:
            self.waiting.pop(done.key).set_result(TurnOutput(done.token_ids, done.log_probs, done.finish))

    async def _call(self, taken: list[tuple[Request, asyncio.Future]]) -> None:
        requests = [request for request, _ in taken]
        if self.share is not None:
            self.share((_CALL, requests))
        start = time.perf_counter()
        try:
            outs = await asyncio.to_thread(self._generate, requests)
        except BaseException as e:  # noqa: BLE001  (the rows waiting on this call see the engine's error)
            for _, future in taken:
                future.set_exception(e)
            raise
        self.busy_s += time.perf_counter() - start
        for (_, future), out in zip(taken, outs):
            future.set_result(out)

    def _generate(self, requests: list[Request]) -> list[TurnOutput]:
        """One generate call for `requests` (each its own seed; the longest budget: the loop cuts each row's)."""
        seeds = [r.seed for r in requests]
        params = replace(self.params, n=1, max_new_tokens=max(r.max_new_tokens for r in requests))
        out = self.engine.generate([r.context for r in requests], params,
                                   row_seeds=None if any(s is None for s in seeds) else seeds)
        records = out.routed_experts
        return [TurnOutput(ids, out.log_probs[k, : len(ids)].tolist(), out.finish_reasons[k],
                           None if records is None else records[k]) for k, ids in enumerate(out.responses())]

    # ---- the other ranks of a TP group ------------------------------------------------------------------
    def follow(self) -> None:
        """Make the leader's engine calls until it is done (a TP group's other ranks; no rows run here)."""
        assert self.share is not None
        while True:
            kind, requests = self.share(None)
            if kind == _DONE:
                return
            if kind == _STEP:
                assert self.batch is not None
                self.batch.admit(requests)
                self.batch.step()
            else:
                self._generate(requests)
