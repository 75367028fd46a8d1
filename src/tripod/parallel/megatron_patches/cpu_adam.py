"""Torch's fused Adam / AdamW kernel for megatron's optimizer on CPU.

Without Transformer Engine or Apex, megatron-core 0.16.1 builds `torch.optim.AdamW` (or `Adam`) with neither `fused`
nor `foreach`; on CPU tensors torch then runs its single-tensor implementation: a Python loop over the parameter
tensors, about ten elementwise kernels each. torch's fused CPU kernel (`fused=True`: one pass over each tensor) computes
the same update up to rounding several times faster (bench/RESULTS.md).

`fuse_cpu_adam(optimizer)` sets `fused=True` on every param group of every torch Adam / AdamW inside megatron's
optimizer whose parameters are all on the CPU. Runs on GPUs (TE's or Apex's FusedAdam, or torch's CUDA defaults) and
the CPU-offload optimizer are left as they are. Device: CPU. Canary: tests/multiprocess/test_cpu_adam.py (megatron
still builds the unfused optimizer; once it does not, this patch can go).
"""
from __future__ import annotations

import torch


def torch_adams(optimizer) -> list[torch.optim.Optimizer]:
    """The torch Adam / AdamW instances inside a megatron optimizer (a ChainedOptimizer, a MegatronOptimizer, or
    one of torch's)."""
    found: list[torch.optim.Optimizer] = []
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(part, "optimizer", part)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            found.append(inner)
    return found


def fuse_cpu_adam(optimizer) -> int:
    """Switch the CPU torch Adam / AdamW inside `optimizer` to torch's fused kernel (module docstring); return how
    many param groups were switched. Call it before the first step (the state it makes is then the fused kernel's)."""
    switched = 0
    for adam in torch_adams(optimizer):
        mine = 0
        for group in adam.param_groups:
            params = group["params"]
            if group.get("fused") or group.get("differentiable") or not params:
                continue
            if all(p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
                   for p in params):
                group.update(fused=True, foreach=False)
                mine += 1
        if mine:
            adam.defaults.update(fused=True, foreach=False)
        switched += mine
    return switched
