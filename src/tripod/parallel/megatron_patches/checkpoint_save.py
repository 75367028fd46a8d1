"""Synchronous dist-checkpoint saves without megatron's spawned results Manager.

megatron-core 0.16.1 writes every dist-checkpoint through its async writer (`FileSystemWriterAsync`), also when the
save is synchronous: the writer processes it forks hand their results to one process-wide queue that
`filesystem_async._get_write_results_queue` makes with `multiprocessing.get_context("spawn").Manager()`. That
Manager is a fresh interpreter, started on a rank's first save; it re-imports the launching script as
`__mp_main__` and imports torch to unpickle the first results it is handed. Measured on a tiny 1-rank PPO run
(2-core AMD EPYC, 2026-12-02): 3.5 of the run's 13 s, every run, every rank, whatever the checkpoint's size.

tripod saves synchronously only: the results are put and read back by the same process (`execute_sync`). So
`save_synchronously` runs the save with an in-process `queue.Queue` in the Manager's place and puts megatron's
function back afterwards (an async save, which tripod does not make, would still get the Manager). Device: all.
Canary: tests/multiprocess/test_checkpoint_save.py (a plain `dist_checkpointing.save` still starts the Manager;
once it does not, this patch can go).
"""
from __future__ import annotations

import queue
from typing import Any


def save_synchronously(sharded_state_dict: dict[str, Any], checkpoint_dir: str) -> None:
    """`megatron.core.dist_checkpointing.save(sharded_state_dict, checkpoint_dir)` with its write results passed
    through an in-process queue instead of a spawned Manager's (module docstring). Collective, as the save is."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async._get_write_results_queue
    results: queue.Queue = queue.Queue()
    filesystem_async._get_write_results_queue = lambda: results
    try:
        dist_checkpointing.save(sharded_state_dict, checkpoint_dir)
    finally:
        filesystem_async._get_write_results_queue = original
    if not results.empty():
        raise RuntimeError(f"dist-checkpoint save to {checkpoint_dir}: write results were left unread "
                           "(megatron's writer changed; see tripod/parallel/megatron_patches/checkpoint_save.py)")
