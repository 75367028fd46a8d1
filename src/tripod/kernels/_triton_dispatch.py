"""Backend choice and input checks shared by the elementwise RL ops (gae, kl, policy/value loss).

`resolve_backend` turns `backend="auto" | "torch" | "triton"` into the implementation to run:
auto means Triton for CUDA tensors when Triton imports, torch otherwise. Triton on CPU tensors
only works through its interpreter (`TRITON_INTERPRET=1`, set before triton is imported), which
the tests use to check the kernels without a GPU.
"""
from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "torch", "triton")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """Return "torch" or "triton" for `backend` given the op's input tensors."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' needs the `triton` package; install it or use backend='torch'")
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before importing triton "
                "to run the kernels on CPU); use backend='torch' for CPU tensors"
            )
    return backend


def check_float_tensors(**named: torch.Tensor | None) -> torch.Size:
    """Check that every non-None argument is a floating tensor and that all share one shape.

    Raises ValueError naming the offending argument; returns the common shape.
    """
    shape, first = None, None
    for name, value in named.items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if not value.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {value.dtype}; cast it with .float()")
        if shape is None:
            shape, first = value.shape, name
        elif value.shape != shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)} but {first} has shape {tuple(shape)}; "
                             "they must match")
    if shape is None:
        raise ValueError("no tensor given")
    return shape


def check_mask(mask: torch.Tensor, shape: torch.Size, name: str = "mask") -> None:
    """A mask may be bool, integer or float (0/1) but must have the data's shape."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"{name} has shape {tuple(mask.shape)} but the data has shape {tuple(shape)}; they must match")
    if mask.is_complex():
        raise ValueError(f"{name} must be bool, integer or float 0/1, got dtype {mask.dtype}")


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype the ops compute and return in: float32, or wider if an input is wider (float64)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def upcast(*tensors: torch.Tensor) -> list[torch.Tensor]:
    dtype = compute_dtype(*tensors)
    return [t.to(dtype) for t in tensors]
