"""engine/device.py: one device decision per rank, and the guard that proves a trainer step stayed on it.

The trainer-step check itself runs in tests/multiprocess/test_precision.py (TRIPOD_CHECK_DEVICES=1 on a DP=2 run) and in
scripts/gpu_check.py on CUDA; here the guard is shown to catch what it must and to let transfers through."""
import pytest
import torch


def test_guard_flags_a_tensor_on_another_device():
    from tripod.engine.device import DeviceGuard

    with DeviceGuard("cpu") as guard:
        x = torch.randn(4, 4)
        (x @ x).sum()
        torch.empty(3, device="meta").add_(1)  # planted: compute on another device
    assert guard.violations == [("aten.empty.memory_format", "meta"), ("aten.add_.Tensor", "meta")], guard.violations


def test_guard_passes_transfers_and_scalars():
    from tripod.engine.device import DeviceGuard

    with DeviceGuard("meta") as guard:
        x = torch.randn(3, 3, device="meta")
        y = torch.ones(3, 3).to("meta")  # created on the host, then moved on purpose: a transfer
        (x + y).mul(torch.tensor(2.0))  # 0-dim host scalars are fine on any device
    assert [op for op, _ in guard.violations] == ["aten.ones.default"], guard.violations


def test_select_device_refuses_cuda_without_a_gpu(monkeypatch):
    from tripod.engine import device

    monkeypatch.setattr(device, "_chosen", None)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="trainer.device=cuda") as e:
        device.select_device("cuda")
    assert "\n" not in str(e.value)
    assert device.select_device("cpu") == torch.device("cpu") == device.current_device()
