"""Llama family (LlamaForCausalLM): the HF <-> Megatron name map.

HF names: model.embed_tokens / model.layers.{i}.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
input_layernorm, post_attention_layernorm} / model.norm / lm_head. The fusion rules (grouped qkv,
gate|up fc1) and TP rules live in common.py.
"""
from __future__ import annotations

from parallel.arch import ModelArch
from parallel.convert.common import (FC1_WEIGHT, FC2_WEIGHT, INPUT_NORM, PRE_MLP_NORM, PROJ_WEIGHT,
                                     QKV_BIAS, QKV_WEIGHT, FamilyNames)


def layer_map(arch: ModelArch) -> dict[str, tuple[str, ...]]:
    """Megatron per-layer suffix -> the HF per-layer suffixes it is fused from (in order)."""
    names = {
        INPUT_NORM: ("input_layernorm.weight",),
        QKV_WEIGHT: ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        PROJ_WEIGHT: ("self_attn.o_proj.weight",),
        PRE_MLP_NORM: ("post_attention_layernorm.weight",),
        FC1_WEIGHT: ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        FC2_WEIGHT: ("mlp.down_proj.weight",),
    }
    if arch.qkv_bias:
        names[QKV_BIAS] = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
    return names


def check_supported(arch: ModelArch) -> None:
    if arch.qkv_bias:
        # HF Llama's attention_bias also puts a bias on o_proj, which megatron's linear_proj only
        # has together with biases on every linear (add_bias_linear).
        raise ValueError("config.json attention_bias=true (Llama) is not supported: its o_proj bias has "
                         "no Megatron counterpart without add_bias_linear; use attention_bias=false")


NAMES = FamilyNames(
    family="llama",
    embedding="model.embed_tokens.weight",
    final_norm="model.norm.weight",
    output_layer="lm_head.weight",
    hf_layer_prefix="model.layers.",
    layer_map=layer_map,
    check_supported=check_supported,
)
