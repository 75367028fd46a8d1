"""megatron_patches/cpu_adam.py: torch's fused CPU Adam / AdamW, switched on inside a megatron-shaped optimizer,
makes the update of torch's reference (per-tensor loop) implementation up to float32 rounding, on fresh random
parameters and gradients of very different scales (Adam divides by sqrt(v): tiny gradients give full-size steps),
with and without weight decay, decoupled (AdamW) or not (Adam)."""
from __future__ import annotations

import types

import pytest
import torch

from tests.helpers.bounds import worst
from tripod.parallel.megatron_patches.cpu_adam import fuse_cpu_adam, torch_adams

SHAPES = [(96, 64), (64,), (3, 5, 7), (1,)]


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _groups(params):  # megatron's split: decayed matrices, undecayed vectors
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_fused_cpu_adam_equals_the_reference_loop(cls):
    steps, lr = 6, 1e-2
    reference, fused = _params(0), _params(0)
    ref_opt = cls(_groups(reference), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    megatron_like = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(
        optimizer=cls(_groups(fused), lr=lr, betas=(0.9, 0.95), eps=1e-8))])
    assert fuse_cpu_adam(megatron_like) == 2
    assert all(group["fused"] for adam in torch_adams(megatron_like) for group in adam.param_groups)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for a, b in zip(reference, fused):
            scale = 10.0 ** float(torch.randint(-8, 1, (), generator=g))
            a.grad = torch.randn(a.shape, generator=g) * scale
            b.grad = a.grad.clone()
        ref_opt.step()
        megatron_like.chained_optimizers[0].optimizer.step()
    # each step rounds differently by a few ulps of the parameter (and of the lr-sized update): 8 ulps a step
    bound = steps * 8 * torch.finfo(torch.float32).eps * worst(p.abs().max().item() for p in reference)
    largest = worst((a - b).abs().max().item() for a, b in zip(reference, fused))
    assert largest <= bound, (largest, bound)
    moved = worst((a - b).abs().max().item() for a, b in zip(reference, _params(0)))
    assert moved > 100 * bound  # the parameters did move: the comparison is not between two untouched copies


def test_only_cpu_torch_adams_are_switched():
    sgd = types.SimpleNamespace(optimizer=torch.optim.SGD(_params(0), lr=0.1))
    assert fuse_cpu_adam(sgd) == 0 and not torch_adams(sgd)
