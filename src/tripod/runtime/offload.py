"""Host offload between the phases of a PPO step: where each model's parameters, gradients and optimizer states live
in each phase, and the moves that put them there (verl's param_offload / grad_offload / optimizer_offload).

The state machine (`placement`) is one table: a phase uses some kinds of some models (USES); a kind whose offload
key is on lives on the host in every phase that does not use it, on the device in every phase that does; a kind
whose key is off never leaves the device. `OffloadManager.enter(phase)` moves what must move (and records each
move) before the phase runs; the trainer enters the phases in the step's order (engine/trainer.py), `tripod plan`
prints the same placement as bytes per phase (parallel/memory_phases.py).

What moves (megatron-core 0.16, after verl's offload_megatron_model_to_cpu / offload_megatron_optimizer): parameters
are the storages of every parameter (with the distributed optimizer megatron's DDP param buffers, without it each
parameter's own: param_offload moves the same bytes either way); gradients are DDP's main_grad buffers (freed,
reallocated zeroed: every update zeroes them first anyway); optimizer states are the Adam moments and, for 16-bit
parameters, the fp32 main weights (with fp32 parameters the optimizer updates the parameters themselves, which stay
put). Params and optimizer states move in place (`HostStash`): copied to pinned host memory, the device storage
resized to 0 bytes, every tensor and view kept.
On CPU runs every "device" tensor is already in host memory: the manager records the moves and touches nothing
(config validation refuses the offload keys there; `actor_rollout_ref.ref.offload` stays accepted as a no-op). The
movers themselves run on any device; tests/multiprocess/test_offload_movers.py runs them on CPU (docs/operating.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

KINDS = ("params", "grads", "optim")
USES: dict[str, dict[str, tuple[str, ...]]] = {
    "idle": {},  # after the models are built, before the first step
    "rollout": {"actor": ("params",)},  # the hybrid engine gathers the generation shard from the actor's params
    "old_log_prob": {"actor": ("params",)},
    "ref": {"reference": ("params",)},
    # the reward model is frozen and moves itself (engine/workers/reward_model.py); listed so the plan places it
    "reward": {"reward_model": ("params",)},
    "values": {"critic": ("params",)},
    "update_critic": {"critic": KINDS},
    "update_actor": {"actor": KINDS},
    # saving / loading reads the params (freed DDP storage cannot be read) and the optimizer states in place;
    # gradients are not saved
    "checkpoint": {"actor": ("params", "optim"), "critic": ("params", "optim")},
}
DEVICE, HOST = "device", "host"


@dataclass(frozen=True)
class OffloadFlags:
    """Which kinds of one model live on the host outside the phases that use them."""
    params: bool = False
    grads: bool = False
    optim: bool = False

    def any(self) -> bool:
        return self.params or self.grads or self.optim

    def __getitem__(self, kind: str) -> bool:
        return getattr(self, kind)


def flags_of(m: Any, trainable: bool, legacy_param_offload: bool = False) -> OffloadFlags:
    """The flags of a `megatron` config section (`legacy_param_offload`: the reference's older `ref.offload`)."""
    return OffloadFlags(params=bool(m.param_offload or legacy_param_offload),
                        grads=bool(trainable and m.grad_offload), optim=bool(trainable and m.optimizer_offload))


def placement(phase: str, model: str, flags: OffloadFlags) -> dict[str, str]:
    """Where each kind of `model` lives while `phase` runs."""
    used = USES[phase].get(model, ())
    return {k: HOST if flags[k] and k not in used else DEVICE for k in KINDS}


@dataclass(frozen=True)
class Move:
    phase: str  # entered
    model: str
    kind: str
    to: str  # DEVICE or HOST


class OffloadManager:
    """Puts each registered model's kinds where `placement` says before each phase; records every move.

    `movers[model][kind]` is a callable(to: str) doing the move; on CPU (`execute=False`) nothing is called."""

    def __init__(self, flags: dict[str, OffloadFlags], movers: dict[str, dict[str, Callable[[str], None]]],
                 execute: bool):
        self.flags, self.movers, self.execute = flags, movers, execute
        self.where = {m: {k: DEVICE for k in KINDS} for m in flags}  # every model is built on the device
        self.moves: list[Move] = []
        self.history: list[tuple[str, dict[str, dict[str, str]]]] = []  # (phase, where) after each enter
        self.enter("idle")

    def enter(self, phase: str) -> None:
        if phase not in USES:
            raise ValueError(f"unknown phase {phase!r}; one of {list(USES)}")
        # host-bound moves first, so that a phase's device peak never holds both the old and the new state
        wanted = {m: placement(phase, m, f) for m, f in self.flags.items()}
        for to in (HOST, DEVICE):
            for model, kinds in wanted.items():
                for kind, where in kinds.items():
                    if where == to and self.where[model][kind] != to:
                        if self.execute:
                            self.movers[model][kind](to)
                        self.where[model][kind] = to
                        self.moves.append(Move(phase, model, kind, to))
        if self.execute and torch.cuda.is_available() and any(m.phase == phase and m.to == HOST for m in self.moves):
            torch.cuda.empty_cache()
        self.history.append((phase, {m: dict(k) for m, k in self.where.items()}))


# ---- the moves (run on CUDA; tests/multiprocess/test_offload_movers.py runs the same code on CPU) -----------
class HostStash:
    """Whole storages moved to host memory in place, as megatron's _ParamAndGradBuffer.offload_to_cpu moves its
    param buffer: to the host, each distinct storage of `tensors()` is copied into a host buffer (pinned when the
    storage is on CUDA) and resized to 0 bytes; the tensors and every view of them stay (reading one before the reload
    reads freed memory and crashes, as with megatron's; never stale data); back, each storage is resized and filled
    from its host buffer, which is dropped.
    Identity is kept, so an optimizer's param groups and state dicts, main_grad views and the hybrid engine's aliases
    of the actor's weights need no re-pointing. Storages are deduplicated (a tied weight moves once)."""

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]]):
        self.tensors = tensors
        self.held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a tensor on the storage, its host copy)

    def move(self, to: str) -> None:
        self.offload() if to == HOST else self.reload()

    def offload(self) -> int:
        """Bytes released on the device."""
        seen: set[int] = set()
        released = 0
        for t in self.tensors():
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:  # empty, moved already, or shared
                continue
            seen.add(storage.data_ptr())
            # on the compute stream: the device block is reused only after the copy, the copy back follows it
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.copy_(_as_bytes(storage), non_blocking=True)
            released += storage.nbytes()
            storage.resize_(0)
            self.held.append((t, host))
        return released

    def reload(self) -> None:
        for t, host in self.held:
            storage = t.untyped_storage()
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host, non_blocking=True)
        self.held.clear()


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _ddp_buffers(worker) -> list:
    return [b for chunk in worker.model for b in chunk.buffers + chunk.expert_parallel_buffers]


