"""Where the trainer's step gets its scored batch: rollout -> queue -> train, in two schedules.

    ColocatedRollout   the synchronous schedule: the step's prompts are generated on the trainer's own ranks with the
                       current weights (hybrid engine), scored, and trained at once (tripod's default)
    QueuedRollout      the rollout's own ranks fill a queue (engine/async_rollout/server.py); the step takes batch
                       `step` from it and, after the steps the staleness schedule names, pushes its weights back

Both hand `PPOTrainer.train_step` the same `Rollout` (engine/algorithms/dynamic_sampling.py) and reward metrics, so the
step after the rollout is one code path. At staleness 0 the queued schedule generates every batch with the weights
the colocated one would (schedule.py), which tests/multiprocess/test_async.py holds bit for bit.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from tripod.engine.async_rollout.bridge import Placement, send
from tripod.engine.async_rollout.messages import ScoredBatch, head_bytes, parse_head, recv_batch, unpack
from tripod.engine.async_rollout.rows import request_rows, stop_servers
from tripod.engine.async_rollout.schedule import StalenessSchedule
from tripod.engine.async_rollout.weights import WeightPusher
from tripod.engine.rollout.rows import Rollout


class ColocatedRollout:
    """The synchronous schedule on the trainer's ranks (see the module docstring)."""
    shards_rows = True  # the exchange may leave each DP rank only the rows it updates (engine/workers/row_shards.py)

    def __init__(self, trainer):
        self.t = trainer

    def next_batch(self, step: int, step_rows, timer, prompts=None) -> tuple[Rollout, dict[str, float]]:
        t = self.t
        prompts = prompts if prompts is not None else next(iter(t.loader))
        t.offload.enter("rollout")
        t.generator.take_metrics()  # a validation's turns are not this step's
        t.weight_sync.take_metrics()  # nor a validation's weight sync
        rollout, metrics = t.sampler.collect(  # dynamic sampling may draw further prompt batches
            prompts, lambda p, k: t.generator.generate_rows(p, t.sampling_params(False, step, k), timer,
                                                            needs=step_rows.needs(p)),
            t.scorer, timer)
        rollout.shards = step_rows.shards_of(rollout)
        return rollout, {**metrics, **t.generator.take_metrics(), **t.weight_sync.take_metrics()}

    def updated(self, step: int) -> dict[str, float]:
        return {}

    def versions_of(self, step: int, rows: int) -> list[list[list[int]]]:
        """Every row's [[first token, weight version]] of step `step`'s batch: the current weights."""
        return [[[0, step]] for _ in range(rows)]

    def start(self, step: int) -> None:
        pass

    def restart(self, step: int) -> None:
        pass

    def state_dict(self, step: int) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class QueuedRollout:
    """Batches from the rollout ranks' queue; weights back to them (see the module docstring). Trainer rank 0 receives
    each batch's head (a thread: the queue fills while the trainer trains) and broadcasts it to the trainer's other
    ranks; each trainer rank then takes the rows it trains straight from a rollout rank (async_rollout/rows.py)."""
    shards_rows = True  # each DP rank receives only the rows it updates, where the step plan shards them

    def __init__(self, trainer, placement: Placement, schedule: StalenessSchedule):
        self.t, self.placement, self.schedule = trainer, placement, schedule
        self.pusher = WeightPusher(placement, trainer.hybrid, in_flight=schedule.capacity)
        # heads taken off the bridge (whole batches out of a checkpoint), in order
        self.ready: deque[torch.Tensor] = deque()
        self.inbox: queue.Queue = queue.Queue()
        self.loader_state: dict = trainer.loader.state_dict()  # the rollout loader's position after the last batch
        self.run = 0  # starts of the rollout: a divergence-guard rollback starts it again, older batches are dropped
        self._thread: threading.Thread | None = None

    # ---- start / stop -------------------------------------------------------------------------------
    def start(self, step: int) -> None:
        """Tell the rollout ranks where to begin (the first batch they generate, the loader's position before it) and
        give them the weights of `step`; start receiving."""
        first = self.schedule.first_to_generate(step)
        if dist.get_rank() == 0:
            state = self.loader_state
            msg = torch.tensor([step, first, state["epoch"], state["offset"], self.run], dtype=torch.int64)
            for r in range(self.placement.rollout_ranks):
                send(self.placement.data, msg, self.placement.rollout_bridge_rank(r))
            if self._thread is None:
                self._thread = threading.Thread(target=self._receive, daemon=True)
                self._thread.start()
        if first < self.schedule.total_batches:  # else nothing is left to generate: the rollout ranks just stop
            self.pusher.push(self.t.actor.model, step)

    def restart(self, step: int) -> None:
        """After a divergence-guard rollback to `step` (the checkpoint's queue and loader position loaded): the rollout
        ranks drop their timeline at their next wait for weights and start again from there; the batches they made
        before are dropped as they arrive (their run number is an older one)."""
        self.run += 1
        self.pusher.restart()
        self.start(step)

    def _receive(self) -> None:
        src = self.placement.rollout_bridge_rank(0)
        try:
            while True:
                buf = recv_batch(self.placement.data, src)
                self.inbox.put(buf)
                if buf is None:  # the rollout ranks are done
                    return
        except Exception as e:  # a rollout rank died: the step waiting on the queue raises it
            self.inbox.put(e)

    def _pull(self) -> torch.Tensor:
        """(rank 0) The next batch of the current run off the bridge, waiting for it."""
        while True:
            item = self.inbox.get()
            if isinstance(item, Exception) or item is None:
                raise RuntimeError(f"the rollout ranks stopped sending batches ({item or 'they ended'}); the run stops "
                                   "here, its last checkpoint is intact (trainer.resume=auto continues from it)"
                                   ) from (item if isinstance(item, Exception) else None)
            if parse_head(item)[0]["run"] == self.run:
                return item

    def close(self) -> None:
        self.pusher.close()
        if dist.get_rank() == 0:
            stop_servers(self.placement)
        if self._thread is not None:  # the rollout's end message comes once it has the end header
            self._thread.join()

    # ---- the step -----------------------------------------------------------------------------------
    def _take(self) -> tuple[torch.Tensor | None, float, int]:
        """(rank 0: the next batch's head; the seconds the trainer waited for it; batches queued when it asked)."""
        if dist.get_rank() != 0:
            return None, 0.0, 0
        queued = len(self.ready) + self.inbox.qsize()
        start = time.perf_counter()
        if not self.ready:
            self.ready.append(self._pull())
        return self.ready.popleft(), time.perf_counter() - start, queued

    def _receive_rows(self, buf: torch.Tensor | None, step_rows) -> tuple[ScoredBatch, list[int] | None, int, int]:
        """(every trainer rank; `buf`: rank 0's head) The step's batch with this rank's rows (None: every row), the
        bytes this rank received, the head's bytes."""
        buf = _broadcast_bytes(buf)
        head, offset = parse_head(buf)
        needs = step_rows.needs(self.t.train_set.batch(head["prompt_indices"]))
        held = needs(head["lengths"]) if needs is not None else None  # the row-shard plan (collective)
        held = _rows_to_request(held)
        every = range(len(head["lengths"]))
        if head["attached"]:  # a batch out of a checkpoint's queue: it came whole (rank 0 broadcast it)
            b = unpack(head, buf[offset:], every)
            if held is not None:
                keep = set(held)
                for field in ("responses", "log_probs", "token_codes", "routed_experts"):
                    rows = getattr(b, field)
                    if rows is not None:
                        setattr(b, field, [x if g in keep else None for g, x in enumerate(rows)])
            return b, held, buf.numel(), offset
        body = request_rows(self.placement, dist.get_rank(), head, held)
        return unpack(head, body, every if held is None else held), held, buf.numel() + body.numel(), buf.numel()

    def next_batch(self, step: int, step_rows, timer, prompts=None) -> tuple[Rollout, dict[str, float]]:
        if prompts is not None:
            raise ValueError("the rollout runs on its own ranks (rollout.nnodes): the trainer does not pick prompts")
        with timer("wait_rollout"):
            buf, idle, queued = self._take()
            b, held, received, head_size = self._receive_rows(buf, step_rows)
        want, seen = self.schedule.version_for(step), {v for row in b.versions for _, v in row}
        allowed = (lambda v: want <= v <= step) if self.t.cfg.async_training.partial_rollout else (lambda v: v == want)
        if b.batch != step or not all(allowed(v) for v in seen):
            raise RuntimeError(f"step {step} got batch {b.batch} generated by weight versions {sorted(seen)}, the "
                               f"schedule says version {want}: trainer and rollout ranks are out of step")
        self.last_versions = b.versions
        self.loader_state = b.loader_state
        prompts = self.t.train_set.batch(b.prompt_indices)
        rollout = Rollout(prompts, b.responses, b.scores, b.rewards, b.penalties, dict(b.metrics), b.log_probs,
                          b.finish_reasons, b.token_codes, b.routed_experts, response_lens=b.lengths, held_rows=held)
        rollout.shards = step_rows.shards_of(rollout)
        with timer("reward"):  # the rollout ranks scored the rules; the reward model is here (rewards/scorer.py)
            rollout, model_metrics = self.t.scorer.add_model_scores(rollout)
        ages = [step - v for row, length in zip(b.versions, b.lengths)  # one age per token
                for k, (first, v) in enumerate(row) for _ in range(first, row[k + 1][0] if k + 1 < len(row) else length)]
        ages = ages or [step - want]
        return rollout, {**b.metrics, **model_metrics, "async/staleness_mean": sum(ages) / len(ages),
                         "async/staleness_max": float(max(ages)),
                         "async/partial_switches": float(sum(len(row) - 1 for row in b.versions)),
                         **self._shared_stats(idle, queued, received, head_size),
                         **{f"async/{k}": v for k, v in b.timings.items()}}

    def _shared_stats(self, idle: float, queued: int, received: int, head_size: int) -> dict[str, float]:
        """Rank 0's wait and queue, every trainer rank's received bytes: one all_reduce over the trainer's ranks."""
        from tripod.runtime.device import current_device

        world, rank = dist.get_world_size(), dist.get_rank()
        stats = torch.zeros(2 + world, dtype=torch.float64, device=current_device())
        stats[0], stats[1], stats[2 + rank] = idle, float(queued), float(received)
        if world > 1:
            dist.all_reduce(stats)
        stats = stats.cpu().tolist()
        return {"async/queue_size": stats[1], "async/trainer_idle_s": stats[0],
                "async/batch_head_bytes": float(head_size), "async/batch_bytes_total": float(sum(stats[2:])),
                **{f"async/batch_bytes/rank{r}": stats[2 + r] for r in range(world)}}

    def versions_of(self, step: int, rows: int) -> list[list[list[int]]]:
        return self.last_versions

    def updated(self, step: int) -> dict[str, float]:
        """After the update that made version `step` was kept (the divergence guard judged it): push it when the
        schedule syncs there."""
        return self.pusher.push(self.t.actor.model, step) if self.schedule.syncs(step) else {}

    # ---- checkpoint ---------------------------------------------------------------------------------
    def state_dict(self, step: int) -> dict[str, Any]:
        """At a checkpoint after `step` steps: the batches generated with weights older than `step` (a resume cannot
        regenerate them: those weights are gone) move into the checkpoint whole (rank 0 asks rollout rank 0 for every
        row; the batch still serves its step's rows as planned), with the loader position after them; the later
        batches a resumed run regenerates exactly (same weights, same seeds). Every rank gets the same state; rank 0
        holds the batches."""
        need = self.schedule.first_to_generate(step) - step
        state = self.loader_state
        queued: list[torch.Tensor] = []
        if dist.get_rank() == 0:
            while len(self.ready) < need:
                self.ready.append(self._pull())
            queued = [self._whole(buf) for buf in list(self.ready)[:need]]
            if queued:
                state = parse_head(queued[-1])[0]["loader_state"]
        box = [state]
        dist.broadcast_object_list(box, 0)
        return {"data": box[0], "async_queue": queued}

    def _whole(self, buf: torch.Tensor) -> torch.Tensor:
        """(rank 0) A queued batch with every row's body attached."""
        head, _ = parse_head(buf)
        if head["attached"]:
            return buf
        body = request_rows(self.placement, 0, head, None, keep=True)
        return torch.cat([head_bytes({**head, "attached": True}), body])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ready = deque(state.get("async_queue") or [])
        self.loader_state = state["data"]


