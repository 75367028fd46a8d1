"""runtime/device.py: one device decision per rank, and the guard that proves a trainer step stayed on it.

The trainer-step check itself runs in tests/multiprocess/test_precision.py (TRIPOD_CHECK_DEVICES=1 on a DP=2 run) and in
scripts/gpu_check.py on CUDA; here the guard is shown to catch what it must and to let transfers through."""
import pytest
import torch


def test_guard_flags_ops_that_mix_devices_not_host_bookkeeping():
    """The meta device plays the GPU: a host index fed to a device op is flagged; building a small host tensor and
    moving it (batch assembly), and 0-dim host scalars, are not."""
    from tripod.runtime.device import DeviceGuard

    with DeviceGuard("meta") as guard:
        x = torch.randn(5, 3, device="meta")
        rows = torch.tensor([0, 2, 4])  # host bookkeeping
        batch = torch.ones(3, 3).to("meta")  # built on the host, then moved on purpose: a transfer
        (x[: 3] + batch).mul(torch.tensor(2.0))  # 0-dim host scalars are fine on any device
        x[rows]  # planted: a host index tensor in a device op (a hidden host-to-device sync on CUDA)
    assert guard.violations == [("aten.index.Tensor", "cpu")], guard.violations


def test_guard_flags_large_host_compute_only():
    from tripod.runtime.device import LARGE_HOST_NUMEL, DeviceGuard

    n = int(LARGE_HOST_NUMEL ** 0.5)
    with DeviceGuard("meta") as guard:
        big = torch.randn(n, n)  # host data, e.g. a gathered batch: bookkeeping
        torch.cat([big, big]).masked_fill_(torch.zeros(2 * n, n, dtype=torch.bool), 0.0)
        (torch.randn(8, 8) @ torch.randn(8, 8)).softmax(-1)  # small host math (sampling bookkeeping)
        torch.arange(4 * n * n).view(4 * n, n).sum(-1)  # integer work
        big @ big  # planted: a large matmul on the host while the device is elsewhere
    assert guard.violations == [("aten.mm.default", "cpu")], guard.violations
    with DeviceGuard("cpu") as host:
        big @ big  # the host is the compute device: nothing to flag
    assert host.violations == []


def test_select_device_refuses_cuda_without_a_gpu(monkeypatch):
    from tripod.runtime import device

    monkeypatch.setattr(device, "_chosen", None)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="trainer.device=cuda") as e:
        device.select_device("cuda")
    assert "\n" not in str(e.value)
    assert device.select_device("cpu") == torch.device("cpu") == device.current_device()
