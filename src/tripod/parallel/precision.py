"""Precision and memory-saving settings of one Megatron model, resolved from the config for a layout and a device.

What the names tripod accepts (`megatron.param_dtype`, `use_distributed_optimizer`, `recompute_*`,
`optimizer_cpu_offload`, `rollout.dtype`) mean for megatron-core (their up-front checks: engine/config_validation.py):

    param_dtype=bf16|fp16   TransformerConfig(bf16/fp16=True, params_dtype) -> megatron's optimizer keeps fp32 main
                            weights and Adam states (Float16OptimizerWithFloat16Params, or DistributedOptimizer), DDP
                            reduces gradients in fp32 (`grad_reduce_in_fp32=True`), fp16 adds a dynamic loss scaler.
    use_distributed_optimizer   true shards the optimizer over DP; null = auto: on when DP > 1 and the optimizer is
                            Adam (megatron's DistributedOptimizer supports Adam only; at DP = 1 there is nothing to
                            shard). Its checkpoints resume at any layout (tests/multiprocess/test_precision.py).
    recompute_granularity   TransformerConfig.recompute_granularity / recompute_method / recompute_num_layers.
    optimizer_cpu_offload   OptimizerConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0): megatron's
                            HybridDeviceOptimizer, which uses CUDA streams; needs CUDA and the distributed optimizer.
    rollout.dtype           generation shard + KV cache dtype; null = bf16 on CUDA, fp32 on CPU.
The moves to host memory between phases (`param_offload`, `grad_offload`, `optimizer_offload`): runtime/offload.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_of(name: str, key: str = "param_dtype") -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"{key}={name!r} is not one of {list(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class PrecisionSettings:
    """What one worker builds: parameter dtype, optimizer sharding/offload, activation recomputation."""

    param_dtype: torch.dtype = torch.float32
    use_distributed_optimizer: bool = False
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    optimizer_cpu_offload: bool = False

    def transformer_overrides(self) -> dict[str, Any]:
        """TransformerConfig fields for activation recomputation (empty when off)."""
        if self.recompute_granularity is None:
            return {}
        out: dict[str, Any] = {"recompute_granularity": self.recompute_granularity}
        if self.recompute_granularity == "full":
            out.update(recompute_method=self.recompute_method, recompute_num_layers=self.recompute_num_layers or 1)
        return out

    def optimizer_overrides(self) -> dict[str, Any]:
        """OptimizerConfig fields beyond lr/betas: mixed precision flags and CPU offload of optimizer states."""
        out: dict[str, Any] = dict(params_dtype=self.param_dtype, bf16=self.param_dtype == torch.bfloat16,
                                   fp16=self.param_dtype == torch.float16,
                                   use_distributed_optimizer=self.use_distributed_optimizer)
        if self.param_dtype == torch.float16:
            out.update(loss_scale=None, initial_loss_scale=2.0 ** 16)  # dynamic loss scaling
        if self.optimizer_cpu_offload:
            out.update(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                       use_precision_aware_optimizer=True)
        return out


def distributed_optimizer_on(setting: Optional[bool], dp: int, optimizer: str) -> bool:
    """`use_distributed_optimizer` resolved: an explicit true/false wins; null = on when dp > 1 with Adam."""
    return bool(setting) if setting is not None else (dp > 1 and optimizer == "adam")


def resolve_precision(m, dp: int, trainable: bool, optimizer: str = "adam") -> PrecisionSettings:
    """`m`: a MegatronConfig (or anything with its attributes); `dp`: this model's data-parallel size; `optimizer`:
    its optim.optimizer (the distributed optimizer's auto setting needs Adam)."""
    dist_opt = distributed_optimizer_on(m.use_distributed_optimizer, dp, optimizer)
    if not trainable:
        return PrecisionSettings(param_dtype=dtype_of(m.param_dtype))
    return PrecisionSettings(param_dtype=dtype_of(m.param_dtype), use_distributed_optimizer=bool(dist_opt),
                             recompute_granularity=m.recompute_granularity,
                             recompute_method=m.recompute_method if m.recompute_granularity == "full" else None,
                             recompute_num_layers=m.recompute_num_layers, optimizer_cpu_offload=m.optimizer_cpu_offload)


def rollout_dtype(name: Optional[str], device: torch.device | str) -> torch.dtype:
    """The generation shard's dtype: `name` (fp32|bf16|fp16), or bf16 on CUDA / fp32 elsewhere when None."""
    if name is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return dtype_of(name, "actor_rollout_ref.rollout.dtype")
