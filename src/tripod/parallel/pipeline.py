"""The one driver of megatron's pipeline schedule: training steps, log-prob / value passes and the tests use it.

`run_pipeline(chunks, layout, microbatches, forward_step, forward_only=...)` pushes micro-batches through
`megatron.core.pipeline_parallel.get_forward_backward_func` on this model's layout: no pipelining at PP=1,
1F1B at PP>1, interleaved 1F1B when the model has one chunk per virtual pipeline stage (VPP). Every rank of
the layout calls it with the same micro-batches; the last stage gets the loss functions' outputs.

`forward_step(mb, model) -> (output, loss_fn or None)` sees one micro-batch and the chunk to run it through;
with virtual stages each chunk iterates the micro-batches in order, so the `mb` a chunk sees is always the one
its input activations belong to.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch


def check_virtual_microbatches(layout, vpp: int | None, num_microbatches: int, what: str) -> None:
    """Interleaved 1F1B needs at least PP micro-batches per call (megatron's microbatch group = PP)."""
    if vpp and vpp > 1 and layout.pp > 1 and num_microbatches % layout.pp:
        raise ValueError(f"{what}: {num_microbatches} micro-batches per call with "
                         f"virtual_pipeline_model_parallel_size={vpp} needs a multiple of "
                         f"pipeline_model_parallel_size={layout.pp}; change the batch or micro-batch size")


def run_pipeline(chunks: Sequence[torch.nn.Module], layout, microbatches: Sequence[Any],
                 forward_step: Callable[[Any, torch.nn.Module], tuple[torch.Tensor, Callable | None]], *,
                 forward_only: bool, seq_length: int, micro_batch_size: int) -> list:
    """Run `microbatches` through the model chunks of this rank; returns the last stage's loss outputs ([] elsewhere).

    `chunks`: this rank's model chunks (DDP-wrapped or not), one per virtual pipeline stage. Gradients
    accumulate into the chunks' grad buffers when `forward_only` is False (zero them before, step after).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks = list(chunks)
    vpp = len(chunks) if len(chunks) > 1 else None
    check_virtual_microbatches(layout, vpp, len(microbatches), "run_pipeline")

    def step(data_iterator, model):
        mb = next(data_iterator)
        output, loss_fn = forward_step(mb, model)
        if loss_fn is None:  # forward-only without a loss: hand the output itself to the caller
            return output, lambda out: (out.sum() * 0.0, out)
        return output, loss_fn

    iterators: Any = [iter(microbatches) for _ in chunks] if vpp else iter(microbatches)
    with layout.activate(), torch.set_grad_enabled(not forward_only):
        kwargs: dict[str, Any] = dict(pg_collection=layout.pg_collection)
        if layout.pp > 1:
            kwargs["p2p_communicator"] = layout.p2p_communicator(model_config(chunks[0]))
        schedule = get_forward_backward_func(pp_size=layout.pp, vp_size=vpp)
        out = schedule(forward_step_func=step, data_iterator=iterators, model=chunks,
                       num_microbatches=len(microbatches), seq_length=seq_length,
                       micro_batch_size=micro_batch_size, forward_only=forward_only, **kwargs)
    return list(out) if layout.is_last_stage else []


def model_config(model: torch.nn.Module):
    """The TransformerConfig of a (DDP-wrapped) model chunk; the P2P communicator reads it."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model.config


@contextlib.contextmanager
def variable_shapes(chunks, on: bool):
    """megatron's `variable_seq_lengths` for one pipeline call: the stages send each activation's shape before it."""
    configs = list({id(c): c for c in (model_config(chunk) for chunk in chunks)}.values()) if on else []
    before = [c.variable_seq_lengths for c in configs]
    for c in configs:
        c.variable_seq_lengths = True
    try:
        yield
    finally:
        for c, b in zip(configs, before):
            c.variable_seq_lengths = b
