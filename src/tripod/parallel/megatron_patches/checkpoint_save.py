"""Dist-checkpoint saves written by the rank itself, from the tensors themselves: no forked writers, no spawned
Manager, no second copy of the state.

megatron-core 0.16.1 writes every dist-checkpoint through `FileSystemWriterAsync` (a synchronous save too), which
  - clones every CPU tensor that is a view of a larger storage (torch.save would write the whole storage): with the
    distributed optimizer every parameter is a view of the DDP param buffer and every fully_reshardable optimizer
    tensor a slice of a gathered world buffer, so a save copies the state once more;
  - forks one writer process per file (`thread_count`, 2), each a copy-on-write image of the rank, and passes their
    results through a queue of a spawned multiprocessing Manager (a fresh interpreter that imports torch).
`plan_save` runs megatron's save with `RankWriter` in that writer's place (swapped into megatron's torch strategy
for the call): a view is written through an alias whose storage is exactly its own bytes, a device tensor is
copied to host one tensor at a time, the items go to one file per rank written by the caller's thread, and the
results pass through an in-process queue. Fills (engine/checkpoints/optimizer_state.py) supply tensors that exist
only while they are written. `stage=True` (an asynchronous save) snapshots each tensor instead: the live state may
change once `plan_save` returns. The on-disk format is megatron's: `dist_checkpointing.load` reads it.
Device: all. Canary: tests/multiprocess/test_checkpoint_save.py (megatron's own save still forks and clones); it and
test_optimizer_save.py check "no copy" where it matters, on what torch.save is handed (tests/helpers/serialized.py).
"""
from __future__ import annotations

import itertools
import os
import queue
from typing import Any, Iterable, Iterator, Protocol

import torch


class Fill(Protocol):
    """Tensors of a save that are made while it is written (a gather over data-parallel ranks)."""

    def owns(self, tensor: torch.Tensor) -> bool:
        """Is `tensor` one of this fill's placeholders (never read, never written as such)?"""

    def stream(self, items: list[tuple[Any, torch.Tensor]]) -> Iterator[tuple[Any, torch.Tensor]]:
        """(item, real tensor) for each (item, placeholder) of this rank; collective over the fill's group, so
        every rank of it runs it, with or without items."""


