"""DeepSeek-V3 and DeepSeek-V2 (DeepseekV3ForCausalLM / DeepseekV2ForCausalLM): multi-head latent attention and
routed experts with shared experts; the first `first_k_dense_replace` layers have a dense MLP.

MLA names (HF `self_attn.*` -> megatron `self_attention.*`, all TP splits by head except the down projections,
which megatron's local spec builds as column-parallel linears gathered after use):
  q_a_proj [q_lora, H] -> linear_q_down_proj (ROW)     q_a_layernorm -> q_layernorm
  q_b_proj [nh*(nope+rope), q_lora] -> linear_q_up_proj (ROW)   (V2-Lite without q_lora: q_proj -> linear_q_proj)
  kv_a_proj_with_mqa [kv_lora+rope, H] -> linear_kv_down_proj (ROW)   kv_a_layernorm -> kv_layernorm
  kv_b_proj [nh*(nope+v), kv_lora] -> linear_kv_up_proj (ROW)   o_proj [H, nh*v] -> linear_proj (COL)
HF applies RoPE to interleaved pairs (V3 rope_interleave=true; V2 always); megatron's MLA de-interleaves the same
way. Routing (sigmoid + expert bias + groups for V3, softmax without renormalisation for V2) and its refusals
are parallel/moe_arch.py's. Real V3 checkpoints carry multi-token-prediction layers (index >= num_hidden_layers):
the reader skips them.
RoPE: plain, or YaRN as the published V3 config has it (mscale = mscale_all_dim, so HF's cos/sin scale is 1):
megatron's plain per-layer rotary embedding gets HF's YaRN frequencies (parallel/model.py) and MLA's softmax
scale takes HF's mscale(factor, mscale_all_dim)^2 through rotary_scaling_factor / mscale_all_dim; megatron's own
YarnRotaryEmbedding is not used (its frequency ramp is separate code).
"""
from __future__ import annotations

import math
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


def _q_head(a: ModelArch) -> int:
    return a.mla.qk_nope_head_dim + a.mla.qk_rope_head_dim


def mla_weights(arch: ModelArch) -> list[Weight]:
    rows = []
    if arch.mla.q_lora_rank:
        rows += [
            Weight("self_attention.linear_q_down_proj.weight", ("self_attn.q_a_proj.weight",),
                   lambda a: (a.mla.q_lora_rank, a.hidden_size), Split.ROW),
            Weight("self_attention.q_layernorm.weight", ("self_attn.q_a_layernorm.weight",),
                   lambda a: (a.mla.q_lora_rank,), Split.REPLICATED),
            Weight("self_attention.linear_q_up_proj.weight", ("self_attn.q_b_proj.weight",),
                   lambda a: (a.num_heads * _q_head(a), a.mla.q_lora_rank), Split.ROW),
        ]
    else:
        rows.append(Weight("self_attention.linear_q_proj.weight", ("self_attn.q_proj.weight",),
                           lambda a: (a.num_heads * _q_head(a), a.hidden_size), Split.ROW))
    rows += [
        Weight("self_attention.linear_kv_down_proj.weight", ("self_attn.kv_a_proj_with_mqa.weight",),
               lambda a: (a.mla.kv_lora_rank + a.mla.qk_rope_head_dim, a.hidden_size), Split.ROW),
        Weight("self_attention.kv_layernorm.weight", ("self_attn.kv_a_layernorm.weight",),
               lambda a: (a.mla.kv_lora_rank,), Split.REPLICATED),
        Weight("self_attention.linear_kv_up_proj.weight", ("self_attn.kv_b_proj.weight",),
               lambda a: (a.num_heads * (a.mla.qk_nope_head_dim + a.mla.v_head_dim), a.mla.kv_lora_rank), Split.ROW),
        Weight("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",),
               lambda a: (a.hidden_size, a.num_heads * a.mla.v_head_dim), Split.COL),
    ]
    return rows


def weights(arch: ModelArch) -> tuple[Weight, ...]:
    dense = list(dense_gpt_weights(arch))  # embedding, input norm, qkv(+bias), proj, pre-MLP norm, fc1, fc2, ...
    by_name = {w.megatron: w for w in dense}
    mlp = [by_name["pre_mlp_layernorm.weight"], by_name["mlp.linear_fc1.weight"], by_name["mlp.linear_fc2.weight"]]
    moe = routed_expert_weights(arch, shared_hf="mlp.shared_experts.")
    return tuple([dense[0], by_name["input_layernorm.weight"]] + mla_weights(arch) + mlp + moe + dense[-2:])


def check_supported(arch: ModelArch) -> None:
    check_moe_supported(arch)
    if arch.mla is None:
        raise ValueError(f"config.json kv_lora_rank={arch.hf_config.get('kv_lora_rank')!r} ({arch.family}): tripod "
                         "builds DeepSeek attention as MLA and needs kv_lora_rank > 0")
    if arch.hf_config.get("attention_bias"):
        raise ValueError("config.json attention_bias=true (DeepSeek) is not supported: megatron's MLA projections "
                         "have no biases; use attention_bias=false")
    if arch.hf_config.get("model_type") == "deepseek_v3" and not arch.hf_config.get("rope_interleave", True):
        raise ValueError("config.json rope_interleave=false (DeepSeek-V3) is not supported: megatron's MLA always "
                         "rotates interleaved RoPE pairs; use rope_interleave=true (the published checkpoints do)")
    rope_type = (arch.rope_parameters or {}).get("rope_type", "default")
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"config.json rope_parameters.rope_type={rope_type!r} (DeepSeek MLA) is not supported; "
                         "tripod matches plain RoPE and YaRN")
    if rope_type == "yarn":
        _, attention_scaling = arch.rope_inv_freq()
        if abs(attention_scaling - 1.0) > 1e-12:
            raise ValueError(f"config.json rope_parameters (YaRN, DeepSeek MLA) scale cos/sin by {attention_scaling}"
                             "; tripod supports YaRN with mscale == mscale_all_dim (as DeepSeek-V3 publishes it)")


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(arch: ModelArch) -> float:
    """MLA's attention softmax scale as HF DeepSeek computes it: 1/sqrt(qk_nope + qk_rope head dim), times
    mscale(factor, mscale_all_dim)^2 under YaRN (megatron: MLASelfAttention.softmax_scale; a decoder needs it too)."""
    scale = (arch.mla.qk_nope_head_dim + arch.mla.qk_rope_head_dim) ** -0.5
    rope = arch.rope_parameters or {}
    if rope.get("rope_type", "default") == "yarn" and rope.get("mscale_all_dim"):
        scale *= _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return scale


def megatron_fields(arch: ModelArch) -> dict[str, Any]:
    fields = moe_megatron_fields(arch)
    rope = arch.rope_parameters or {}
    if rope.get("rope_type", "default") == "yarn":  # MLA's softmax scale x mscale(factor, mscale_all_dim)^2, as HF
        fields.update(rotary_scaling_factor=float(rope["factor"]),
                      mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))
    return fields


SPEC = FamilySpec(name="deepseek", hf_model_types=("deepseek_v3", "deepseek_v2"), hf_layer_prefix="model.layers.",
                  weights=weights, check_supported=check_supported, qkv_bias=lambda cfg: False,
                  block_spec=moe_block_spec, megatron_fields=megatron_fields,
                  extra_hf_layers="DeepSeek multi-token-prediction (MTP) layer, not used for training or rollout")

from tripod.parallel.families import register_family  # noqa: E402

register_family(SPEC)
