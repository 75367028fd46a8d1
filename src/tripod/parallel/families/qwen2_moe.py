"""Qwen2-MoE / Qwen1.5-MoE (Qwen2MoeForCausalLM): Qwen2 attention (q/k/v biases, GQA) and routed experts
(softmax top-k, renormalised only with norm_topk_prob) plus one shared expert scaled by a sigmoid gate
(`mlp.shared_expert_gate` -> megatron's `mlp.shared_experts.gate_weight`). Shared MoE rows: moe_common.py.
"""
from __future__ import annotations

from tripod.parallel.arch import ModelArch
from tripod.parallel.families.llama import dense_gpt_weights
from tripod.parallel.families.moe_common import (
    check_moe_supported,
    moe_block_spec,
    moe_megatron_fields,
    routed_expert_weights,
)
from tripod.parallel.families.spec import FamilySpec, Weight


def weights(arch: ModelArch) -> tuple[Weight, ...]:
    dense = list(dense_gpt_weights(arch))
    moe = routed_expert_weights(arch, shared_hf="mlp.shared_expert.", shared_gate_hf="mlp.shared_expert_gate.weight")
    return tuple(dense[:-2] + moe + dense[-2:])


def check_supported(arch: ModelArch) -> None:
    check_moe_supported(arch)
    if arch.hf_config.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true (Qwen2-MoE) is not supported; tripod's attention is "
                         "full causal, set use_sliding_window=false")
    if arch.moe.shared_expert_ffn_hidden_size and not arch.moe.shared_expert_gate:
        raise ValueError("Qwen2-MoE's shared expert always has a sigmoid gate; the parsed config has none")


SPEC = FamilySpec(name="qwen2_moe", hf_model_types=("qwen2_moe",), hf_layer_prefix="model.layers.",
                  weights=weights, check_supported=check_supported,
                  qkv_bias=lambda cfg: bool(cfg.get("qkv_bias", True)),
                  block_spec=moe_block_spec, megatron_fields=moe_megatron_fields)

from tripod.parallel.families import register_family  # noqa: E402

register_family(SPEC)
