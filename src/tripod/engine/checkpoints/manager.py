"""Trainer checkpoints: atomic, complete, resumable exactly.

    <root>/global_step_<k>/
        actor/            megatron dist checkpoint of the actor model (+ HF config: `tripod export` reads it)
        actor_optim/      megatron dist checkpoint of the actor optimizer (Adam moments, step)
        critic/ critic_optim/   the same for the critic (when there is one)
        rng/rank_<r>.pt   every rank's RNG state (the trainer state's "rng")
        trainer_state.json  the rest of the trainer's state object (PPOTrainer.state_dict: step, KL controller,
                          data loader position, LR schedulers, divergence-guard state)
        async_queue.pt    with the rollout on its own ranks: the batches it made with weights older than step k
                          (engine/async_rollout/source.py), when there are any
        COMPLETE          written last

A save goes to `tmp_global_step_<k>` and is renamed when complete, so a run killed mid-save leaves only a
`tmp_*` directory (or one without COMPLETE), which `resume="auto"` ignores. Every rank calls `save` / `load`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import torch
import torch.distributed as dist

COMPLETE = "COMPLETE"
REJECTED = "REJECTED"  # written by the divergence guard (engine/divergence_guard.py) on checkpoints it rolled back past
STATE_FILE = "trainer_state.json"
QUEUE_FILE = "async_queue.pt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def checkpoint_steps(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete `global_step_<k>` directory under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted((int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root)
                  if (m := _STEP_DIR.match(name)) and os.path.exists(os.path.join(root, name, COMPLETE)))


def latest_complete(root: str) -> str | None:
    """The newest complete `global_step_<k>` directory the divergence guard has not rejected, or None."""
    found = [path for _, path in checkpoint_steps(root) if not os.path.exists(os.path.join(path, REJECTED))]
    return found[-1] if found else None


# The distributed optimizer's state in megatron's layout-free form (gathered per parameter on DP rank 0 at save,
# sliced by every rank at load), so a checkpoint resumes at another TP / PP / DP; megatron's default for it
# (fully_sharded_model_space) relies on flattened ranges the torch dist-checkpoint backend no longer supports.
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _save_optimizer(worker, path: str) -> None:
    from tripod.parallel.checkpoint import sharded_model_state
    from tripod.parallel.megatron_patches.checkpoint_save import save_synchronously

    with worker.layout.activate():
        model_sd = sharded_model_state(worker.chunks)
        save_synchronously(worker.optimizer.sharded_state_dict(model_sd, metadata=_OPTIM_METADATA), path)


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


def _load_optimizer(worker, path: str) -> None:
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
        sharded = worker.optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=_OPTIM_METADATA)
        worker.optimizer.load_state_dict(dist_checkpointing.load(sharded, path))
        _unshare_adam_steps(worker.optimizer)


class CheckpointManager:
    """Saves and loads a trainer's state object (`PPOTrainer.state_dict()`) with the weights and optimizer states of
    the trainable models it is handed; it knows nothing else of the trainer."""

    def __init__(self, root: str, arch, tokenizer_dir: str):
        self.root, self.arch, self.tokenizer_dir = root, arch, tokenizer_dir

    def save(self, step: int, state: dict[str, Any], models: dict[str, Any]) -> str:
        """Write `global_step_<step>`: every worker of `models` ({name: worker}), this rank's `state["rng"]`, and (rank 0)
        the rest of `state` as trainer_state.json. Every rank calls it; returns the directory."""
        from tripod.parallel.checkpoint import save_model_checkpoint

        rank = dist.get_rank()
        final = os.path.join(self.root, f"global_step_{step}")
        tmp = os.path.join(self.root, f"tmp_global_step_{step}")
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"))
        dist.barrier()
        for name, worker in models.items():
            save_model_checkpoint(worker.model, os.path.join(tmp, name), self.arch, worker.layout,
                                  tokenizer_dir=self.tokenizer_dir)
            if rank == 0:
                os.makedirs(os.path.join(tmp, f"{name}_optim"), exist_ok=True)
            dist.barrier()
            _save_optimizer(worker, os.path.join(tmp, f"{name}_optim"))
        torch.save(state["rng"], os.path.join(tmp, "rng", f"rank_{rank}.pt"))
        if rank == 0:
            if state.get("async_queue"):  # batches the rollout ranks made with older weights (async_rollout/source.py)
                torch.save(state["async_queue"], os.path.join(tmp, QUEUE_FILE))
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump({k: v for k, v in state.items() if k not in ("rng", "async_queue")}, f, indent=2)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(tmp, COMPLETE), "w") as f:
                f.write(f"{step}\n")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        dist.barrier()
        return final

    def load(self, mode: str | None, models: dict[str, Any]) -> dict[str, Any] | None:
        """Load the checkpoint `mode` names ("auto": latest complete one; "disable"; or a path) into the workers of
        `models`; returns the saved trainer state with this rank's "rng" (for `PPOTrainer.load_state_dict`), or None
        when there is nothing to resume."""
        if mode in ("disable", "", None):
            return None
        path = latest_complete(self.root) if mode == "auto" else mode
        if path is None:
            return None
        if not os.path.exists(os.path.join(path, COMPLETE)):
            raise ValueError(f"trainer.resume={mode}: {path} is not a complete tripod checkpoint "
                             f"(no {COMPLETE} marker); point it at a global_step_<k> directory or use auto")
        from tripod.parallel.checkpoint import load_model_checkpoint

        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        if state["world_size"] != dist.get_world_size():
            raise ValueError(f"{path} was saved by {state['world_size']} ranks; resume it with the same number "
                             f"of processes (this run has {dist.get_world_size()})")
        for name in models:
            if name not in state.get("lr_scheduler", {}):
                raise ValueError(f"{path} has no LR-scheduler state for the {name} (saved by an older tripod); "
                                 "resume it with that version or start over with trainer.resume=disable")
        for name, worker in models.items():
            load_model_checkpoint(worker.model, os.path.join(path, name), worker.layout)
            _load_optimizer(worker, os.path.join(path, f"{name}_optim"))
        state["rng"] = torch.load(os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt"))
        queue = os.path.join(path, QUEUE_FILE)
        state["async_queue"] = torch.load(queue) if dist.get_rank() == 0 and os.path.exists(queue) else []
        if dist.get_rank() == 0:
            print(f"tripod: resumed from {path} at step {int(state['step'])}", flush=True)
        return state

    def reject_after(self, step: int) -> None:
        """Mark every checkpoint newer than `step` REJECTED (the divergence guard rolled back past it). Every rank."""
        if dist.get_rank() == 0:
            for s, p in checkpoint_steps(self.root):
                if s > step:
                    open(os.path.join(p, REJECTED), "w").close()
        dist.barrier()
