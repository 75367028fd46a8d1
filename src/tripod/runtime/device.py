"""The one place that decides where this rank computes, and a guard that proves everything followed it.

    device = select_device("cuda")   # once per rank, before the process group: cuda:LOCAL_RANK, set current
    device = current_device()        # everyone else asks; nobody else calls torch.cuda.set_device

`select_device` reads `trainer.device` (passed through the environment variable TRIPOD_DEVICE by `tripod train`,
so spawned and torchrun-launched ranks agree) and LOCAL_RANK. Models (megatron allocates on
torch.cuda.current_device()), batches and masks (MegatronWorker), the rollout engine and the generation shard
(trainer / weight sync) and the kernels (kernels.* dispatch on the tensor's device: Triton on CUDA, torch twins
elsewhere) all take it from here.

`DeviceGuard` is a TorchDispatchMode that records every aten op that mixes device types (explicit transfers such as
`.to()` / `.cpu()` excepted) or computes a large floating-point result on the host while the chosen device is not
the host; host bookkeeping (batch assembly, masks, sampling results) is left alone. TRIPOD_CHECK_DEVICES=1 makes the
trainer run every step under it and fail on the first step with a stray tensor; the check is the same code on CPU
and CUDA.
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
# host work that is bookkeeping, not compute, whatever its size: building, cutting and filling batches and masks
_HOST_BOOKKEEPING = {"empty", "empty_strided", "zeros", "ones", "full", "arange", "zeros_like", "ones_like",
                     "full_like", "empty_like", "new_zeros", "new_ones", "new_full", "new_empty", "cat", "stack",
                     "index", "index_put_", "index_put", "index_select", "select", "slice", "view", "_unsafe_view",
                     "reshape", "unsqueeze", "squeeze", "permute", "transpose", "t", "expand", "clone", "contiguous",
                     "fill_", "zero_", "masked_fill_", "masked_fill", "split", "split_with_sizes", "chunk", "narrow",
                     "unbind", "as_strided", "repeat", "repeat_interleave", "flip", "roll", "pad",
                     "constant_pad_nd", "slice_scatter", "select_scatter", "scatter_", "gather", "where",
                     "normal_", "uniform_", "random_", "randn", "rand", "randint", "bernoulli_", "exponential_"}
LARGE_HOST_NUMEL = 1 << 16  # a floating-point result this big computed on the host is compute that belongs on the device


class DeviceGuard(TorchDispatchMode):
    """Records the aten ops of a step that compute in the wrong place, as (op name, device type) pairs.

    Flagged: (1) an op whose tensor operands or results sit on different device types (transfers excepted: to(),
    copy_, .item()); on CUDA a CPU index or mask fed to a GPU op shows up as ('aten.index.Tensor', 'cpu'); and
    (2) on a non-host compute device, a host op that computes a floating-point result of at least LARGE_HOST_NUMEL
    elements (a matmul, softmax or loss that should have run on the GPU). Host bookkeeping is not flagged: building
    and cutting batches, masks and sampling results on the CPU (`_HOST_BOOKKEEPING` ops, integer / bool results,
    small tensors) is meant to happen there. 0-dim tensors (Python scalars) go anywhere.
    """

    def __init__(self, device: torch.device | str):
        super().__init__()
        self.device_type = torch.device(device).type
        self.violations: list[tuple[str, str]] = []
        self._seen: set[tuple[str, str]] = set()

    def _flag(self, func, device_type: str) -> None:
        key = (str(func), device_type)
        if key not in self._seen:
            self._seen.add(key)
            self.violations.append(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
        if name not in _TRANSFERS:  # checked before running: a mixed op may raise, and the record says which
            kinds = {t.device.type for t in inputs}
            if len(kinds) > 1:
                self._flag(func, next(k for k in sorted(kinds) if k != self.device_type))
        out = func(*args, **kwargs)
        if name in _TRANSFERS or name in _HOST_BOOKKEEPING or self.device_type == "cpu":
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_floating_point() \
                    and t.numel() >= LARGE_HOST_NUMEL:
                self._flag(func, "cpu")
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


def freeze_long_lived_objects() -> None:
    """Moves every object alive now (modules, models, optimizers: built once per run) out of the collector's reach
    (`gc.freeze`), after collecting what is already garbage. A full `gc.collect()` then scans only what the run
    allocated since: ~5 ms instead of ~0.3-0.5 s with megatron, torch and transformers loaded, and
    `release_free_heap` runs between stages. Frozen objects are handed back at exit (`gc.unfreeze`), so that
    interpreter shutdown finalises them as usual."""
    import atexit
    import gc

    gc.collect()
    if not gc.get_freeze_count():
        atexit.register(gc.unfreeze)
    gc.freeze()


def release_free_heap() -> None:
    """gc, then glibc's malloc_trim(0): freed heap pages go back to the OS (a no-op off glibc, where memory
    measurements may then under-count reused memory). Cheap once `freeze_long_lived_objects` has run."""
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
