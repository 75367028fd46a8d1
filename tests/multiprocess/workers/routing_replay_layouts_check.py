"""torchrun worker (4 ranks): routing replay (parallel/router_replay.py) with expert tensor parallelism and with
virtual pipeline stages, the checks of routing_replay_check.py's `check_layout` (bf16 actor against the embedded
engine's bf16 record: mismatch > 0 without replay and 0 with it, a smaller log-prob gap, R2's round trip exact, the
planted layer shift caught, the router still learning under replay).

argv: hf_dir (the near-tied tiny Qwen3-MoE of tests/multiprocess/test_routing_replay.py). Layouts:
  ETP2  tp=1, dp=4, ep=2, expert_tensor_parallel_size=2: each expert's weights split over 2 ranks that attention
        runs as DP ranks; megatron's dispatcher gathers over all 4 (tp_ep), each DP rank packing its own rows
  VPP2  pp=2 with 2 virtual stages per rank, dp=2: each router's layer on its own chunk
Prints `RR <model> <layout> <quantity> <value>` lines and RRL-OK.
"""
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker
from tests.multiprocess.workers.routing_replay_check import check_layout, make_batch, rollout


def main():
    from tripod.parallel.arch import arch_from_hf

    hf_dir = sys.argv[1]
    arch = arch_from_hf(hf_dir)
    prompts, out = rollout(hf_dir, arch, torch.bfloat16)
    batch, _, _ = make_batch(prompts, out, arch)
    ranks = list(range(4))
    check_layout("ETP2", hf_dir, arch, batch, dict(tp=1, pp=1, dp=4, ep=2, etp=2, ranks=ranks), arch.family, micro=2)
    check_layout("VPP2", hf_dir, arch, batch, dict(tp=1, pp=2, dp=2, ranks=ranks), arch.family, micro=2,
                 virtual_pipeline_size=2)
    dist.barrier()
    if dist.get_rank() == 0:
        print("RRL-OK", flush=True)


if __name__ == "__main__":
    dist_worker(main)
