"""tripod runtime: what a rank's process runs on, below the models and the trainer: the device it computes on and the
guard that checks it (`device.py`), its host and CUDA memory readers (`memory.py`), and where each model's
parameters, gradients and optimizer states live in each phase of a step with the moves that put them there
(`offload.py`). Imports nothing from `tripod.parallel` or `tripod.engine` (docs/layout.md)."""
