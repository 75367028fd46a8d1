"""The one place that decides where this rank computes, and a guard that proves everything followed it.

    device = select_device("cuda")   # once per rank, before the process group: cuda:LOCAL_RANK, set current
    device = current_device()        # everyone else asks; nobody else calls torch.cuda.set_device

`select_device` reads `trainer.device` (passed through the environment variable TRIPOD_DEVICE by `tripod train`,
so spawned and torchrun-launched ranks agree) and LOCAL_RANK. Models (megatron allocates on
torch.cuda.current_device()), batches and masks (MegatronWorker), the rollout engine and the generation shard
(trainer / weight sync) and the kernels (kernels.* dispatch on the tensor's device: Triton on CUDA, torch twins
elsewhere) all take it from here.

`DeviceGuard` is a TorchDispatchMode that records every aten op whose tensor inputs or outputs live on a device
type other than the chosen one (explicit transfers such as `.to()` / `.cpu()` excepted). TRIPOD_CHECK_DEVICES=1
makes the trainer run every step under it and fail on the first step with a stray tensor; the check is the same
code on CPU and CUDA.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DEVICE_ENV = "TRIPOD_DEVICE"
CHECK_ENV = "TRIPOD_CHECK_DEVICES"
_chosen: Optional[torch.device] = None


def select_device(requested: str | None = None) -> torch.device:
    """Decide this rank's device from `requested` (cpu|cuda; default $TRIPOD_DEVICE, else cpu) and LOCAL_RANK;
    on CUDA make it torch's current device. Idempotent per process."""
    global _chosen
    requested = requested or os.environ.get(DEVICE_ENV) or "cpu"
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"trainer.device={requested!r} is not one of ['cpu', 'cuda']")
    if requested == "cpu":
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but this torch sees no CUDA device; set trainer.device=cpu or "
                             "install a CUDA build of torch")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(f"LOCAL_RANK={local_rank} but this node has {count} CUDA device(s); launch at most "
                             f"{count} processes per node (trainer.n_gpus_per_node)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    _chosen = device
    return device


def current_device() -> torch.device:
    """The device `select_device` chose (cpu if it was never called, as in single-process unit tests)."""
    return _chosen if _chosen is not None else torch.device("cpu")


def process_group_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


# ops that move data between devices on purpose (batches in, scalars/metrics out, reference offload)
_TRANSFERS = {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "lift_fresh", "lift_fresh_copy",
              "_local_scalar_dense", "_pin_memory", "is_pinned", "set_", "detach", "alias"}


class DeviceGuard(TorchDispatchMode):
    """Records aten ops touching a tensor on a device type other than `device`'s (transfers excepted).

    `violations` holds (op name, device) pairs, first seen order. On CUDA a CPU tensor that should live on the GPU
    (a mask built with torch.ones(...) without device=) shows up as e.g. ('aten.triu.default', 'cpu').
    """

    def __init__(self, device: torch.device | str):
        super().__init__()
        self.device_type = torch.device(device).type
        self.violations: list[tuple[str, str]] = []
        self._seen: set[tuple[str, str]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if name not in _TRANSFERS:
            leaves, _ = tree_flatten((args, kwargs, out))
            for t in leaves:
                if isinstance(t, torch.Tensor) and t.device.type != self.device_type and t.dim() > 0:
                    key = (str(func), t.device.type)
                    if key not in self._seen:
                        self._seen.add(key)
                        self.violations.append(key)
                    break
        return out

    def report(self, limit: int = 12) -> str:
        return "; ".join(f"{op} on {dev}" for op, dev in self.violations[:limit])


def check_devices_enabled() -> bool:
    return os.environ.get(CHECK_ENV) == "1"


def trim_host_heap(device: torch.device) -> None:
    """On a CPU device, hand the heap pages freed by earlier stages back to the OS (glibc malloc_trim). torch's CPU
    allocator is plain malloc: a stage's freed tensors below glibc's (dynamic, up to 32 MiB) mmap threshold stay in
    the heap as resident holes that the next stage's large tensors (fresh mmaps) cannot reuse, so the peak RSS would
    carry every earlier stage's garbage. Called between stages (MegatronWorker), never in a hot loop; a no-op on CUDA
    (its caching allocator reuses its own blocks) and off glibc."""
    if device.type == "cpu":
        release_free_heap()


def release_free_heap() -> None:
    """gc, then glibc's malloc_trim(0): freed heap pages go back to the OS (a no-op off glibc, where memory
    measurements may then under-count reused memory)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def to_device(tensors: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Every tensor value of `tensors` on `device` (non-blocking; others untouched)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
