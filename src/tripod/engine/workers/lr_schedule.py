"""The learning-rate schedule of a trained model: warm-up length from `optim.*` and megatron-core's
OptimizerParamScheduler over the run's optimizer steps (`MegatronWorker` builds one per trainable model)."""
from __future__ import annotations

from tripod.engine.config import LR_DECAY_STYLES, OptimConfig


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """optim.lr_warmup_steps, or lr_warmup_steps_ratio of `total_steps` when it is < 0 (verl's rule)."""
    return optim.lr_warmup_steps if optim.lr_warmup_steps >= 0 else int(optim.lr_warmup_steps_ratio * total_steps)


def build_lr_scheduler(optimizer, optim: OptimConfig, total_steps: int, key: str = "optim"):
    """megatron-core's OptimizerParamScheduler over `total_steps` optimizer steps: linear warm-up from 0 to optim.lr,
    then `optim.lr_decay_style` down to optim.min_lr_ratio * lr at the last step. Step it once per optimizer step;
    the k-th optimizer step (k = 0, 1, ...) runs with the LR of scheduler step k (as in Megatron-LM)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = warmup_steps(optim, total_steps)
    total = max(total_steps, warmup + 1)  # megatron needs warm-up < decay steps; past the end it holds min_lr
    if optim.lr_decay_style not in LR_DECAY_STYLES:
        raise ValueError(f"{key}.lr_decay_style={optim.lr_decay_style!r} is not one of {list(LR_DECAY_STYLES)}")
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=optim.lr, min_lr=optim.min_lr_ratio * optim.lr, lr_warmup_steps=warmup,
        lr_decay_steps=total, lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay,
        end_wd=optim.weight_decay, wd_incr_steps=total, wd_incr_style="constant")
