"""torchrun worker (2 ranks, DP2): the distributed optimizer's state saved by engine/checkpoints/optimizer_state.py
against megatron's own fully_reshardable save of the same state.

argv: HF_DIR DIR. For fp32 and bf16 parameters: one Adam step with random gradients, then the state is saved by
megatron (`dist_checkpointing.save` of megatron's sharded_state_dict: it gathers the whole state) and by tripod's
streamed save; every tensor of the two checkpoints must be equal bit for bit, their keys the same, and tripod's files no larger
(a slice written with its whole storage would be). Then a staged
save (an asynchronous save's) is planned, the optimizer steps again before it is written, and what it wrote must
still equal the state at planning. The unstaged save must hand torch.save the tensors themselves (each streamed
chunk's view, each live tensor: tests/helpers/serialized.py), not copies. Prints `OPTIM_SAVE <what>` lines (rank 0).
"""
import contextlib
import os
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker
from tests.helpers.serialized import serialized_tensors


def read_all(path: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path + ".pt"
    dcp_to_torch_save(path, out)
    return {k: v for k, v in torch.load(out).items() if isinstance(v, torch.Tensor)}


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def step(actor, seed: int) -> None:
    for chunk in actor.model:
        chunk.zero_grad_buffer()
        for p in chunk.parameters():
            p.main_grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))
    assert actor.optimizer.step()[0]


@contextlib.contextmanager
def streamed_chunks():
    """{item index: tensor} of every optimizer-state tensor the save's fill hands to the writer (a view of the chunk
    gathered on data-parallel rank 0), held until checked."""
    from tripod.engine.checkpoints.optimizer_state import GatheredOptimizerState

    original, yielded = GatheredOptimizerState.stream, {}

    def stream(self, items):
        for item, t in original(self, items):
            yielded[item.index] = t
            yield item, t

    GatheredOptimizerState.stream = stream
    try:
        yield yielded
    finally:
        GatheredOptimizerState.stream = original


def check_no_copy(serialized, yielded, planned, rank: int) -> None:
    """Every tensor torch.save got is the memory it was handed, without a copy: a streamed chunk's view or a live
    tensor of the plan, each as an alias holding its own bytes only."""
    assert serialized or rank != 0, "data-parallel rank 0 serialized no tensor: the check saw nothing"
    assert rank != 0 or yielded, "no optimizer state was streamed on data-parallel rank 0"
    for s in serialized:
        live = yielded.get(s.index)
        assert (live is not None and s.is_view_of(live)) or (live is None and any(s.is_view_of(t) for t in planned)), (
            f"{s.index}: the file got a copy (or a whole buffer), not the tensor handed to the writer: {s}")


def main() -> None:
    from megatron.core import dist_checkpointing

    from tripod.engine.checkpoints.optimizer_state import OPTIM_METADATA, plan_optimizer_save
    from tripod.engine.config import OptimConfig
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.checkpoint import sharded_model_state
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.megatron_patches.checkpoint_save import tensors_written
    from tripod.parallel.precision import PrecisionSettings

    hf_dir, root = sys.argv[1], sys.argv[2]
    rank = dist.get_rank()
    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(name="DP2", arch=arch, tp=1, pp=1, dp=2, ranks=[0, 1])
    for dtype in (torch.float32, torch.bfloat16):
        actor = PolicyWorker("actor", arch, layout, hf_dir, optim=OptimConfig(optimizer="adam", lr=1e-3),
                             precision=PrecisionSettings(param_dtype=dtype, use_distributed_optimizer=True))
        step(actor, 1)
        dirs = {name: os.path.join(root, f"{name}-{dtype}".replace("torch.", "")) for name in ("megatron", "tripod", "staged")}
        if rank == 0:
            for d in dirs.values():
                os.makedirs(d)
        dist.barrier()
        with layout.activate():
            reference = actor.optimizer.sharded_state_dict(sharded_model_state(actor.chunks), metadata=OPTIM_METADATA)
            dist_checkpointing.save(reference, dirs["megatron"])
        del reference
        pending = plan_optimizer_save(actor, dirs["tripod"], stage=False)
        with serialized_tensors() as serialized, streamed_chunks() as yielded:
            pending.write()
        check_no_copy(serialized, yielded, tensors_written(pending), rank)
        pending.finish()
        staged = plan_optimizer_save(actor, dirs["staged"], stage=True)
        step(actor, 2)  # training goes on before the staged save is written
        staged.write()
        staged.finish()
        dist.barrier()
        if rank == 0:
            theirs, ours, snapshot = (read_all(dirs[n]) for n in ("megatron", "tripod", "staged"))
            assert sorted(theirs) == sorted(ours) == sorted(snapshot), (sorted(theirs)[:5], sorted(ours)[:5])
            assert any(k.startswith("optimizer.state.exp_avg.") for k in theirs), sorted(theirs)[:5]
            for k in theirs:
                assert torch.equal(theirs[k], ours[k]), f"{dtype} {k}: tripod's save differs from megatron's"
                assert torch.equal(theirs[k], snapshot[k]), f"{dtype} {k}: the staged save is not the state at planning"
            sizes = [dir_bytes(dirs[n]) for n in ("megatron", "tripod", "staged")]
            assert max(sizes[1:]) <= 1.05 * sizes[0], f"{dtype}: tripod's files are larger than megatron's: {sizes}"
            print(f"OPTIM_SAVE {dtype}: {len(theirs)} tensors equal megatron's, staged equal too", flush=True)
        dist.barrier()


if __name__ == "__main__":
    dist_worker(main)
