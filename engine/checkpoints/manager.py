"""Trainer checkpoints: atomic, complete, resumable exactly.

    <root>/global_step_<k>/
        actor/            megatron dist checkpoint of the actor model (+ HF config: `tripod export` reads it)
        actor_optim/      megatron dist checkpoint of the actor optimizer (Adam moments, step)
        critic/ critic_optim/   the same for the critic (when there is one)
        rng/rank_<r>.pt   every rank's torch RNG state
        trainer_state.json  step, KL controller, data loader position
        COMPLETE          written last

A save goes to `tmp_global_step_<k>` and is renamed when complete, so a run killed mid-save leaves only a
`tmp_*` directory (or one without COMPLETE), which `resume="auto"` ignores. Every rank calls `save` / `resume`.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import torch
import torch.distributed as dist

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def latest_complete(root: str) -> str | None:
    """The newest `global_step_<k>` directory with a COMPLETE marker, or None."""
    if not os.path.isdir(root):
        return None
    found = [(int(m.group(1)), name) for name in os.listdir(root) if (m := _STEP_DIR.match(name))
             and os.path.exists(os.path.join(root, name, COMPLETE))]
    return os.path.join(root, max(found)[1]) if found else None


def _save_optimizer(worker, path: str) -> None:
    from megatron.core import dist_checkpointing

    with worker.layout.activate():
        model_sd = worker.module.sharded_state_dict()
        dist_checkpointing.save(worker.optimizer.sharded_state_dict(model_sd), path)


def _load_optimizer(worker, path: str) -> None:
    from megatron.core import dist_checkpointing

    with worker.layout.activate():
        model_sd = worker.module.sharded_state_dict()
        sharded = worker.optimizer.sharded_state_dict(model_sd, is_loading=True)
        worker.optimizer.load_state_dict(dist_checkpointing.load(sharded, path))


class CheckpointManager:
    def __init__(self, root: str, trainer):
        self.root, self.trainer = root, trainer

    def _trainable(self) -> list[tuple[str, object]]:
        t = self.trainer
        return [(name, w) for name, w in (("actor", t.actor), ("critic", t.critic)) if w is not None]

    def save(self, step: int) -> str:
        from parallel.checkpoint import save_model_checkpoint

        t, rank = self.trainer, dist.get_rank()
        final = os.path.join(self.root, f"global_step_{step}")
        tmp = os.path.join(self.root, f"tmp_global_step_{step}")
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"))
        dist.barrier()
        for name, worker in self._trainable():
            save_model_checkpoint(worker.model, os.path.join(tmp, name), t.arch, worker.layout,
                                  tokenizer_dir=t.cfg.actor_rollout_ref.model.path)
            if rank == 0:
                os.makedirs(os.path.join(tmp, f"{name}_optim"), exist_ok=True)
            dist.barrier()
            _save_optimizer(worker, os.path.join(tmp, f"{name}_optim"))
        torch.save({"torch": torch.get_rng_state()}, os.path.join(tmp, "rng", f"rank_{rank}.pt"))
        if rank == 0:
            state = {"step": step, "kl_ctrl": t.kl_ctrl.state_dict(), "data": t.loader.state_dict(),
                     "world_size": dist.get_world_size()}
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump(state, f, indent=2)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(tmp, COMPLETE), "w") as f:
                f.write(f"{step}\n")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        dist.barrier()
        return final

    def resume(self, mode: str) -> int:
        """Load the checkpoint `mode` names ("auto": latest complete one; "disable"; or a path); returns its step."""
        if mode in ("disable", "", None):
            return 0
        path = latest_complete(self.root) if mode == "auto" else mode
        if path is None:
            return 0
        if not os.path.exists(os.path.join(path, COMPLETE)):
            raise ValueError(f"trainer.resume={mode}: {path} is not a complete tripod checkpoint "
                             f"(no {COMPLETE} marker); point it at a global_step_<k> directory or use auto")
        from parallel.checkpoint import load_model_checkpoint

        t = self.trainer
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        if state["world_size"] != dist.get_world_size():
            raise ValueError(f"{path} was saved by {state['world_size']} ranks; resume it with the same number "
                             f"of processes (this run has {dist.get_world_size()})")
        for name, worker in self._trainable():
            load_model_checkpoint(worker.model, os.path.join(path, name), worker.layout)
            _load_optimizer(worker, os.path.join(path, f"{name}_optim"))
        rng = torch.load(os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt"))
        torch.set_rng_state(rng["torch"])
        t.kl_ctrl.load_state_dict(state["kl_ctrl"])
        t.loader.load_state_dict(state["data"])
        if dist.get_rank() == 0:
            print(f"tripod: resumed from {path} at step {int(state['step'])}", flush=True)
        return int(state["step"])
