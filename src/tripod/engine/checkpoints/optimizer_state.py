"""Optimizer states in trainer checkpoints: megatron's layout-free form, saved without gathering the whole state.

The distributed optimizer's state is saved in megatron's `fully_reshardable` form (one tensor per parameter and state,
in the parameter's own shape; megatron gathers it on DP rank 0 at save and slices it at load), so a checkpoint
resumes at another TP / PP / DP; megatron's default for it (fully_sharded_model_space) relies on flattened ranges the
torch dist-checkpoint backend no longer supports. megatron builds that form by gathering every buffer's whole state
(param, exp_avg, exp_avg_sq) on every DP rank and then slicing it: about 3x the model's size in fp32 per rank more
during a save, with transients twice that. `GatheredOptimizerState` writes the same files from placeholders instead:
megatron's own `sharded_state_dict` runs over world buffers that are never touched (no memory), and while the file
is written data-parallel rank 0 receives the state a chunk of parameters at a time (each other rank sends its part
of the chunk: one contiguous range of its shard), each chunk written and dropped before the next. With `stage` (an asynchronous save) each
rank's own shards are copied first, so training can go on.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist

KEYS = ("param", "exp_avg", "exp_avg_sq")
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
_GROUPS: dict[tuple[int, ...], Any] = {}


def checkpoint_groups(ranks_of_mine: list[tuple[int, ...]]) -> list[Any]:
    """A gloo group of its own for each of this rank's data-parallel groups (`ranks_of_mine`), made once: a save's
    sends and receives then never meet training's collectives, also from a writer thread. Collective over the world."""
    everyone: list[list[tuple[int, ...]]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(everyone, ranks_of_mine)
    for ranks in sorted({r for mine in everyone for r in mine} - set(_GROUPS)):
        group = dist.new_group(list(ranks), backend="gloo")  # every rank makes every group, in one order
        _GROUPS[ranks] = group
    return [_GROUPS[r] for r in ranks_of_mine]


def distributed_inners(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(o, DistributedOptimizer)]


class GatheredOptimizerState:
    """The fully_reshardable tensors of one DistributedOptimizer, made while they are written (module docstring)."""

    def __init__(self, inner, group, stage: bool):
        self.inner, self.group = inner, group
        self.world: dict[int, tuple[int, str]] = {}  # placeholder storage pointer -> (buffer index, state key)
        self.pieces: list[tuple[int, int, dict[str, torch.Tensor]]] = []  # (buffer, world start, this rank's shards)
        self.chunks: list[list[tuple[int, int]]] = []  # per buffer: (world start, end) of each chunk
        self.staged_bytes = 0
        for gbuf_idx, buffer in enumerate(inner.buffers):
            (ranges_of_buckets,) = inner.gbuf_ranges[gbuf_idx].values()
            offset = 0
            for bucket_idx, ranges in enumerate(ranges_of_buckets):
                for model_param, param_ranges in ranges["param_map"].items():
                    shards = inner._get_main_param_and_optimizer_states(model_param)
                    shards = {k: (shards[k].detach().to("cpu", copy=True) if stage else shards[k].detach()).view(-1)
                              for k in KEYS}  # staged on the host (a device's shards too)
                    self.pieces.append((gbuf_idx, offset + param_ranges["gbuf_world_in_bucket"].start, shards))
                    self.staged_bytes += sum(t.numel() * t.element_size() for t in shards.values()) if stage else 0
                offset += buffer.buckets[bucket_idx].numel_unpadded
            self.chunks.append(_chunks(sorted((s, e) for s, e, _ in buffer.param_index_map.values())))
        self.size, self.me = group.size(), group.rank()
        self.root = dist.get_global_rank(group, 0)

    def shard_ranges(self, gbuf_idx: int, dp_rank: int) -> list[tuple[int, int]]:
        """The world ranges (megatron's world-tensor coordinates: buckets without their padding, one after the other)
        of data-parallel rank `dp_rank`'s shard of buffer `gbuf_idx`: one per bucket."""
        out, offset = [], 0
        for bucket in self.inner.buffers[gbuf_idx].buckets:
            local = bucket.grad_data.numel() // self.size
            a, b = dp_rank * local, min((dp_rank + 1) * local, bucket.numel_unpadded)
            if a < b:
                out.append((offset + a, offset + b))
            offset += bucket.numel_unpadded
        return out

    def _mine(self, gbuf_idx: int, key: str, lo: int, hi: int) -> torch.Tensor:
        """This rank's state `key` over world range [lo, hi) (zeros where no parameter is: padding)."""
        out = torch.zeros(hi - lo, dtype=torch.float32)
        for g, start, shards in self.pieces:
            a, b = max(lo, start), min(hi, start + shards[key].numel())
            if g == gbuf_idx and a < b:
                out[a - lo:b - lo] = shards[key][a - start:b - start]
        return out

    def dp_zero_state(self, **_: Any) -> dict:
        """Stands in for `DistributedOptimizer.get_parameter_state_dp_zero` while megatron builds the state dict:
        world buffers of the right size that nobody reads (torch.empty: no pages until touched)."""
        state: dict[Any, Any] = {"buckets_coalesced": True}
        for gbuf_idx, ranges in enumerate(self.inner.gbuf_ranges):
            (dtype,) = ranges
            numel = self.inner.buffers[gbuf_idx].numel_unpadded
            world: dict[str, Any] = {k: torch.empty(numel, dtype=torch.float32) for k in KEYS}
            for key in KEYS:
                self.world[world[key].untyped_storage().data_ptr()] = (gbuf_idx, key)
            world["numel_unpadded"] = numel
            state[gbuf_idx] = {dtype: world}
        return state

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.world

    def stream(self, items: list[tuple[Any, torch.Tensor]]) -> Iterator[tuple[Any, torch.Tensor]]:
        """Data-parallel rank 0 (the main replica: the rank that writes the optimizer state) receives each chunk's
        pieces from the others (each rank's shard of a chunk is one contiguous range) and yields its items."""
        if items and self.me != 0:
            raise RuntimeError(f"rank {dist.get_rank()} holds optimizer-state items to write but is data-parallel rank "
                               f"{self.me}: tripod gathers the state on data-parallel rank 0 (megatron's main replica)")
        wanted: dict[tuple[int, str], list[tuple[int, Any, torch.Tensor]]] = {}
        for item, t in items:
            gbuf_idx, key = self.world[t.untyped_storage().data_ptr()]
            wanted.setdefault((gbuf_idx, key), []).append((t.storage_offset(), item, t))
        for gbuf_idx, chunks in enumerate(self.chunks):
            for lo, hi in chunks:
                for key in KEYS:
                    if self.me != 0:
                        for a, b in self.shard_ranges(gbuf_idx, self.me):
                            if max(a, lo) < min(b, hi):
                                dist.send(self._mine(gbuf_idx, key, max(a, lo), min(b, hi)), self.root, self.group)
                        continue
                    world = self._mine(gbuf_idx, key, lo, hi)
                    for d in range(1, self.size):
                        for a, b in self.shard_ranges(gbuf_idx, d):
                            if max(a, lo) < min(b, hi):
                                dist.recv(world[max(a, lo) - lo:min(b, hi) - lo], dist.get_global_rank(self.group, d),
                                          self.group)
                    for start, item, t in wanted.get((gbuf_idx, key), ()):
                        if lo <= start and start + t.numel() <= hi:
                            yield item, world[start - lo:start - lo + t.numel()].view(t.shape)
                    del world


def _chunks(param_ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Consecutive world ranges of whole parameters, each up to OPTIMIZER_CHUNK_ELEMENTS (or one larger parameter)."""
    from tripod.parallel.checkpoint import OPTIMIZER_CHUNK_ELEMENTS

    out: list[tuple[int, int]] = []
    for start, end in param_ranges:
        if out and end - out[-1][0] <= OPTIMIZER_CHUNK_ELEMENTS:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


class OptimizerFill:
    """The fill of one save (megatron_patches/checkpoint_save.Fill): the GatheredOptimizerState of every
    DistributedOptimizer of a chained optimizer, streamed one after the other."""

    def __init__(self, parts: list[GatheredOptimizerState]):
        self.parts = parts
        self.staged_bytes = sum(p.staged_bytes for p in parts)

    def owns(self, tensor: torch.Tensor) -> bool:
        return any(p.owns(tensor) for p in self.parts)

    def stream(self, items):
        for part in self.parts:
            yield from part.stream([(i, t) for i, t in items if part.owns(t)])


def plan_optimizer_save(worker, path: str, stage: bool):
    """The PendingSave (megatron_patches/checkpoint_save.py) of `worker`'s optimizer state into `path`. Collective."""
    from tripod.parallel.checkpoint import sharded_model_state
    from tripod.parallel.megatron_patches.checkpoint_save import plan_save

    inners = distributed_inners(worker.optimizer)
    groups = checkpoint_groups([tuple(dist.get_process_group_ranks(o.data_parallel_group)) for o in inners])
    parts = [GatheredOptimizerState(o, g, stage) for o, g in zip(inners, groups)]
    with worker.layout.activate():
        model_sd = sharded_model_state(worker.chunks)
        for inner, part in zip(inners, parts):
            inner.get_parameter_state_dp_zero = part.dp_zero_state
        try:
            sharded = worker.optimizer.sharded_state_dict(model_sd, metadata=OPTIM_METADATA)
        finally:
            for inner in inners:
                del inner.get_parameter_state_dp_zero
        return plan_save(sharded, path, stage=stage, fill=OptimizerFill(parts) if parts else None)


def _ensure_optimizer_state(worker) -> None:
    """Give a fresh DistributedOptimizer its Adam state before loading: megatron's state_dict() reads the per-parameter
    step, which exists only after a step (with TE/apex it takes another path; on CPU, torch Adam's, it asserts).
    megatron's own dummy-state initialiser runs one step with zero gradients; at lr = 0 it leaves every weight
    untouched (no Adam update, no decoupled weight decay), and the load then overwrites the dummy state."""
    opt = worker.optimizer
    for inner in getattr(opt, "chained_optimizers", [opt]):
        if not hasattr(inner, "_init_optimizer_states_with_dummy_values") or inner.optimizer.state:
            continue
        groups = inner.optimizer.param_groups
        lrs = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = 0.0
        inner._init_optimizer_states_with_dummy_values()
        for g, lr in zip(groups, lrs):
            g["lr"] = lr


def _skip_torch_adam_step(inner) -> None:
    """torch Adam keeps a per-parameter 'step' that megatron's fully_reshardable state does not carry (TE's FusedAdam
    keeps it in the param groups), and megatron's loader copies every key of the live state: load the saved tensors
    with 'step' set aside; megatron restores the step itself from the param groups."""
    original = inner._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group_index, group_order = inner.model_param_group_index_map[model_param]
        state = inner.optimizer.state[inner.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            original(model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    inner._set_main_param_and_optimizer_states = set_states


def _sgd_init_state(opt, config=None) -> None:
    """torch SGD's state (its momentum buffers) made before a load. megatron gives SGD no `init_state_fn` but calls it
    when it builds the sharded state to load into ('NoneType' object is not callable); the load overwrites the zeros."""
    for group in opt.param_groups:
        if group.get("momentum", 0):
            for p in group["params"]:
                opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p.data))


def _unshare_adam_steps(optimizer) -> None:
    """Give every parameter its own Adam step tensor again. Without apex/TE (torch Adam, the CPU path) megatron's
    DistributedOptimizer.load_state_dict puts ONE `step` tensor into every parameter's state, and torch keeps it
    uncopied ("step is not casted"); torch's Adam then does `step += 1` in place once per parameter, so after a
    resume the k-th parameter of a step saw step + k and its bias corrections were wrong (the resumed run drifted
    from the uninterrupted one from its first step on)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_opt = getattr(inner, "optimizer", None)
        for state in (torch_opt.state.values() if torch_opt is not None else ()):
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def load_optimizer(worker, path: str) -> None:
    """Load the optimizer state at `path` (any layout's save) into `worker`'s optimizer. Collective."""
    from megatron.core import dist_checkpointing

    from tripod.parallel.checkpoint import sharded_model_state

    with worker.layout.activate():
        _ensure_optimizer_state(worker)
        for inner in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]):
            if getattr(inner, "init_state_fn", True) is None and isinstance(inner.optimizer, torch.optim.SGD):
                inner.init_state_fn = _sgd_init_state
            if hasattr(inner, "_set_main_param_and_optimizer_states") and \
                    not inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                _skip_torch_adam_step(inner)
        model_sd = sharded_model_state(worker.chunks)
        sharded = worker.optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=OPTIM_METADATA)
        worker.optimizer.load_state_dict(dist_checkpointing.load(sharded, path))
        _unshare_adam_steps(worker.optimizer)
