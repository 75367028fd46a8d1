"""megatron's *_GLOO data-parallel groups are gloo groups (parallel/layout.py `_build_gloo_groups`), and the packed
layouts' index tensors follow the data's device (engine/workers/packing.py, parallel/context_parallel.py).

Gloo groups: a 2-rank world (DP2) whose default backend is not plain "gloo": "cpu:gloo", the device-mapped form of
"cpu:gloo,cuda:nccl" that a CPU-only torch can start (it has no NCCL), so tripod takes the path it takes under NCCL.
Inside `layout.activate()`, parallel_state's get_data_parallel_group_gloo() (with and without CP, and the expert
one) must report backend "gloo", be a different group object from the device group
(get_data_parallel_group()), and all-gather CPU tensors. In a plain "gloo" world they are the device groups (nothing
extra is made). Planted: the old mapping (the *_GLOO names on the device groups) fails the backend / distinct check.
What this cannot check here: an NCCL device group refusing a CPU tensor (no NCCL in this torch).

Device of index tensors: the meta device plays the GPU (tests/unit/test_device.py's convention): a packed layout
grown for SP / CP / MoE padding (`PackedRows.padded_to`) and a CP split (`split_for_cp`) run under `DeviceGuard`
with every operand on meta must flag nothing; planted, the pad slots' index built on the host is flagged.
"""
import json
import os
import subprocess
import sys
import textwrap

import torch

from tests.helpers.common import REPO_ROOT

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def world(rank, port, backend, plant):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group(backend, rank=rank, world_size=2)
        from megatron.core import parallel_state as ps
        from tripod.parallel.layout import ParallelLayout
        if plant:  # the old mapping: megatron's gloo names on the device groups (the last world: it stays planted)
            from tripod.parallel.megatron_patches import parallel_state_groups as psg
            for name in list(psg.GROUPS):
                if psg.GROUPS[name].endswith("_gloo"):
                    psg.GROUPS[name] = psg.GROUPS[name][:-len("_gloo")]
        layout = ParallelLayout(tp=1, pp=1, name="actor")
        with layout.activate():
            device = ps.get_data_parallel_group()
            hosts = [ps.get_data_parallel_group_gloo(), ps.get_data_parallel_group_gloo(with_context_parallel=True),
                     ps.get_expert_data_parallel_group_gloo()]
            backends = [dist.get_backend(g) for g in hosts]
            distinct = all(g is not device for g in hosts)
            parts = [torch.empty(3) for _ in range(2)]
            dist.all_gather(parts, torch.full((3,), float(rank)), group=hosts[0])
        result = (dist.get_backend(), backends, distinct, torch.stack(parts)[:, 0].tolist())
        dist.barrier()
        dist.destroy_process_group()
        return result

    def run(rank, worlds, q):
        torch.set_num_threads(1)
        results = [world(rank, *w) for w in worlds]  # one process pair, the worlds one after another
        if rank == 0:
            q.put(results)

    if __name__ == "__main__":
        worlds = json.loads(sys.argv[1])
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        mp.start_processes(run, args=(worlds, q), nprocs=2, start_method="spawn")
        print("GROUPS", json.dumps(q.get()))
""")


def _worlds(tmp_path, *worlds: tuple[str, bool]) -> list:
    """Each (backend, plant) world's (world backend, the three gloo groups' backends, distinct, gathered)."""
    from tests.helpers.common import free_port

    script = tmp_path / "gloo_groups.py"
    script.write_text(SCRIPT)
    spec = json.dumps([(str(free_port()), backend, plant) for backend, plant in worlds])
    proc = subprocess.run([sys.executable, str(script), spec],
                          cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stdout[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("GROUPS"))
    print(line)
    return json.loads(line.split(" ", 1)[1])


def _gloo_twins_ok(result) -> bool:
    world_backend, backends, distinct, gathered = result
    return backends == ["gloo"] * 3 and distinct and gathered == [0.0, 1.0]


def test_megatrons_gloo_groups_are_gloo_groups(tmp_path):
    plain, result, planted = _worlds(tmp_path, ("gloo", False), ("cpu:gloo", False), ("cpu:gloo", True))
    assert result[0] == "cpu:gloo" and _gloo_twins_ok(result), result
    assert not _gloo_twins_ok(planted), planted
    world_backend, backends, distinct, gathered = plain
    assert backends == ["gloo"] * 3 and not distinct and gathered == [0.0, 1.0]  # a gloo world reuses its groups


def _padded_on_meta() -> tuple[list, str | None]:
    from tripod.engine.workers.packing import PackedRows
    from tripod.parallel.context_parallel import split_for_cp
    from tripod.runtime.device import DeviceGuard

    g, s, seq = 2, 6, 8
    rows = PackedRows(torch.zeros(g, s, dtype=torch.long, device="meta"),
                      torch.ones(g, 1, s, s, dtype=torch.bool, device="meta"),
                      torch.arange(s, device="meta"), torch.zeros(3, 4, dtype=torch.long, device="meta"))
    error = None
    with DeviceGuard("meta") as guard:
        try:
            grown = rows.padded_to(seq)
            split_for_cp(grown.input_ids, grown.positions, grown.mask, 2, 1)
            assert grown.mask.shape == (g, 1, seq, seq) and grown.mask.device.type == "meta"
        except RuntimeError as e:  # a mixed-device op that meta refuses (the guard has recorded it first)
            error = str(e).splitlines()[0]
    return guard.violations, error


def test_padding_index_tensors_follow_the_data_device(monkeypatch):
    assert _padded_on_meta() == ([], None)
    import tripod.engine.workers.packing as packing

    class HostArange:  # planted: torch with arange ignoring `device` (an index built on the host)
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def arange(*args, device=None, **kwargs):
            return torch.arange(*args, **kwargs)

    monkeypatch.setattr(packing, "torch", HostArange())
    violations, _ = _padded_on_meta()
    assert violations, violations