def model_parameters(worker) -> list[torch.Tensor]:
    """What a params offload moves: every parameter's storage. With the distributed optimizer those are megatron's
    DDP param buffers (one storage per buffer, the parameters views of it); without it (megatron allocates no param
    buffer then) each parameter's own storage, so param_offload moves the same bytes with or without it."""
    return [p for chunk in worker.chunks for p in chunk.parameters()]


def _move_grads(worker, to: str) -> None:
    for buf in _ddp_buffers(worker):  # megatron's own: freed, reallocated zeroed (every update zeroes them first)
        buf.offload_to_cpu(move_params=False, move_grads=True) if to == HOST else \
            buf.reload_from_cpu(move_params=False, move_grads=True)


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors an optimizer offload moves: each Adam state tensor, and the fp32 main weights where they are
    copies of 16-bit parameters (DistributedOptimizer's shard_fp32_from_float16_groups, Float16Optimizer's
    fp32_from_float16_groups); never the model's own fp32 parameters."""
    out: list[torch.Tensor] = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in getattr(opt, "shard_fp32_from_float16_groups", None) or \
                getattr(opt, "fp32_from_float16_groups", None) or []:
            out += list(group)
        inner = getattr(opt, "optimizer", None)
        for state in (inner.state.values() if inner is not None else []):
            out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return out


def worker_movers(worker) -> dict[str, Callable[[str], None]]:
    """The movers of one MegatronWorker: params / grads / optim (a frozen worker has params only). They run on any
    device: the host side is pinned only when the storage is on CUDA."""
    params = HostStash(lambda: model_parameters(worker))
    if not worker.trainable:
        return {"params": params.move}
    optim = HostStash(lambda: optimizer_state_tensors(worker.optimizer))  # Adam's state appears at the first step
    return {"params": params.move, "grads": lambda to: _move_grads(worker, to), "optim": optim.move}


def manager_for(workers: dict[str, Any], flags: dict[str, OffloadFlags], device: torch.device) -> OffloadManager:
    """The trainer's manager over its built workers ({name: worker or None}); moves execute on CUDA only."""
    live = {n: f for n, f in flags.items() if workers.get(n) is not None}
    return OffloadManager(live, {n: worker_movers(workers[n]) for n in live}, execute=device.type == "cuda")
