"""The world split for a rollout on ranks of its own, and the bridge groups between the two halves.

A launch of trainer T + rollout R processes (the trainer's first) becomes two worlds: inside `split_world`, each
process's default torch.distributed group is its own half (the trainer's ranks 0..T-1, the rollout's 0..R-1), so
everything that reads the default group (megatron layouts, the hybrid engine, the rollout exchange, reward scoring,
checkpoints) runs unchanged in either half. Two bridge groups span all T + R ranks (trainer rank t = bridge rank t,
rollout rank r = bridge rank T + r), made straight from the launch's store as SGLang's and vLLM's weight-update
groups are:

    data      gloo: scored batches (host tensors), the start message
    weights   the device's backend (NCCL on GPU, gloo on CPU): the generation shards, in buckets

Two groups, so a weight push in flight never sits in front of a batch on the same channel. On exit the default
group is the whole world again (a test world runs several commands in one launch); after an error it is not.
"""
from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(minutes=30)
_splits = 0  # every rank splits the same number of times: the store prefixes agree


@dataclass
class Placement:
    """This process's side of a split world."""
    role: str                 # "trainer" or "rollout"
    trainer_ranks: int
    rollout_ranks: int
    bridge_rank: int          # the process's rank in the bridge groups (its rank in the launched world)
    data: object              # the gloo bridge group
    weights: object           # the device-backend bridge group

    @property
    def is_trainer(self) -> bool:
        return self.role == "trainer"

    def rollout_bridge_rank(self, rollout_rank: int) -> int:
        return self.trainer_ranks + rollout_rank


def send(group, tensor: torch.Tensor, dst: int, wait: bool = True):
    work = group.send([tensor], dst, 0)
    if wait:
        work.wait()
    return work


def recv(group, tensor: torch.Tensor, src: int) -> torch.Tensor:
    group.recv([tensor], src, 0).wait()
    return tensor


def _group(backend: str, store, rank: int, size: int):
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, TIMEOUT)


@contextlib.contextmanager
def split_world(trainer_ranks: int) -> Iterator[Placement]:
    """Split the initialised world into the trainer's first `trainer_ranks` ranks and the rollout's rest (see the
    module docstring); restores the whole world on exit."""
    global _splits
    from torch.distributed.distributed_c10d import _get_default_store

    rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    if not 0 < trainer_ranks < world:
        raise ValueError(f"a world of {world} ranks cannot hold {trainer_ranks} trainer ranks and at least one "
                         "rollout rank; check trainer.* and rollout.nnodes / n_gpus_per_node")
    store = _get_default_store()
    _splits += 1
    tag = f"tripod/split_{_splits}"
    role = "trainer" if rank < trainer_ranks else "rollout"
    local, size = (rank, trainer_ranks) if role == "trainer" else (rank - trainer_ranks, world - trainer_ranks)
    dist.destroy_process_group()
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"{tag}/{role}", store), rank=local,
                            world_size=size, timeout=TIMEOUT)
    data = _group("gloo", dist.PrefixStore(f"{tag}/data", store), rank, world)
    weights = data if backend == "gloo" else _group(backend, dist.PrefixStore(f"{tag}/weights", store), rank, world)
    yield Placement(role, trainer_ranks, world - trainer_ranks, rank, data, weights)
    # not on an error: the other half may never come back to join the whole world again
    dist.destroy_process_group()
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"{tag}/world", store), rank=rank,
                            world_size=world, timeout=TIMEOUT)
