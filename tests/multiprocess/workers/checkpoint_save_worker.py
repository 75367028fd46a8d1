"""torchrun worker (2 ranks): megatron_patches/checkpoint_save.py's synchronous save against megatron's own.

argv: DIR. Each rank holds half of a random [8, 5] tensor (a ShardedTensor along dim 0). `save_synchronously` must
write a checkpoint that loads back bit for bit without megatron's spawned results Manager ever being made; then a
plain `dist_checkpointing.save` must make it (the canary: once megatron stops doing that, the patch can go).
Prints `CKPT_SAVE <what>` lines (rank 0).
"""
import os
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker


def main() -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from tripod.parallel.megatron_patches.checkpoint_save import save_synchronously

    root, rank, world = sys.argv[1], dist.get_rank(), dist.get_world_size()
    full = torch.randn(8, 5, generator=torch.Generator().manual_seed(123))
    part = full.chunk(world)[rank].clone()

    def state(t: torch.Tensor) -> dict:
        return {"w": ShardedTensor.from_rank_offsets("w", t, (0, rank, world))}

    patched, plain = os.path.join(root, "patched"), os.path.join(root, "plain")
    if rank == 0:
        os.makedirs(patched)
        os.makedirs(plain)
    dist.barrier()
    save_synchronously(state(part), patched)
    assert filesystem_async._results_queue is None, "save_synchronously started megatron's results Manager"
    loaded = dist_checkpointing.load(state(torch.empty_like(part)), patched)["w"]
    assert torch.equal(loaded, part), "the patched save did not load back bit for bit"
    if rank == 0:
        print("CKPT_SAVE patched: loads back bit for bit, no Manager", flush=True)
    dist_checkpointing.save(state(part), plain)
    assert filesystem_async._results_queue is not None, (
        "megatron's plain dist_checkpointing.save no longer starts a results Manager: "
        "tripod/parallel/megatron_patches/checkpoint_save.py can go")
    if rank == 0:
        print("CKPT_SAVE plain: megatron still starts its Manager", flush=True)


if __name__ == "__main__":
    dist_worker(main)
