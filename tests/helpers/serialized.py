"""What a dist-checkpoint writer hands to the file: every tensor that torch.distributed.checkpoint's `_write_item`
serializes (torch.save into the rank's .distcp file), recorded as pointers and sizes while it is written.

The no-copy checks of megatron_patches/checkpoint_save.py (tests/multiprocess/workers/checkpoint_save_worker.py,
optimizer_save_worker.py) compare these records with the live tensors: the planned tensors alone do not show a copy
made between planning and serialization (a `.clone()` in `host_alias` passed such a check)."""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Iterator

import torch


@dataclass(frozen=True)
class Serialized:
    """One tensor as it reached torch.save: its item's index (key and offset), where its elements start, the bytes of
    the storage that torch.save writes (its whole storage) and of its own elements."""
    index: Any
    data_ptr: int
    storage_nbytes: int
    nbytes: int

    def is_view_of(self, live: torch.Tensor) -> bool:
        """The serialized tensor is `live`'s own memory (same first element) and its storage holds `live`'s bytes
        only (torch.save writes no more than the tensor)."""
        return self.data_ptr == live.data_ptr() and self.storage_nbytes == self.nbytes == \
            live.numel() * live.element_size()


@contextlib.contextmanager
def serialized_tensors() -> Iterator[list[Serialized]]:
    """Record every tensor item the dist-checkpoint filesystem writer serializes while the block runs (the writer
    imports `_write_item` at each call, so the patched one is what it calls)."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem._write_item
    signature = inspect.signature(original)
    records: list[Serialized] = []

    def recording(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs).arguments
        data, item = bound["data"], bound["write_item"]
        if isinstance(data, torch.Tensor):
            records.append(Serialized(item.index, data.data_ptr(), data.untyped_storage().nbytes(),
                                      data.numel() * data.element_size()))
        return original(*args, **kwargs)

    filesystem._write_item = recording
    try:
        yield records
    finally:
        filesystem._write_item = original
