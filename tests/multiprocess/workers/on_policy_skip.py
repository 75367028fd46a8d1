"""torchrun worker (1 rank): tests/multiprocess/test_bench.py's on-policy check (`_on_policy_child`: the same GRPO
step with the old-log-prob recompute skipped, forced, and planted wrong), in-process on this world.

argv: MODEL_DIR TRAIN_PARQUET. Prints `RESULT <json>` (rank 0).
"""
import sys

from tests.multiprocess import test_bench
from tripod.engine.launch import run_distributed

if __name__ == "__main__":
    run_distributed(1, test_bench._on_policy_child, sys.argv[1], sys.argv[2])
