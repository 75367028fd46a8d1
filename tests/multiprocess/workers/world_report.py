"""torchrun worker for tests/multiprocess/test_forked_worlds.py: prints what a rank sees of its launch (the launcher's
environment variables, argv, sys.path[0], cwd, torch's RNG and thread count), then fails on the rank argv names."""
import json
import os
import sys

import torch
import torch.distributed as dist

from tests.helpers.common import dist_worker

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
               "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS",
               "TRIPOD_WORLD_TEST")


def main() -> None:
    fail_rank = int(sys.argv[1])
    seen = {k: os.environ.get(k) for k in LAUNCH_VARS}
    seen.update(argv=sys.argv[1:], path0=sys.path[0], cwd=os.getcwd(), rand=torch.rand(2).tolist(),
                threads=torch.get_num_threads(), world=dist.get_world_size())
    print(f"WORLD_REPORT {json.dumps(seen, sort_keys=True)}", flush=True)
    if dist.get_rank() == fail_rank:
        raise ValueError(f"planted failure on rank {fail_rank}")
    dist.barrier()


if __name__ == "__main__":
    dist_worker(main)
