"""Fused RLHF ops (Triton on CUDA) and the plain-torch twins that define them and run on CPU.

Every op takes `backend="auto" | "torch" | "triton"`; auto picks Triton for CUDA tensors when
Triton is importable, torch otherwise. Importing this package needs only torch.
"""
from kernels.gae_scan import gae
from kernels.kl_penalty import kl
from kernels.logprobs import logprobs_from_hidden
from kernels.ppo_losses import policy_loss, value_loss

__all__ = ["gae", "kl", "policy_loss", "value_loss", "logprobs_from_hidden"]