def host_alias(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host without a copy where possible: a contiguous CPU view of a larger storage gets an alias whose
    storage is exactly its bytes (torch.save writes a tensor's whole storage); device tensors are copied."""
    t = t.detach()
    if t.device.type != "cpu":
        return t.to("cpu")
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    if not t.is_contiguous():
        return t.contiguous()  # a strided view: a copy of its own elements only
    as_bytes = t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)
    return torch.from_numpy(as_bytes.numpy()).view(t.dtype).view(t.shape)


def _write_file(path: str, storage_key: str, bytes_data, tensor_data, fill: Fill | None, transforms) -> list:
    """Write one rank's items to `path` (torch.save records, as megatron's writer does); their WriteResults."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat, _write_item
    from torch.utils.serialization import config

    def write(stream, item, data) -> None:
        results.append(_write_item(*transforms, stream, data, item, storage_key,
                                   serialization_format=SerializationFormat.TORCH_SAVE))

    results: list = []
    owned = [(i, t) for i, t in tensor_data if fill is not None and fill.owns(t)]
    plain = ((i, t) for i, t in tensor_data if fill is None or not fill.owns(t))
    items = itertools.chain(plain, fill.stream(owned) if fill is not None else ())  # lazily: a chunk at a time
    crc, config.save.compute_crc32 = config.save.compute_crc32, False  # nothing checks it on load: CPU time only
    try:
        with open(path, "wb") as stream:
            for item, data in bytes_data:
                write(stream, item, data)
            for item, tensor in items:
                write(stream, item, host_alias(tensor))
            stream.flush()
            os.fsync(stream.fileno())
    except OSError:
        for _ in items:  # a full disk: the fill's transfers still run, so the other ranks reach the error too
            pass
        raise
    finally:
        config.save.compute_crc32 = crc
    return results


def _rank_writer_class(stage: bool, fill: Fill | None):
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from torch.distributed.checkpoint.planner import WriteItemType

    class RankWriter(FileSystemWriterAsync):
        """megatron's writer with its data chosen and written by the calling process (module docstring)."""

        def prepare_write_data(self, plan, planner) -> None:
            tensors, byte_items = [], []
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    byte_items.append((item, planner.resolve_data(item)))
                    continue
                t = planner.resolve_data(item).detach()
                if stage and not (fill is not None and fill.owns(t)):
                    t = t.to("cpu", copy=True)
                tensors.append((item, t))
            file_name = f"{plan.storage_data.prefix}0.distcp"
            nothing = not (tensors or byte_items) and fill is None
            self.write_buckets = [] if nothing else \
                [(os.path.join(self.checkpoint_dir, file_name), file_name, (byte_items, tensors))]
            self.results_queue = None if nothing else queue.Queue()

        def get_save_function_and_args(self):
            return self.write_here, None, []

        def write_here(self) -> None:
            if not self.write_buckets:
                return
            (path, storage_key, (byte_items, tensors)), = self.write_buckets
            try:
                self.results_queue.put({0: _write_file(path, storage_key, byte_items, tensors, fill,
                                                       [self.transforms] if hasattr(self, "transforms") else [])})
            except Exception as e:  # noqa: BLE001 - handed to megatron's finalize, which raises it on every rank
                self.results_queue.put(e)
                raise

    return RankWriter


class PendingSave:
    """A planned dist-checkpoint save: `write()` writes this rank's file (collective only over its fill's group),
    `finish()` (collective over the world) gathers the write results and writes the checkpoint's metadata.
    `nbytes`: what this rank holds for it (staged copies when staged; the fill's own staging included)."""

    def __init__(self, request, nbytes: int):
        self.request, self.nbytes = request, nbytes

    def write(self) -> None:
        self.request.async_fn(*self.request.async_fn_args)

    def finish(self) -> None:
        torch.distributed.barrier()
        for finalize in self.request.finalize_fns:
            finalize()


def plan_save(sharded_state_dict: dict[str, Any], checkpoint_dir: str, *, stage: bool = False,
              fill: Fill | None = None) -> PendingSave:
    """Plan `megatron.core.dist_checkpointing.save(sharded_state_dict, checkpoint_dir)` with `RankWriter` (module
    docstring). Collective over the world; with `stage` the state is snapshotted before it returns."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    original = mcore_torch.FileSystemWriterAsync
    mcore_torch.FileSystemWriterAsync = _rank_writer_class(stage, fill)
    try:
        request = dist_checkpointing.save(sharded_state_dict, checkpoint_dir, async_sharded_save=True)
    finally:
        mcore_torch.FileSystemWriterAsync = original
    own = [t for t in _planned_tensors(request) if fill is None or not fill.owns(t)]
    return PendingSave(request, sum(t.numel() * t.element_size() for t in own) + getattr(fill, "staged_bytes", 0))


def save_synchronously(sharded_state_dict: dict[str, Any], checkpoint_dir: str, fill: Fill | None = None) -> int:
    """Plan, write and finish a dist-checkpoint save in the calling thread (collective); returns `nbytes`."""
    pending = plan_save(sharded_state_dict, checkpoint_dir, fill=fill)
    pending.write()
    pending.finish()
    return pending.nbytes


def _planned_tensors(request) -> list[torch.Tensor]:
    return [t for _, _, (_, tensors) in request.async_fn.__self__.write_buckets for _, t in tensors]


def tensors_written(pending: PendingSave) -> Iterable[torch.Tensor]:
    """The tensors this rank's file will hold (staged copies when `stage`; a fill's placeholders), for tests."""
    return _planned_tensors(pending.request)
