"""Fused RLHF ops (Triton on CUDA) and the plain-torch twins that define them and run on CPU.

Every op takes `backend="auto" | "torch" | "triton"`; auto picks Triton for CUDA tensors when
Triton is importable, torch otherwise. Importing this package needs only torch.
"""
import importlib

_EXPORTS = {
    "gae": f"{__name__}.gae_scan",
    "kl": f"{__name__}.kl_penalty",
    "policy_loss_per_token": f"{__name__}.ppo_losses",
    "value_loss_per_token": f"{__name__}.ppo_losses",
    "logprobs_from_hidden": f"{__name__}.logprobs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
