"""The actor's weights to the rollout's own ranks: the hybrid engine's generation shards, in planned buckets, tagged
with a version.

The trainer gathers the generation shards exactly as the colocated hybrid engine does (parallel/hybrid_engine: every
trainer rank takes part, each ends with the shard of its rollout TP slice); the ranks of the first rollout TP group
then send slice j to rank j of every rollout replica. Both sides derive the same bucket layout from the reshard plan
(`bucket_layout`: the shard's tensors by name, one dtype per bucket, at most `bucket_bytes` each), so a message is
the version header and raw bucket bytes, nothing else: each rollout rank receives exactly its shard
(`plan.generation_shard_bytes()` bytes, counted), through one reused bucket buffer, straight into the engine's
weight buffers where it has them.

The trainer posts its sends and goes on training (the rollout takes a version when the schedule says it needs it,
engine/async_rollout/schedule.py); a push's staged buckets live until the rollout has taken them, so a sending
trainer rank holds up to `in_flight` (the schedule's capacity, floor((1 + s) K)) copies of its generation shard.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from tripod.engine.async_rollout.bridge import Placement, recv, send


def bucket_layout(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype], bucket_bytes: int
                  ) -> list[list[str]]:
    """The shard's tensor names in buckets: sorted by (dtype, name), a bucket is one dtype and at most `bucket_bytes`
    (a tensor larger than that travels alone)."""
    buckets: list[list[str]] = []
    size, dtype = 0, None
    for name in sorted(shapes, key=lambda n: (str(dtypes[n]), n)):
        nbytes = _numel(shapes[name]) * torch.empty((), dtype=dtypes[name]).element_size()
        if not buckets or dtypes[name] != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, dtypes[name]
        buckets[-1].append(name)
        size += nbytes
    return buckets


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


END = -1  # the version of the header that closes the stream
RESTART = -2  # the version of the header that abandons the rollout's timeline (a divergence-guard rollback)


class Restart(Exception):
    """The trainer rolled back: the rollout drops what it was doing and waits for a new start."""


def _header(version: int, nbytes: int) -> torch.Tensor:
    return torch.tensor([version, nbytes], dtype=torch.int64)


class WeightPusher:
    """Trainer side: `push(actor_model, version)` after the steps the schedule syncs (every trainer rank calls it)."""

    def __init__(self, placement: Placement, hybrid, bucket_bytes: int = 64 << 20, in_flight: int = 1):
        """`in_flight`: pushes that may wait for the rollout at once (the staleness schedule's capacity: the rollout
        takes a version only when a batch needs it, and the trainer should not wait for that)."""
        import torch.distributed as dist

        self.placement, self.hybrid, self.plan = placement, hybrid, hybrid.plan
        order = self.plan.rollout_tp_group_of(self.plan.rollout_tp_groups[0][0])
        me, tp = dist.get_rank(), self.plan.rollout_tp
        self.slice = order.index(me) if me in order else None  # this rank sends slice j, or nothing
        replicas = placement.rollout_ranks // tp
        self.targets = [] if self.slice is None else \
            [placement.rollout_bridge_rank(r * tp + self.slice) for r in range(replicas)]
        self.layout = bucket_layout(self.plan.generation_shapes(), self.plan.generation_dtypes(), bucket_bytes)
        self.in_flight = max(1, in_flight)
        self._pushes: deque[tuple[list[Any], list[torch.Tensor]]] = deque()  # (works, staged buckets) per push

    def wait(self, keep: int = 0) -> None:
        """Block until at most `keep` pushes are still on their way (the others' staged buckets are freed)."""
        while len(self._pushes) > keep:
            works, _ = self._pushes.popleft()
            for work in works:
                work.wait()

    def close(self) -> None:
        """After the last push: wait for every push, then tell the rollout ranks no version follows (an end header,
        version -1: a receive they posted ahead, for partial rollouts, completes instead of waiting for ever)."""
        self.wait()
        if self.slice is not None:
            from tripod.runtime.device import current_device

            end = _header(END, 0).to(current_device())  # NCCL moves device tensors (gloo runs: the CPU)
            for work in [send(self.placement.weights, end, dst, wait=False) for dst in self.targets]:
                work.wait()

    def restart(self) -> None:
        """After a rollback: every rollout rank drops its timeline at its next wait for weights (the versions posted
        before still arrive first, in order)."""
        if self.slice is not None:
            from tripod.runtime.device import current_device

            header = _header(RESTART, 0).to(current_device())
            self._pushes.append(([send(self.placement.weights, header, dst, wait=False) for dst in self.targets],
                                 [header]))

    def push(self, actor_model, version: int) -> dict[str, float]:
        """Gather the generation shards (collective over the trainer's ranks) and post this rank's sends; returns
        async/weight_push_s (gather + staging + posting, not the transfer, which overlaps training) and the bytes
        this rank sends per rollout replica."""
        start = time.perf_counter()
        self.wait(keep=self.in_flight - 1)
        shard = self.hybrid.to_rollout(actor_model)
        sent = 0
        if self.slice is not None:
            with torch.no_grad():
                staged = [torch.cat([shard[n].detach().reshape(-1) for n in names]).contiguous()
                          for names in self.layout]
            del shard
            nbytes = sum(b.numel() * b.element_size() for b in staged)
            device = staged[0].device if staged else torch.device("cpu")
            staged.insert(0, _header(version, nbytes).to(device))
            self._pushes.append(([send(self.placement.weights, t, dst, wait=False)
                                  for dst in self.targets for t in staged], staged))
            sent = nbytes
        return {"async/weight_push_s": time.perf_counter() - start, "async/weight_bytes_per_replica": float(sent)}


class WeightReceiver:
    """Rollout side: `receive(engine)` takes the next pushed version into the rollout engine."""

    def __init__(self, placement: Placement, plan, tp_rank: int, device: torch.device, bucket_bytes: int = 64 << 20):
        self.placement, self.plan, self.device = placement, plan, device
        order = plan.rollout_tp_group_of(plan.rollout_tp_groups[0][0])
        self.src = order[tp_rank]  # the trainer rank (= bridge rank) that holds our slice
        self.shapes, self.dtypes = plan.generation_shapes(), plan.generation_dtypes()
        self.layout = bucket_layout(self.shapes, self.dtypes, bucket_bytes)
        self.expected = plan.generation_shard_bytes()
        self.bytes_received = 0  # of the last receive, counted from the buffers that arrived
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        self._header: torch.Tensor | None = None
        self._waiter: threading.Thread | None = None  # receives the next version's header in the background
        self._here = threading.Event()

    def _post(self) -> None:
        """Receive the next header in a thread (gloo's receive completes only inside wait(), so it cannot be
        polled): `arrived` then never blocks, and the buckets follow in the caller's thread."""
        if self._waiter is None:
            self._header, self._here = _header(0, 0).to(self.device), threading.Event()

            def wait(header=self._header, here=self._here):
                if self.device.type == "cuda":  # NCCL works on the thread's current device
                    torch.cuda.set_device(self.device)
                self.placement.weights.recv([header], self.src, 0).wait()
                here.set()
            self._waiter = threading.Thread(target=wait, daemon=True)
            self._waiter.start()

    def arrived(self) -> bool:
        """Whether the next version's header is here (never blocks): a partial rollout polls it between tokens."""
        self._post()
        return self._here.is_set()

    def finish(self) -> None:
        """Take the trainer's end header (`WeightPusher.close`): every version sent was received."""
        self._post()
        self._waiter.join()
        version, self._waiter = int(self._header.cpu()[0]), None
        if version == RESTART:
            raise Restart()
        if version != END:
            raise RuntimeError(f"the trainer sent weight version {version} that no batch of the run needs")

    def _bucket_buffer(self, names: list[str]) -> torch.Tensor:
        dtype, numel = self.dtypes[names[0]], sum(_numel(self.shapes[n]) for n in names)
        buf = self._staging.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = self._staging[dtype] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel]

    def receive(self, engine) -> tuple[int, float, float]:
        """Block until the next version arrives and load it; returns (version, seconds waiting for the trainer to
        send, seconds receiving and loading)."""
        start = time.perf_counter()
        self._post()
        self._waiter.join()
        if not self._here.is_set():
            raise RuntimeError("the trainer stopped sending weights (its side of the bridge closed)")
        header, self._waiter = self._header.cpu(), None
        arrived = time.perf_counter()
        version, nbytes = int(header[0]), int(header[1])
        if version == RESTART:
            raise Restart()
        if version == END:
            raise RuntimeError("the trainer closed the weight stream while this rollout rank waited for a version")
        if nbytes != self.expected:
            raise RuntimeError(f"weight version {version}: the trainer sends {nbytes} bytes, this rollout rank's "
                               f"generation shard is {self.expected}; trainer and rollout disagree on the plan")
        buffers = engine.weight_buffers() or {n: torch.empty(s, dtype=self.dtypes[n], device=self.device)
                                              for n, s in self.shapes.items()}
        got = 0
        for names in self.layout:
            flat = recv(self.placement.weights, self._bucket_buffer(names), self.src)
            got += flat.numel() * flat.element_size()
            offset = 0
            for n in names:
                k = _numel(self.shapes[n])
                buffers[n].copy_(flat[offset: offset + k].view(self.shapes[n]))
                offset += k
        engine.load_weights(buffers)
        self.bytes_received = got
        return version, arrived - start, time.perf_counter() - arrived
