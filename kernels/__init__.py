"""Fused RLHF ops (Triton on CUDA) and the plain-torch twins that define them and run on CPU.

Every op takes `backend="auto" | "torch" | "triton"`; auto picks Triton for CUDA tensors when
Triton is importable, torch otherwise. Importing this package needs only torch.

Name clash note: `transformers` probes for Hugging Face's hub package that is also called `kernels`
and, finding this one, imports it and reads `__version__`. Ours is below the range it accepts, so it
ignores us; the ops are loaded lazily so that probe stays cheap and can never fail.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "gae": "kernels.gae_scan",
    "kl": "kernels.kl_penalty",
    "policy_loss_per_token": "kernels.ppo_losses",
    "value_loss_per_token": "kernels.ppo_losses",
    "logprobs_from_hidden": "kernels.logprobs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