def _rows_to_request(planned: list[int] | None) -> list[int] | None:
    """The rows a trainer rank asks the rollout for: its planned rows (a test plants every row here)."""
    return planned


def dump_rollout(directory: str, step: int, rollout: Rollout, versions: list[list[list[int]]],
                 tokenizer: Any = None) -> None:
    """trainer.rollout_data_dir: the step's rows as JSON lines (`directory/<step>.jsonl`), rows this rank holds: verl's
    `input`, `output`, `gts`, `score`, `step` (texts with a `tokenizer`), the token ids, rollout log-probs and weight
    versions, and `turns`: the conversation after the prompt as {role, text, n_tokens, trained} (engine/agent/
    turns.py; one assistant turn for a single-turn row)."""
    import json
    import os

    from tripod.engine.agent.turns import turns_of

    os.makedirs(directory, exist_ok=True)
    n = len(rollout.responses) // max(len(rollout.prompts.input_ids), 1)
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer is not None else None
    with open(os.path.join(directory, f"{step}.jsonl"), "w") as f:
        for i, response in enumerate(rollout.responses):
            if response is None:
                continue
            logp = rollout.rollout_log_probs[i] if rollout.rollout_log_probs else None
            codes = rollout.token_codes[i] if rollout.token_codes else None
            prompt = rollout.prompts.input_ids[i // n]
            f.write(json.dumps({"step": step, "row": i, "index": rollout.prompts.indices[i // n],
                                "input": decode(prompt) if decode else None,
                                "output": decode(list(response)) if decode else None,
                                "gts": rollout.prompts.ground_truths[i // n],
                                "prompt_ids": prompt, "response_ids": list(response),
                                "rollout_log_probs": None if logp is None else logp.tolist(),
                                "score": rollout.scores[i], "weight_versions": versions[i],
                                "turns": turns_of(list(response), codes, decode)}) + "\n")


def _broadcast_bytes(buf: torch.Tensor | None) -> torch.Tensor:
    """Rank 0's buffer on every trainer rank (size first, then the bytes, on the trainer's default group)."""
    if dist.get_world_size() == 1:
        return buf
    from tripod.runtime.device import current_device

    dev = current_device()
    size = torch.tensor([0 if buf is None else buf.numel()], dtype=torch.int64, device=dev)
    dist.broadcast(size, 0)
    out = buf.to(dev) if buf is not None else torch.empty(int(size), dtype=torch.uint8, device=dev)
    dist.broadcast(out, 0)
    return out.cpu()
