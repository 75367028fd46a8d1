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
Once a checkpoint is complete and its step logged, `retain()` deletes older ones beyond
`trainer.max_actor_ckpt_to_keep` / `max_critic_ckpt_to_keep`, crash-safely (engine/checkpoints/retention.py).

Each rank writes its own files from the live tensors (parallel/megatron_patches/checkpoint_save.py; the optimizer's
state a chunk at a time, engine/checkpoints/optimizer_state.py), so a save adds no copy of the state to a rank. An
asynchronous save (`trainer.async_save`) stages (copies) what this rank writes, returns, and writes from a thread
while training goes on; `poll()` after every step finishes it once every rank has written (a collective), and the
next save, a load and the end of the run `wait()` for it: at most one save is in flight.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

COMPLETE = "COMPLETE"
REJECTED = "REJECTED"  # written by the divergence guard (engine/divergence_guard.py) on checkpoints it rolled back past
GOOD = "GOOD"  # written by the divergence guard on checkpoints of accepted steps (its rollback targets)
STATE_FILE = "trainer_state.json"
QUEUE_FILE = "async_queue.pt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def checkpoint_steps(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete `global_step_<k>` directory under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted((int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root)
                  if (m := STEP_DIR.match(name)) and os.path.exists(os.path.join(root, name, COMPLETE)))


def latest_complete(root: str) -> str | None:
    """The newest complete `global_step_<k>` directory the divergence guard has not rejected, or None."""
    found = [path for _, path in checkpoint_steps(root) if not os.path.exists(os.path.join(path, REJECTED))]
    return found[-1] if found else None


