"""torchrun worker: `tripod train` with one planted bug, to prove the SP / VPP equivalence checks can fail.

argv: BUG then the `tripod train` arguments. Bugs:
  sp_value_grad        the critic's value head sums its sequence-parallel gradient over TP instead of
                       splitting it (every TP rank already holds the full gradient: a TP-fold over-count)
  vpp_drop_chunk_grad  the gradients of the first virtual-pipeline chunk are dropped before each optimizer step
"""
import sys

import torch


def plant(bug: str) -> None:
    if bug == "sp_value_grad":
        import torch.nn.functional as F
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        from tripod.parallel.model import ValueHead

        def forward(self, hidden, weight=None, runtime_gather_output=None):
            if self.sequence_parallel:
                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                              group=self.tp_group)
            return F.linear(hidden, self.weight, self.bias), None

        ValueHead.forward = forward
    elif bug == "vpp_drop_chunk_grad":
        from tripod.engine.workers.megatron_worker import MegatronWorker

        step = MegatronWorker.step

        def dropping_step(self):
            if len(self.model) > 1:
                with torch.no_grad():
                    for p in self.model[0].parameters():
                        p.main_grad.zero_()
            return step(self)

        MegatronWorker.step = dropping_step
    else:
        raise SystemExit(f"unknown planted bug {bug!r}")


if __name__ == "__main__":
    from tripod.engine.cli import main

    plant(sys.argv[1])
    sys.exit(main(["train", *sys.argv[2:]]))
