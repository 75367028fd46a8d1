"""Shared by the layout and cpu-compat torchrun workers: one megatron train step of a tripod model
(megatron DDP + get_megatron_optimizer + tripod's pipeline driver, parallel/pipeline.py)."""
from typing import Callable

import torch


def wrap_for_training(model, layout, *, distributed_optimizer: bool = False, lr: float = 1e-3):
    """(ddp_model, optimizer) for `model`; grad clipping at 1e9 so the grad norm is computed but inert."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    with layout.activate():
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=distributed_optimizer)
        ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model,
                                      pg_collection=layout.pg_collection)
        opt_config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=1e9,
                                     use_distributed_optimizer=distributed_optimizer, params_dtype=torch.float32)
        # our groups already are gloo groups; megatron refuses its extra gloo copies with a pg_collection
        optimizer = get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False,
                                           pg_collection=layout.pg_collection)
        model.config.finalize_model_grads_func = finalize_model_grads
    return ddp, optimizer


def train_step(ddp, optimizer, layout, batch: dict, loss_fn: Callable) -> tuple[float | None, float]:
    """One fwd+bwd+step on one micro-batch; `loss_fn(output) -> scalar`. Returns (loss on last stage
    else None, grad_norm)."""
    from tripod.parallel.pipeline import run_pipeline

    b, s = batch["input_ids"].shape

    def forward_step(mb, model):
        out = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], attention_mask=mb["attention_mask"])

        def loss_func(output):
            loss = loss_fn(output)
            return loss, {"loss": loss.detach()}
        return out, loss_func

    with layout.activate():
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
    losses = run_pipeline([ddp], layout, [batch], forward_step, forward_only=False, seq_length=s, micro_batch_size=b)
    with layout.activate():
        ok, grad_norm, _ = optimizer.step()
        assert ok, "optimizer step skipped"
    loss = losses[0]["loss"].item() if losses else None
    return loss, float(grad_norm)
