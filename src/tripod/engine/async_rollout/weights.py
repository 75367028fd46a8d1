"""The actor's weights to the rollout's own ranks: the hybrid engine's generation shards, in planned buckets,
broadcast to every replica at once, tagged with a version.

The trainer gathers the generation shards exactly as the colocated hybrid engine does (parallel/hybrid_engine: every
trainer rank takes part, each ends with the shard of its rollout TP slice j). Both sides derive the same bucket layout
from the reshard plan (`bucket_layout`: the shard's tensors by name, one dtype per bucket, at most `BUCKET_BYTES`
each). Slice j is held by one trainer rank of every rollout-TP group of trainer ranks (G = trainer ranks / rollout
TP of them, `slice_senders`); bucket b of slice j goes out from sender b mod G as one broadcast to rank j of every
rollout replica (`slice_groups`: a group of that sender and those ranks, on the device backend: NCCL on GPU, gloo on
CPU). So no trainer rank sends more than 1/G of a slice, and each sends it once whatever the number of replicas:
the push's time is that of the broadcast, not of one copy per replica. The first sender of a slice also broadcasts
the version header. Each rollout rank receives exactly its shard (`plan.generation_shard_bytes()` bytes, counted)
through one reused bucket buffer, straight into the engine's weight buffers where it has them.

The trainer stages its buckets in host memory (pinned on CUDA) and a thread broadcasts them, one bucket on the device
at a time, while training goes on (the rollout takes a version when the schedule says it needs it,
engine/async_rollout/schedule.py); a push's staged buckets live until it is sent, so a sending trainer rank holds up
to `in_flight` (the schedule's capacity, floor((1 + s) K)) host copies of its share of the shard.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from tripod.engine.async_rollout.bridge import Placement, new_group

BUCKET_BYTES = 64 << 20  # a bucket's largest size (a tensor larger than that travels alone)


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


def slice_senders(plan, j: int) -> list[int]:
    """The trainer ranks holding rollout TP slice j after the gather, one per rollout-TP group of trainer ranks."""
    return [g[j] for g in plan.rollout_tp_groups]


def slice_groups(placement: Placement, plan) -> dict[tuple[int, int], Any]:
    """{(slice j, sender s): the group of slice j's sender s (group rank 0) and rank j of every rollout replica}, the
    groups this process belongs to, created in one order on every process (a group's creation waits for its members)."""
    tp, me = plan.rollout_tp, placement.bridge_rank
    replicas = placement.rollout_ranks // tp
    out = {}
    for j in range(tp):
        for s, sender in enumerate(slice_senders(plan, j)):
            members = [sender] + [placement.rollout_bridge_rank(r * tp + j) for r in range(replicas)]
            if me in members:
                out[(j, s)] = new_group(placement.backend, dist.PrefixStore(f"weights/{j}/{s}", placement.store),
                                        members.index(me), len(members))
    return out


def _broadcast(group, tensor: torch.Tensor):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


def unflatten_bucket(flat: torch.Tensor, names: list[str], shapes: dict, buffers: dict) -> None:
    """A received bucket's tensors into `buffers`, in the layout's order."""
    offset = 0
    for n in names:
        k = _numel(shapes[n])
        buffers[n].copy_(flat[offset: offset + k].view(shapes[n]))
        offset += k


class WeightPusher:
    """Trainer side: `push(actor_model, version)` after the steps the schedule syncs (every trainer rank calls it)."""

    def __init__(self, placement: Placement, hybrid, in_flight: int = 1):
        """`in_flight`: pushes that may wait for the rollout at once (the staleness schedule's capacity: the rollout
        takes a version only when a batch needs it, and the trainer should not wait for that)."""
        from tripod.runtime.device import current_device

        self.placement, self.hybrid, self.plan = placement, hybrid, hybrid.plan
        me = dist.get_rank()
        self.slice = self.plan.rollout_tp_group_of(me).index(me)
        senders = slice_senders(self.plan, self.slice)
        self.sender, self.senders = senders.index(me), len(senders)
        self.groups = slice_groups(placement, self.plan)
        self.group = self.groups[(self.slice, self.sender)]
        self.layout = bucket_layout(self.plan.generation_shapes(), self.plan.generation_dtypes(), BUCKET_BYTES)
        self.mine = [b for b in range(len(self.layout)) if b % self.senders == self.sender]
        self.in_flight = max(1, in_flight)
        self.device = current_device() if placement.backend != "gloo" else torch.device("cpu")
        self._jobs: queue.Queue = queue.Queue()
        self._pending: list[threading.Event] = []  # one per posted job, set once it is sent
        self._failed: list[BaseException] = []
        self._thread = threading.Thread(target=self._send_jobs, daemon=True)
        self._thread.start()

    def _send_jobs(self) -> None:
        """(thread) Each job's tensors, in order, one broadcast each, one on the device at a time."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            tensors, done = job
            try:
                for t in tensors:
                    _broadcast(self.group, t.to(self.device, non_blocking=False)).wait()
            except BaseException as e:  # the step that waits for this push raises it
                self._failed.append(e)
            tensors.clear()
            done.set()

    def _post(self, tensors: list[torch.Tensor]) -> None:
        done = threading.Event()
        self._pending.append(done)
        self._jobs.put((tensors, done))

    def wait(self, keep: int = 0) -> None:
        """Block until at most `keep` pushes are still on their way (the others' staged buckets are freed)."""
        while len(self._pending) > keep:
            self._pending.pop(0).wait()
        if self._failed:
            raise RuntimeError(f"the weight push to the rollout ranks failed: {self._failed[0]}") from self._failed[0]

    def close(self) -> None:
        """After the last push: wait for every push, then tell the rollout ranks no version follows (an end header,
        version -1: a receive they posted ahead, for partial rollouts, completes instead of waiting for ever)."""
        if self.sender == 0:
            self._post([_header(END, 0)])
        self.wait()
        self._jobs.put(None)
        self._thread.join()

    def restart(self) -> None:
        """After a rollback: every rollout rank drops its timeline at its next wait for weights (the versions posted
        before still arrive first, in order)."""
        if self.sender == 0:
            self._post([_header(RESTART, 0)])

    def push(self, actor_model, version: int) -> dict[str, float]:
        """Gather the generation shards (collective over the trainer's ranks), stage this rank's buckets in host
        memory and hand them to the sending thread; returns async/weight_push_s (gather + staging, not the transfer,
        which overlaps training), the bytes every trainer rank sends (`async/weight_push_bytes/rank{r}`) and the
        bytes each rollout rank receives (`async/weight_bytes_per_replica`, this rank's slice)."""
        start = time.perf_counter()
        self.wait(keep=self.in_flight - 1)
        shard = self.hybrid.to_rollout(actor_model)
        pin = self.device.type == "cuda"
        with torch.no_grad():
            staged = []
            for b in self.mine:
                flat = torch.cat([shard[n].detach().reshape(-1) for n in self.layout[b]]).to("cpu")
                staged.append(flat.pin_memory() if pin else flat)
            shard_bytes = sum(t.numel() * t.element_size() for t in shard.values())
        del shard
        sent = sum(t.numel() * t.element_size() for t in staged)
        if self.sender == 0:
            staged.insert(0, _header(version, shard_bytes))
        self._post(staged)
        world, rank = dist.get_world_size(), dist.get_rank()
        every = torch.zeros(world, dtype=torch.float64, device=self.device if self.device.type == "cuda" else None)
        every[rank] = float(sent)
        if world > 1:
            dist.all_reduce(every)
        return {"async/weight_push_s": time.perf_counter() - start, "async/weight_bytes_per_replica": float(shard_bytes),
                **{f"async/weight_push_bytes/rank{r}": float(v) for r, v in enumerate(every.cpu().tolist())}}


class WeightReceiver:
    """Rollout side: `receive(engine)` takes the next pushed version into the rollout engine."""

    def __init__(self, placement: Placement, plan, tp_rank: int, device: torch.device):
        self.placement, self.plan, self.device = placement, plan, device
        self.groups = slice_groups(placement, plan)
        self.senders = len(slice_senders(plan, tp_rank))
        self.slice_groups = [self.groups[(tp_rank, s)] for s in range(self.senders)]
        self.shapes, self.dtypes = plan.generation_shapes(), plan.generation_dtypes()
        self.layout = bucket_layout(self.shapes, self.dtypes, BUCKET_BYTES)
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
                _broadcast(self.slice_groups[0], header).wait()
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
        for b, names in enumerate(self.layout):
            flat = self._bucket_buffer(names)
            _broadcast(self.slice_groups[b % self.senders], flat).wait()
            got += flat.numel() * flat.element_size()
            unflatten_bucket(flat, names, self.shapes, buffers)
        engine.load_weights(buffers)
        self.bytes_received = got
        return version, arrived - start, time.perf_counter() - arrived


PUSH_GBPS = 25.0  # the bandwidth `describe_push` states: one 200 Gb/s NIC (GB/s, 1e9 bytes)


def push_bytes_per_sender(plan, bucket_bytes: int = BUCKET_BYTES) -> dict[int, int]:
    """{trainer rank: the bytes it broadcasts in one push} (bucket b of slice j from sender b mod G of the slice),
    whatever the number of replicas."""
    shapes, dtypes = plan.generation_shapes(), plan.generation_dtypes()
    layout = bucket_layout(shapes, dtypes, bucket_bytes)
    sizes = [sum(_numel(shapes[n]) * torch.empty((), dtype=dtypes[n]).element_size() for n in names)
             for names in layout]
    out: dict[int, int] = {}
    for j in range(plan.rollout_tp):
        senders = slice_senders(plan, j)
        for s, rank in enumerate(senders):
            out[rank] = out.get(rank, 0) + sum(size for b, size in enumerate(sizes) if b % len(senders) == s)
    return out


def describe_push(plan, rollout_ranks: int, bucket_bytes: int = BUCKET_BYTES, gbps: float = PUSH_GBPS) -> str:
    """`tripod plan`'s line for the weight push of a rollout on its own ranks: the bytes per sending trainer rank,
    and the time at `gbps` of the busier side, a sender's share or a rollout rank's whole shard (a pipelined broadcast
    moves both at link speed, at any number of replicas)."""
    per = push_bytes_per_sender(plan, bucket_bytes)
    top = max(per.values()) if per else 0
    shard = plan.generation_shard_bytes()
    replicas = rollout_ranks // plan.rollout_tp
    return (f"weight push (engine/async_rollout/weights.py): {len(per)} sending trainer rank(s), at most "
            f"{top / 2**20:.1f} MiB each (each rollout TP slice's buckets spread over the trainer ranks holding it), "
            f"one broadcast per bucket to all {replicas} replica(s); each rollout rank receives {shard / 2**20:.1f} "
            f"MiB: ~{max(top, shard) / (gbps * 1e9):.3f} s at {gbps:g} GB/s, the same at any number of replicas")
