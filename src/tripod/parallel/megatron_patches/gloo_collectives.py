"""In-place data-parallel collectives for megatron's distributed optimizer on gloo (CPU runs).

megatron's DDP reduce-scatters the gradient buffer and all-gathers the parameter buffer of each bucket with
`reduce_scatter_tensor` / `all_gather_into_tensor` (distributed/param_and_grad_buffer.py). tripod runs DDP with
`overlap_grad_reduce=False`, so a model has ONE bucket: its whole buffer. gloo has no native reduce-scatter: measured
on 152 MiB of fp32 with 2 ranks, `reduce_scatter_tensor` held 231 MiB of temporaries (1.5x the buffer) and
`all_gather_into_tensor` 152 MiB (1x), while an in-place `all_reduce` held 2 MiB. At 135M parameters that is
~770 MiB on top of the step's peak RSS.

So on gloo groups the two functions megatron calls are replaced by in-place equivalents:
    reduce-scatter  all-reduce the whole input in place (the output shard is a view into it, as megatron passes it;
                    otherwise it is copied out). The sum of each element is the one gloo computes for the
                    reduce-scatter too; the other ranks' regions of this rank's buffer also end up reduced, which
                    megatron never reads (the distributed optimizer reads its own shard; the buffer is zeroed
                    before the next backward).
    all-gather      one in-place broadcast per rank of its shard into the output (exact copies).
Twice the reduce-scatter's traffic, no temporaries. NCCL groups and async calls keep megatron's functions. Calls go
straight to the process group, so megatron's `_coalescing_manager` (which would batch them into gloo's flattening
`*_coalesced` ops) sees nothing to coalesce.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_installed = False


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def _group(group):
    return group if group is not None else dist.group.WORLD


def inplace_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                           async_op: bool = False, _original=None):
    """reduce_scatter_tensor(output, input) as an in-place all-reduce of `input` on gloo."""
    group = _group(group)
    if async_op or not _is_gloo(group):
        return _original(output, input, op=op, group=group, async_op=async_op)
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    group.allreduce([input], opts).wait()
    flat = input.view(-1)
    start = group.rank() * output.numel()
    mine = flat[start:start + output.numel()]
    if output.data_ptr() != mine.data_ptr():
        output.view(-1).copy_(mine)
    return None


def inplace_all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
                       _original=None):
    """all_gather_into_tensor(output, input) as one in-place broadcast per rank on gloo."""
    group = _group(group)
    if async_op or not _is_gloo(group):
        return _original(output, input, group=group, async_op=async_op)
    flat, n = output.view(-1), input.numel()
    me = group.rank()
    if flat[me * n:(me + 1) * n].data_ptr() != input.data_ptr():
        flat[me * n:(me + 1) * n].copy_(input.view(-1))
    for root in range(group.size()):
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        group.broadcast([flat[root * n:(root + 1) * n]], opts).wait()
    return None


def install_inplace_gloo_collectives() -> None:
    """Point megatron's DDP bucket collectives at the in-place versions (idempotent; gloo groups only)."""
    global _installed
    if _installed:
        return
    from megatron.core.distributed import param_and_grad_buffer as pgb

    rs, ag = pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func
    pgb.dist_reduce_scatter_func = lambda *a, **k: inplace_reduce_scatter(*a, _original=rs, **k)
    pgb.dist_all_gather_func = lambda *a, **k: inplace_all_gather(*a, _original=ag, **k)
    _installed = True
