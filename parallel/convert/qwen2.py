"""Qwen2 / Qwen2.5 family (Qwen2ForCausalLM): the HF <-> Megatron name map.

Same HF names as Llama, plus the q/k/v projection biases every Qwen2 model has (fused into
`linear_qkv.bias` with the grouped [q_g, k_g, v_g] layout); o_proj has no bias. Qwen2's sliding
window attention is not modelled, so configs that enable it are refused.
"""
from __future__ import annotations

from parallel.arch import ModelArch
from parallel.convert.common import (FC1_WEIGHT, FC2_WEIGHT, INPUT_NORM, PRE_MLP_NORM, PROJ_WEIGHT,
                                     QKV_BIAS, QKV_WEIGHT, FamilyNames)


def layer_map(arch: ModelArch) -> dict[str, tuple[str, ...]]:
    """Megatron per-layer suffix -> the HF per-layer suffixes it is fused from (in order)."""
    return {
        INPUT_NORM: ("input_layernorm.weight",),
        QKV_WEIGHT: ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        QKV_BIAS: ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        PROJ_WEIGHT: ("self_attn.o_proj.weight",),
        PRE_MLP_NORM: ("post_attention_layernorm.weight",),
        FC1_WEIGHT: ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        FC2_WEIGHT: ("mlp.down_proj.weight",),
    }


def check_supported(arch: ModelArch) -> None:
    if not arch.qkv_bias:
        raise ValueError("Qwen2 models always have q/k/v biases; ModelArch.qkv_bias=False is inconsistent")
    if arch.hf_config.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true (Qwen2) is not supported; "
                         "tripod's attention is full causal, set use_sliding_window=false")


NAMES = FamilyNames(
    family="qwen2",
    embedding="model.embed_tokens.weight",
    final_norm="model.norm.weight",
    output_layer="lm_head.weight",
    hf_layer_prefix="model.layers.",
    layer_map=layer_map,
    check_supported=check_supported,
)