class CheckpointManager:
    """Saves and loads a trainer's state object (`PPOTrainer.state_dict()`) with the weights and optimizer states of
    the trainable models it is handed; it knows nothing else of the trainer."""

    def __init__(self, root: str, arch, tokenizer_dir: str, keep: dict[str, int | None] | None = None):
        """`keep`: {model: how many of its newest checkpoints to keep, None: all} (engine/checkpoints/retention.py)."""
        from tripod.engine.checkpoints.retention import finish_interrupted

        self.root, self.arch, self.tokenizer_dir = root, arch, tokenizer_dir
        self.keep = dict(keep or {})
        self.in_flight: _InFlight | None = None
        self.finished: dict[str, float] = {}
        self.on_complete: list = []  # called on rank 0 with each checkpoint's directory once it is complete
        self.completed = False  # a checkpoint became complete since the last retain()
        if dist.get_rank() == 0:
            finish_interrupted(root)  # what a run killed while deleting old checkpoints left

    def save(self, step: int, state: dict[str, Any], models: dict[str, Any], asynchronous: bool = False) -> str:
        """Write `global_step_<step>`: every worker of `models` ({name: worker}), this rank's `state["rng"]`, and (rank 0)
        the rest of `state` as trainer_state.json. Every rank calls it; returns the directory it will have. With
        `asynchronous` the state is staged and written in the background (module docstring)."""
        from tripod.engine.checkpoints.optimizer_state import plan_optimizer_save
        from tripod.parallel.checkpoint import ModelCheckpointSave

        self.wait()
        rank = dist.get_rank()
        final = os.path.join(self.root, f"global_step_{step}")
        tmp = os.path.join(self.root, f"tmp_global_step_{step}")
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"))
        dist.barrier()
        saves = []
        for name, worker in models.items():
            saves.append(ModelCheckpointSave(worker.model, os.path.join(tmp, name), self.arch, worker.layout,
                                             tokenizer_dir=self.tokenizer_dir, stage=asynchronous,
                                             extra_metadata=getattr(worker, "checkpoint_metadata", None)))
            if rank == 0:
                os.makedirs(os.path.join(tmp, f"{name}_optim"), exist_ok=True)
            dist.barrier()
            saves.append(plan_optimizer_save(worker, os.path.join(tmp, f"{name}_optim"), stage=asynchronous))
        torch.save(state["rng"], os.path.join(tmp, "rng", f"rank_{rank}.pt"))
        if rank == 0:
            if state.get("async_queue"):  # batches the rollout ranks made with older weights (async_rollout/source.py)
                torch.save(state["async_queue"], os.path.join(tmp, QUEUE_FILE))
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump({k: v for k, v in state.items() if k not in ("rng", "async_queue")}, f, indent=2)
        self.in_flight = _InFlight(step, tmp, final, saves)
        if asynchronous:
            self.in_flight.thread = threading.Thread(target=self.in_flight.write, name=f"checkpoint-{step}", daemon=True)
            self.in_flight.thread.start()
        else:
            self.in_flight.write()
            self.wait()
        return final

    def poll(self) -> dict[str, float]:
        """Finish the save in flight if every rank has written its files (collective: every rank calls it at the
        same point); the checkpoint/* metrics of the saves finished since the last call, else {}."""
        if self.in_flight is not None:
            done = torch.tensor([int(self.in_flight.thread is None or not self.in_flight.thread.is_alive())])
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
            if done.item():
                self.wait()
        finished, self.finished = self.finished, {}
        return finished

    def wait(self) -> dict[str, float]:
        """Wait for the save in flight (if any) and finish it: checkpoint/* metrics. Collective."""
        job, self.in_flight = self.in_flight, None
        if job is None:
            return {}
        if job.thread is not None:
            job.thread.join()
        for save in job.saves:  # megatron's metadata; raises on every rank if a rank's write failed
            save.finish()
        if job.error is not None:
            raise RuntimeError(f"checkpoint {job.tmp}: writing failed on rank {dist.get_rank()}") from job.error
        written = torch.tensor([float(sum(s.nbytes for s in job.saves)), job.write_s])
        dist.all_reduce(written, op=dist.ReduceOp.MAX)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(job.tmp, COMPLETE), "w") as f:
                f.write(f"{job.step}\n")
            shutil.rmtree(job.final, ignore_errors=True)
            os.replace(job.tmp, job.final)
            for hook in self.on_complete:
                hook(job.final)
            self.completed = True
        dist.barrier()
        self.finished = {"checkpoint/step": float(job.step), "timing_s/checkpoint_write": written[1].item(),
                         "perf/checkpoint_staged_gb": written[0].item() / 2 ** 30 if job.thread else 0.0}
        return self.finished

    def load(self, mode: str | None, models: dict[str, Any]) -> dict[str, Any] | None:
        """Load the checkpoint `mode` names ("auto": latest complete one; "disable"; or a path) into the workers of
        `models`; returns the saved trainer state with this rank's "rng" (for `PPOTrainer.load_state_dict`), or None
        when there is nothing to resume."""
        if mode in ("disable", "", None):
            return None
        self.wait()
        path = latest_complete(self.root) if mode == "auto" else mode
        if path is None:
            return None
        if not os.path.exists(os.path.join(path, COMPLETE)):
            raise ValueError(f"trainer.resume={mode}: {path} is not a complete tripod checkpoint "
                             f"(no {COMPLETE} marker); point it at a global_step_<k> directory or use auto")
        from tripod.engine.checkpoints import optimizer_state
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
            optimizer_state.load_optimizer(worker, os.path.join(path, f"{name}_optim"))
        state["rng"] = torch.load(os.path.join(path, "rng", f"rank_{dist.get_rank()}.pt"))
        queue = os.path.join(path, QUEUE_FILE)
        state["async_queue"] = torch.load(queue) if dist.get_rank() == 0 and os.path.exists(queue) else []
        if dist.get_rank() == 0:
            print(f"tripod: resumed from {path} at step {int(state['step'])}", flush=True)
        return state

    def retain(self) -> None:
        """Delete the checkpoints beyond `keep` (rank 0; the others return), when one became complete since the last
        call: the trainer calls it once the step that saved is logged, so a run killed while deleting has logged it."""
        from tripod.engine.checkpoints.retention import prune

        if self.completed and dist.get_rank() == 0:
            prune(self.root, self.keep)
        self.completed = False

    def reject_after(self, step: int) -> None:
        """Mark every checkpoint newer than `step` REJECTED (the divergence guard rolled back past it). Every rank."""
        if dist.get_rank() == 0:
            for s, p in checkpoint_steps(self.root):
                if s > step:
                    open(os.path.join(p, REJECTED), "w").close()
        dist.barrier()


class _InFlight:
    """A save whose files are being written: its model and optimizer saves, planned; `write()` writes them all."""

    def __init__(self, step: int, tmp: str, final: str, saves: list):
        self.step, self.tmp, self.final, self.saves = step, tmp, final, saves
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.write_s = 0.0

    def write(self) -> None:
        start = time.perf_counter()
        try:
            for save in self.saves:
                save.write()
        except BaseException as e:  # noqa: BLE001 - finished (and raised) collectively by CheckpointManager.wait
            self.error = e
        self.write_s = time.perf_counter() - start
