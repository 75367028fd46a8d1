"""GLM-4.5 / GLM-4.6-style MoE (Glm4MoeForCausalLM, HF model_type `glm4_moe`): GQA attention with q/k/v biases
and no o_proj bias (Qwen2's rows), an optional per-head q/k RMSNorm (`use_qk_norm`, Qwen3's rows), partial rotary
(RoPE on the first `partial_rotary_factor` of each head's dims, GPT-NeoX style: megatron's rotary_percent), and
DeepSeek-V3's MoE: sigmoid routing with the e_score_correction_bias, group-limited top-k, routed scaling, shared
experts, the first `first_k_dense_replace` layers dense (transformers builds GLM's router and decoder layer from
DeepSeek-V3's classes). Router refusals are parallel/moe_arch.py's, shared with DeepSeek-V3.

The published checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers after the last decoder
layer (GLM-4.5: model.layers.92.*); tripod neither trains nor runs them: they are skipped on read and written back
unchanged on export when the source checkpoint is known (parallel/convert: `extra_layers_from`).
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
from tripod.parallel.families.qwen3 import with_qk_norm
from tripod.parallel.families.spec import FamilySpec, Weight


def _qk_norm(arch: ModelArch) -> bool:
    return bool(arch.hf_config.get("use_qk_norm", False))


def weights(arch: ModelArch) -> tuple[Weight, ...]:
    dense = list(dense_gpt_weights(arch))  # q/k/v fused with their biases when attention_bias, o_proj without
    if _qk_norm(arch):
        dense = with_qk_norm(dense)
    return tuple(dense[:-2] + routed_expert_weights(arch, shared_hf="mlp.shared_experts.") + dense[-2:])


def check_supported(arch: ModelArch) -> None:
    check_moe_supported(arch)
    rope_type = (arch.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"config.json rope_parameters.rope_type={rope_type!r} (GLM-4.5 MoE) is not supported; "
                         "the published GLM-4.5/4.6 checkpoints use plain RoPE ('default')")


def megatron_fields(arch: ModelArch) -> dict[str, Any]:
    return dict(moe_megatron_fields(arch), qk_layernorm=_qk_norm(arch))


SPEC = FamilySpec(name="glm4_moe", hf_model_types=("glm4_moe",), hf_layer_prefix="model.layers.",
                  weights=weights, check_supported=check_supported,
                  qkv_bias=lambda cfg: bool(cfg.get("attention_bias", False)),
                  block_spec=moe_block_spec, megatron_fields=megatron_fields,
                  extra_hf_layers="GLM-4.5 multi-token-prediction (MTP) layer, not used for training or rollout")

from tripod.parallel.families import register_family  # noqa: E402

register_family(SPEC)
