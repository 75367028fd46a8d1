"""The world split for a rollout on ranks of its own, and the bridge groups between the two halves.

A launch of trainer T + rollout R processes (the trainer's first) becomes two worlds: inside `split_world`, each
process's default torch.distributed group is its own half (the trainer's ranks 0..T-1, the rollout's 0..R-1), so
everything that reads the default group (megatron layouts, the hybrid engine, the rollout exchange, reward scoring,
checkpoints) runs unchanged in either half. Bridge groups span both halves (trainer rank t = bridge rank t, rollout
rank r = bridge rank T + r), made straight from the launch's store as SGLang's and vLLM's weight-update groups are:

    data      gloo, all T + R ranks: the scored batches' heads (host tensors), the start message, the row requests
    rows      the device's backend (NCCL on GPU; on CPU the data group, other tags), all T + R ranks: each trainer
              rank's rows of a batch, from a rollout rank (async_rollout/rows.py)
    weights   the device's backend, one group per (rollout TP slice, sending trainer rank): that rank and the slice's
              rank of every replica (async_rollout/weights.py `slice_groups`, from `Placement.store`)

Separate groups (or tags), so a weight push in flight never sits in front of a batch. On exit the default
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
    rows: object = None       # the device-backend group of the rows (None: `data`)
    backend: str = "gloo"     # of `weights` and `rows`
    store: object = None      # the launch's store under this split's prefix: more bridge groups (weights.py)

    @property
    def is_trainer(self) -> bool:
        return self.role == "trainer"

    def rollout_bridge_rank(self, rollout_rank: int) -> int:
        return self.trainer_ranks + rollout_rank


    @property
    def row_group(self):
        return self.rows if self.rows is not None else self.data


def send(group, tensor: torch.Tensor, dst: int, wait: bool = True, tag: int = 0):
    work = group.send([tensor], dst, tag)
    if wait:
        work.wait()
    return work


def recv(group, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
    group.recv([tensor], src, tag).wait()
    return tensor


def new_group(backend: str, store, rank: int, size: int):
    """A process group of `size` processes straight from `store` (every member passes the same store prefix)."""
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
    data = new_group("gloo", dist.PrefixStore(f"{tag}/data", store), rank, world)
    rows = data if backend == "gloo" else new_group(backend, dist.PrefixStore(f"{tag}/rows", store), rank, world)
    yield Placement(role, trainer_ranks, world - trainer_ranks, rank, data, rows, backend,
                    dist.PrefixStore(f"{tag}/groups", store))
    # not on an error: the other half may never come back to join the whole world again
    dist.destroy_process_group()
    dist.init_process_group(backend=backend, store=dist.PrefixStore(f"{tag}/world", store), rank=rank,
                            world_size=world, timeout=TIMEOUT)
