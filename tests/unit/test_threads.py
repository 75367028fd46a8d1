"""Threads per rank (engine/launch.py `threads_per_rank`, preflight's `resolve_threads`): an explicit key wins,
then OMP_NUM_THREADS, then a SLURM step's own share, then the process's cores over the ranks that share the node."""
from __future__ import annotations

import os

from omegaconf import OmegaConf

from tripod.engine.config import TripodConfig
from tripod.engine.launch import cores_available, threads_per_rank
from tripod.engine.preflight import resolve_threads


def test_precedence():
    assert threads_per_rank(2, requested=3, env={"OMP_NUM_THREADS": "5"}) == (3, "trainer.threads_per_rank")
    assert threads_per_rank(2, env={"OMP_NUM_THREADS": "5,1", "SLURM_CPUS_PER_TASK": "7", "SLURM_STEP_ID": "0"}) \
        == (5, "OMP_NUM_THREADS")
    assert threads_per_rank(2, env={"SLURM_CPUS_PER_TASK": "7", "SLURM_STEP_ID": "0"}) == (7, "SLURM_CPUS_PER_TASK")
    # an allocation's SLURM_CPUS_PER_TASK outside a step (salloc shell) says nothing about this process
    assert threads_per_rank(1, env={"SLURM_CPUS_PER_TASK": "7"})[0] == cores_available()


def test_auto_splits_the_cores_this_process_may_use():
    cores = len(os.sched_getaffinity(0))
    assert cores_available() == cores
    for ranks in (1, 2, 3, 64):
        n, source = threads_per_rank(ranks, env={})
        assert n == max(1, cores // ranks) and n * min(ranks, cores) <= cores, (ranks, n)
        assert f"{cores} cores" in source


def test_resolve_threads_writes_the_number_into_the_config(capsys):
    cfg = OmegaConf.to_object(OmegaConf.structured(TripodConfig))
    env_omp = os.environ.pop("OMP_NUM_THREADS", None)
    try:
        resolve_threads(cfg, ranks_per_node=2, announce=True)
    finally:
        if env_omp is not None:
            os.environ["OMP_NUM_THREADS"] = env_omp
    assert cfg.trainer.threads_per_rank == max(1, cores_available() // 2)
    assert "per rank" in capsys.readouterr().out
    cfg.trainer.threads_per_rank = 4  # explicit: kept as given
    resolve_threads(cfg, ranks_per_node=2)
    assert cfg.trainer.threads_per_rank == 4
