"""The loop tripod's single-model trainers share (`tripod train-rm`, `tripod train-sft`): resume, train steps,
validation before training and every `trainer.test_freq`, atomic checkpoints with retention, the model exported to HF
at the end. A trainer supplies its data, `train_step`, `validate` and the names below."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


class SupervisedLoop:
    part: str  # the checkpoint part's name (`tripod export CKPT_DIR/<part>`)
    command: str  # the CLI command, for the line that says where the model went
    console_keys: tuple[str, ...]  # the metrics printed on the console each step

    # set by the trainer: cfg, rank, world, step, total_steps, schedule, worker, ckpt, run_dir, arch, tokenizer_dir
    def has_validation(self) -> bool:
        raise NotImplementedError

    def train_step(self) -> dict[str, float]:
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        raise NotImplementedError

    # ---- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "world_size": self.world,
                "lr_scheduler": {self.part: self.worker.lr_scheduler.state_dict()},
                "rng": {"torch": torch.get_rng_state()}}

    def resume(self, mode: str | None) -> None:
        state = self.ckpt.load(mode, {self.part: self.worker})
        if state is None:
            return
        self.worker.lr_scheduler.num_steps = 0  # megatron's load_state_dict adds the saved count to the live one
        self.worker.lr_scheduler.load_state_dict(state["lr_scheduler"][self.part])
        torch.set_rng_state(state["rng"]["torch"])
        self.step = int(state["step"])

    def export(self) -> str:
        """The trained model as an HF directory with its tokenizer (`<run dir>/hf`); every rank calls it."""
        from tripod.parallel.convert import save_hf_checkpoint

        out = os.path.join(self.run_dir, "hf")
        save_hf_checkpoint(self.worker.model, self.arch, self.worker.layout, out, tokenizer_dir=self.tokenizer_dir)
        dist.barrier()
        return out

    # ---- the loop ---------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        from tripod.engine.config_loading import config_to_dict, save_resolved_config
        from tripod.engine.logging import Tracker

        cfg, t = self.cfg, self.cfg.trainer
        self.resume(t.resume)
        if self.rank == 0:
            save_resolved_config(cfg, self.run_dir)
        tracker = Tracker(self.run_dir, t.logger, resume_step=self.step or None, total_steps=self.total_steps,
                          console_keys=self.console_keys, project_name=t.project_name,
                          experiment_name=t.experiment_name, config=config_to_dict(cfg)) if self.rank == 0 else None
        last_val: dict[str, float] = {}
        if self.step == 0 and t.val_before_train and self.has_validation():
            last_val = self.validate()
            if tracker:
                tracker.log(last_val, 0)
        while self.step < self.total_steps:
            metrics = self.train_step()
            self.step += 1
            done = self.step >= self.total_steps
            if self.has_validation() and (done or (t.test_freq > 0 and self.step % t.test_freq == 0)):
                last_val = self.validate()
                metrics.update(last_val)
            metrics["training/epoch"] = (self.step - 1) // self.schedule.steps_per_epoch
            if tracker:
                tracker.log(metrics, self.step)
            if done or (t.save_freq > 0 and self.step % t.save_freq == 0):
                self.ckpt.save(self.step, self.state_dict(), {self.part: self.worker})
                self.ckpt.retain()  # after the step is logged (engine/checkpoints/retention.py)
        if tracker:
            tracker.close()
        out = self.export()
        if self.rank == 0:
            print(f"{self.command}: exported the model to {out}", flush=True)
        return last_val
