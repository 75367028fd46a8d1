"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention (per-head q/k RMSNorm, no qkv bias, GQA) and routed experts
(softmax top-k; renormalised when norm_topk_prob), no shared expert; `mlp_only_layers` / `decoder_sparse_step`
choose dense layers. Shared MoE rows: moe_common.py.
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
from tripod.parallel.families.spec import FamilySpec, Split, Weight


def qk_norm_weights() -> list[Weight]:
    """Per-head q/k RMSNorm (Qwen3): megatron's q_layernorm / k_layernorm, one [head_dim] weight each."""
    return [Weight("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), lambda a: (a.head_dim,),
                   Split.REPLICATED),
            Weight("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), lambda a: (a.head_dim,),
                   Split.REPLICATED)]


def weights(arch: ModelArch) -> tuple[Weight, ...]:
    dense = list(dense_gpt_weights(arch))
    at = next(i for i, w in enumerate(dense) if w.megatron == "self_attention.linear_proj.weight")
    return tuple(dense[:at] + qk_norm_weights() + dense[at:-2] + routed_expert_weights(arch) + dense[-2:])


def check_supported(arch: ModelArch) -> None:
    check_moe_supported(arch)
    if arch.qkv_bias:
        raise ValueError("config.json attention_bias=true (Qwen3-MoE) is not supported: its o_proj bias has no "
                         "Megatron counterpart without add_bias_linear; use attention_bias=false")
    if arch.hf_config.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true (Qwen3-MoE) is not supported; tripod's attention is "
                         "full causal, set use_sliding_window=false")


def megatron_fields(arch: ModelArch) -> dict[str, Any]:
    return dict(moe_megatron_fields(arch), qk_layernorm=True)


SPEC = FamilySpec(name="qwen3_moe", hf_model_types=("qwen3_moe",), hf_layer_prefix="model.layers.",
                  weights=weights, check_supported=check_supported,
                  qkv_bias=lambda cfg: bool(cfg.get("attention_bias", False)),
                  block_spec=moe_block_spec, megatron_fields=megatron_fields)

from tripod.parallel.families import register_family  # noqa: E402

register_family(SPEC)
