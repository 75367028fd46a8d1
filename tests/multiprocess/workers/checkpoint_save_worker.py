"""torchrun worker (2 ranks): megatron_patches/checkpoint_save.py's save against megatron's own.

argv: DIR. Each rank holds half of a random [8, 5] tensor (a ShardedTensor along dim 0) as a view of a larger buffer,
as the distributed optimizer's parameters are. `plan_save` must write a checkpoint that loads back bit for bit,
from the live tensor itself (no clone: what torch.save serializes is the live tensor's memory, tests/helpers/serialized.py), without forking and without megatron's spawned results Manager; a staged
plan must hold a snapshot (a write after planning does not reach the file). Then a plain `dist_checkpointing.save`
must still fork and make the Manager (the canary: once megatron stops doing that, the patch can go).
Prints `CKPT_SAVE <what>` lines (rank 0).
"""
import os
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker
from tests.helpers.serialized import serialized_tensors


def main() -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from tripod.parallel.megatron_patches.checkpoint_save import plan_save, tensors_written

    root, rank, world = sys.argv[1], dist.get_rank(), dist.get_world_size()
    full = torch.randn(8, 5, generator=torch.Generator().manual_seed(123))
    buffer = torch.zeros(100)  # the part is a view of a larger storage, like a DDP param buffer's parameters
    part = buffer[10:10 + full.numel() // world].view(-1, 5)
    part.copy_(full.chunk(world)[rank])
    forks = []
    real_fork = os.fork

    def counting_fork():
        forks.append(1)
        return real_fork()
    os.fork = counting_fork

    def state(t: torch.Tensor) -> dict:
        return {"w": ShardedTensor.from_rank_offsets("w", t, (0, rank, world))}

    patched, staged, plain = (os.path.join(root, d) for d in ("patched", "staged", "plain"))
    if rank == 0:
        for d in (patched, staged, plain):
            os.makedirs(d)
    dist.barrier()
    pending = plan_save(state(part), patched)
    written = tensors_written(pending)
    assert [t.data_ptr() for t in written] == [part.data_ptr()], "the save planned a copy of the live tensor"
    with serialized_tensors() as serialized:
        pending.write()
    # what torch.save got: the live tensor's own memory, as an alias holding its bytes only (not the buffer's)
    assert [s.index.fqn for s in serialized] == ["w"], serialized
    assert serialized[0].is_view_of(part), (
        f"the file got a copy of the live tensor, or its whole buffer: {serialized[0]} vs the live tensor at "
        f"{part.data_ptr()} ({part.numel() * part.element_size()} bytes)")
    pending.finish()
    assert not forks, f"the save forked {len(forks)} writer processes"
    assert filesystem_async._results_queue is None, "the save started megatron's results Manager"
    loaded = dist_checkpointing.load(state(torch.empty_like(part)), patched)["w"]
    assert torch.equal(loaded, part), "the patched save did not load back bit for bit"
    if rank == 0:
        print("CKPT_SAVE patched: loads back bit for bit, written from the live tensor, no fork, no Manager", flush=True)
    snapshot = part.clone()
    pending = plan_save(state(part), staged, stage=True)
    part.add_(1.0)  # training goes on while an asynchronous save writes
    pending.write()
    pending.finish()
    loaded = dist_checkpointing.load(state(torch.empty_like(part)), staged)["w"]
    assert torch.equal(loaded, snapshot), "a write after staging reached the checkpoint"
    if rank == 0:
        print("CKPT_SAVE staged: the checkpoint is the state at planning", flush=True)
    dist_checkpointing.save(state(part), plain)
    assert forks and filesystem_async._results_queue is not None, (
        "megatron's plain dist_checkpointing.save no longer forks writers and starts a results Manager: "
        "tripod/parallel/megatron_patches/checkpoint_save.py can go")
    if rank == 0:
        print("CKPT_SAVE plain: megatron still forks its writers and starts its Manager", flush=True)


if __name__ == "__main__":
    dist_worker(main)
