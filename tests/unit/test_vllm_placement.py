"""Which device each rank's vLLM engine runs on (engine/rollout/vllm_engine.py `placement`), without vLLM or a GPU.

vLLM's uni-process executor runs its worker on cuda:<index of device_config.device>, i.e. cuda:0 for "cuda"; its
external launcher runs it on the visible ordinal LOCAL_RANK (vLLM 0.32: v1/executor/uniproc_executor.py
`_distributed_args`, v1/worker/gpu_worker.py `init_device`, platforms/interface.py
`logical_device_id_to_visible_device_id`; read, not run: no GPU here). `vllm_device` below is that rule, so the
test states the device each rank's engine gets: its own CUDA device (what runtime/device.py set from LOCAL_RANK,
under any CUDA_VISIBLE_DEVICES), and no two ranks of a node share one. Planted: the old choice (the external
launcher only at TP > 1) puts every TP1 rank of an 8-GPU node on cuda:0, and the same check fails.
"""
import pytest

from tripod.engine.rollout.vllm_engine import placement


def vllm_device(kwargs: dict, env: dict) -> str:
    """The device vLLM's GPU worker picks for these LLM kwargs and this environment (see the module docstring)."""
    if kwargs.get("distributed_executor_backend") == "external_launcher":
        return f"cuda:{int(env['LOCAL_RANK'])}"
    return "cuda:0"


def node_devices(tp: int, world: int, visible: str | None, place=placement) -> list[str]:
    devices = []
    for rank in range(world):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank)}
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        kwargs, overrides = place(tp, True, world, rank, rank, env)  # runtime/device.py: cuda:LOCAL_RANK
        devices.append(vllm_device(kwargs, {**env, **overrides}))
    return devices


@pytest.mark.parametrize("tp, world, visible", [(1, 8, None), (1, 4, "4,5,6,7"), (2, 8, None), (1, 2, "1,0")])
def test_each_rank_engine_on_its_own_device(tp, world, visible):
    assert node_devices(tp, world, visible) == [f"cuda:{r}" for r in range(world)]


def test_placement_rules():
    # one rank on one GPU, and CPU at TP 1: the uni-process executor, nothing set
    assert placement(1, True, 1, 0, 0, {}) == ({}, {})
    assert placement(1, False, 4, 2, None, {"RANK": "2", "LOCAL_RANK": "2"}) == ({}, {})
    # a single-rank world on cuda:1 (CUDA_VISIBLE_DEVICES unset, LOCAL_RANK missing): told explicitly
    assert placement(1, True, 1, 0, 1, {}) == ({"distributed_executor_backend": "external_launcher"},
                                               {"RANK": "0", "LOCAL_RANK": "1"})
    # CPU TP 2 (the tested CPU path): the external launcher, the launcher's RANK kept, no LOCAL_RANK needed
    assert placement(2, False, 2, 1, None, {"RANK": "1"}) == ({"distributed_executor_backend": "external_launcher"}, {})


def test_planted_uniproc_at_tp1_lands_every_rank_on_cuda0():
    def old(tp_size, on_cuda, world_size, rank, device_index, env):  # planted: the external launcher at TP > 1 only
        return ({"distributed_executor_backend": "external_launcher"} if tp_size > 1 else {}), {}

    devices = node_devices(1, 8, None, place=old)
    assert devices == ["cuda:0"] * 8 and devices != [f"cuda:{r}" for r in range(8)]
