"""Memory measurement in one place: what this process holds and held at most, on the host and on CUDA.

The throughput metrics (perf/max_memory_allocated_gb), `tripod bench` and its peers (engine/bench/), the memory
plan's runtime baseline (parallel/memory_plan.py), the hybrid engine's peak-memory checks and the scripts/bench_*
tools all read memory through here.

Host: `torch` keeps no allocator statistics for CPU tensors, so the measurement is the process' resident set size
from /proc/self/status (Linux): VmRSS now, VmHWM the high-water mark. Writing 5 to /proc/self/clear_refs resets
VmHWM to the current RSS, and VmHWM read afterwards is the true peak in between (`measure_peak_memory`). Free heap
is trimmed first (glibc malloc_trim), otherwise memory freed earlier and reused inside the block would not count.
On CUDA the allocator's own peak is used instead. `SavedTensorBytes` counts what autograd saves for backward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

GiB = 2 ** 30


def proc_status_kib(field: str) -> int:
    """A `/proc/self/status` field in KiB (VmRSS, VmHWM, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """This process' resident set size now (VmRSS)."""
    return proc_status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """This process' resident set high-water mark (VmHWM): since start, or since the last `reset_peak_rss`."""
    return proc_status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_memory_gb() -> float:
    """The process' peak memory in GiB: the CUDA allocator's peak when CUDA is in use, else the peak RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / GiB
    return peak_rss_bytes() / GiB


class SavedTensorBytes:
    """`with SavedTensorBytes(exclude) as s: loss.backward()...` then `s.peak`: the most bytes autograd held for
    backward at once (torch.autograd.graph.saved_tensors_hooks), each saved storage counted once while any saved
    reference to it lives. `exclude`: storage pointers not to count (parameters, DDP buffers). What
    parallel/memory_plan.py's activation_bytes predicts."""

    def __init__(self, exclude: set[int] = frozenset()) -> None:
        self.exclude, self.live, self.total, self.peak = set(exclude), {}, 0, 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.total -= entry[0]
            del self.live[ptr]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        import weakref

        ptr = t.untyped_storage().data_ptr()
        if ptr in self.exclude or ptr == 0:
            return t
        if ptr not in self.live:
            self.live[ptr] = [t.untyped_storage().nbytes(), 0]
            self.total += self.live[ptr][0]
            self.peak = max(self.peak, self.total)
        self.live[ptr][1] += 1
        weakref.finalize(t, self._release, ptr)
        return t

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


@dataclass
class PeakMemory:
    baseline_bytes: int = 0
    peak_bytes: int = 0

    @property
    def extra_bytes(self) -> int:
        """Peak above what the process held when the measurement started."""
        return max(0, self.peak_bytes - self.baseline_bytes)


@contextlib.contextmanager
def measure_peak_memory(device: torch.device | str = "cpu") -> Iterator[PeakMemory]:
    """`with measure_peak_memory() as m: ...` then `m.extra_bytes` is the peak growth inside the block."""
    m = PeakMemory()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        m.baseline_bytes = torch.cuda.memory_allocated()
        yield m
        torch.cuda.synchronize()
        m.peak_bytes = torch.cuda.max_memory_allocated()
        return
    from tripod.runtime.device import release_free_heap

    release_free_heap()  # freed pages back to the OS first, so that reusing them later still shows up as growth
    reset_peak_rss()
    m.baseline_bytes = rss_bytes()
    yield m
    m.peak_bytes = peak_rss_bytes()
