"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): Llama's names and splits plus the q/k/v biases every Qwen2 model has.

The biases are fused into `linear_qkv.bias` with the grouped [q_g, k_g, v_g] layout and split like the weight;
o_proj has no bias. Qwen2's sliding-window attention is not modelled, so configs that enable it are refused.
"""
from __future__ import annotations

from tripod.parallel.arch import ModelArch
from tripod.parallel.families.llama import dense_gpt_weights, local_gpt_layer_spec
from tripod.parallel.families.spec import FamilySpec


def check_supported(arch: ModelArch) -> None:
    if not arch.qkv_bias:
        raise ValueError("Qwen2 models always have q/k/v biases; ModelArch.qkv_bias=False is inconsistent")
    if arch.hf_config.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window=true (Qwen2) is not supported; "
                         "tripod's attention is full causal, set use_sliding_window=false")


SPEC = FamilySpec(name="qwen2", hf_model_types=("qwen2",), hf_layer_prefix="model.layers.",
                  weights=dense_gpt_weights, check_supported=check_supported, qkv_bias=lambda cfg: True,
                  layer_spec=local_gpt_layer_spec)

from tripod.parallel.families import register_family  # noqa: E402

register_family(SPEC)
