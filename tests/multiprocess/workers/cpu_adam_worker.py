"""torchrun worker (2 ranks, DP2): megatron_patches/cpu_adam.py inside tripod's workers, and its canary.

argv: HF_DIR. For the plain and the distributed optimizer: every torch Adam inside the actor's megatron optimizer
runs torch's fused CPU kernel (tripod's patch), one update steps without error and moves the weights alike on both
ranks; and megatron's own `get_megatron_optimizer` over the same model still builds the unfused one (the canary:
once it does not, the patch can go). Prints `CPU_ADAM <what>` lines (rank 0).
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker


def main() -> None:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from tripod.engine.config import OptimConfig
    from tripod.engine.workers.ppo_workers import PolicyWorker
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.layout import ParallelLayout
    from tripod.parallel.megatron_patches.cpu_adam import torch_adams
    from tripod.parallel.precision import PrecisionSettings

    hf_dir = sys.argv[1]
    arch = arch_from_hf(hf_dir)
    layout = ParallelLayout(name="DP2", arch=arch, tp=1, pp=1, dp=2, ranks=[0, 1])
    for distributed in (False, True):
        actor = PolicyWorker("actor", arch, layout, hf_dir, optim=OptimConfig(optimizer="adam", lr=1e-3),
                             precision=PrecisionSettings(use_distributed_optimizer=distributed))
        adams = torch_adams(actor.optimizer)
        assert adams and all(group["fused"] for adam in adams for group in adam.param_groups), \
            f"distributed={distributed}: the actor's Adam is not fused"
        before = [p.detach().clone() for chunk in actor.chunks for p in chunk.parameters()]
        for chunk in actor.model:
            chunk.zero_grad_buffer()
            for p in chunk.parameters():
                p.main_grad.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        ok, _, _ = actor.optimizer.step()
        after = [p.detach() for chunk in actor.chunks for p in chunk.parameters()]
        assert ok and all(not torch.equal(a, b) for a, b in zip(before, after)), "the fused step did not move weights"
        moved = torch.stack([(a - b).abs().max() for a, b in zip(before, after)])
        gathered = [torch.zeros_like(moved) for _ in range(2)]
        dist.all_gather(gathered, moved)
        assert torch.equal(gathered[0], gathered[1]), "the ranks' weights moved differently"
        if dist.get_rank() == 0:
            print(f"CPU_ADAM tripod fused distributed={distributed}", flush=True)
        with layout.activate():
            plain = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3,
                                                           use_distributed_optimizer=distributed),
                                           actor.model, use_gloo_process_groups=False,
                                           pg_collection=layout.pg_collection)
        assert not any(group.get("fused") for adam in torch_adams(plain) for group in adam.param_groups), (
            "megatron now builds a fused Adam on CPU itself: tripod/parallel/megatron_patches/cpu_adam.py can go")
        if dist.get_rank() == 0:
            print(f"CPU_ADAM megatron unfused distributed={distributed}", flush=True)


if __name__ == "__main__":
    dist_worker(main)
