"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention (per-head q/k RMSNorm, no qkv bias, GQA; rows and refusals
shared with the dense family, qwen3.py) and routed experts (softmax top-k; renormalised when norm_topk_prob), no
shared expert; `mlp_only_layers` / `decoder_sparse_step` choose dense layers. Shared MoE rows: moe_common.py.
"""
from __future__ import annotations

from typing import Any

from tripod.parallel.arch import ModelArch
from tripod.parallel.families.llama import dense_gpt_weights
from tripod.parallel.families.moe_common import (
    check_moe_supported,
    moe_block_spec,
    moe_megatron_fields,
    routed_expert_weights,
)
from tripod.parallel.families.qwen3 import check_qwen3_attention, qk_norm_weights, with_qk_norm
from tripod.parallel.families.spec import FamilySpec, Weight

__all__ = ["SPEC", "qk_norm_weights", "weights", "check_supported", "megatron_fields"]


def weights(arch: ModelArch) -> tuple[Weight, ...]:
    dense = with_qk_norm(list(dense_gpt_weights(arch)))
    return tuple(dense[:-2] + routed_expert_weights(arch) + dense[-2:])


def check_supported(arch: ModelArch) -> None:
    check_moe_supported(arch)
    check_qwen3_attention(arch, "Qwen3-MoE")


def megatron_fields(arch: ModelArch) -> dict[str, Any]:
    return dict(moe_megatron_fields(arch), qk_layernorm=True)


SPEC = FamilySpec(name="qwen3_moe", hf_model_types=("qwen3_moe",), hf_layer_prefix="model.layers.",
                  weights=weights, check_supported=check_supported,
                  qkv_bias=lambda cfg: bool(cfg.get("attention_bias", False)),
                  block_spec=moe_block_spec, megatron_fields=megatron_fields)

from tripod.parallel.families import register_family  # noqa: E402

register_family(SPEC)
