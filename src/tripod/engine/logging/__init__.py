"""Run logging for the PPO trainer: metrics.jsonl + TensorBoard + a console progress line (+ wandb / MLflow),
validation samples, timers, reductions, the step profiler (profiler.py) and the run report (report.py).

    from tripod.engine.logging import Tracker, Timer, reduce_metrics, append_to_dict

    tracker = Tracker(cfg.trainer.default_local_dir, cfg.trainer.logger, resume_step=start_step - 1 or None,
                      total_steps=total_steps)
    timer = Timer()
    with timer("gen"):
        ...
    micro = {}
    append_to_dict(micro, {"actor/pg_loss": loss})          # per micro-batch
    tracker.log({**reduce_metrics(micro), **timer.metrics()}, step)
    tracker.close()
"""
from tripod.engine.logging.profiler import StepProfiler
from tripod.engine.logging.progress import ProgressLine, format_metrics
from tripod.engine.logging.tracker import Timer, Tracker, append_to_dict, reduce_metrics, to_scalar, validation_samples

__all__ = ["Tracker", "ProgressLine", "Timer", "append_to_dict", "reduce_metrics", "to_scalar", "format_metrics",
           "StepProfiler", "validation_samples"]
