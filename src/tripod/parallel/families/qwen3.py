"""Qwen3 dense (Qwen3ForCausalLM, Qwen3-0.6B to 32B): Llama's names and splits plus a per-head RMSNorm on q and k.

HF's `self_attn.q_norm.weight` / `k_norm.weight` ([head_dim] each, applied to every head before RoPE) are megatron's
`self_attention.q_layernorm.weight` / `k_layernorm.weight` (`qk_layernorm=True`; the same names under the
Transformer Engine spec, where they are TENorm modules), replicated over TP. There is no q/k/v bias, `head_dim` may
differ from hidden_size / num_attention_heads (Qwen3-0.6B: 128 vs 64), and embeddings are tied or untied as
config.json says (0.6B-4B tied, 8B and up untied). Qwen3-MoE (qwen3_moe.py) shares the attention rows and refusals.
"""
from __future__ import annotations

from typing import Any

from tripod.parallel.arch import ModelArch
from tripod.parallel.families.llama import dense_gpt_weights
from tripod.parallel.families.spec import FamilySpec, Split, Weight


def qk_norm_weights() -> list[Weight]:
    """Per-head q/k RMSNorm (Qwen3): megatron's q_layernorm / k_layernorm, one [head_dim] weight each."""
    return [Weight("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), lambda a: (a.head_dim,),
                   Split.REPLICATED),
            Weight("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), lambda a: (a.head_dim,),
                   Split.REPLICATED)]


def with_qk_norm(rows: list[Weight]) -> list[Weight]:
    """A Llama-shaped table with the q/k norm rows inserted before the attention output projection."""
    at = next(i for i, w in enumerate(rows) if w.megatron == "self_attention.linear_proj.weight")
    return rows[:at] + qk_norm_weights() + rows[at:]


def weights(arch: ModelArch) -> tuple[Weight, ...]:
    return tuple(with_qk_norm(list(dense_gpt_weights(arch))))


def check_qwen3_attention(arch: ModelArch, name: str) -> None:
    """Refusals of Qwen3 attention (dense and MoE), one clear line each."""
    if arch.qkv_bias:
        raise ValueError(f"config.json attention_bias=true ({name}) is not supported: its o_proj bias has no "
                         "Megatron counterpart without add_bias_linear; use attention_bias=false")
    cfg = arch.hf_config
    windowed = [i for i, t in enumerate(cfg.get("layer_types") or []) if t != "full_attention"]
    if cfg.get("use_sliding_window") or windowed:
        raise ValueError(f"config.json use_sliding_window=true ({name}) is not supported; tripod's attention is "
                         "full causal, set use_sliding_window=false")


def check_supported(arch: ModelArch) -> None:
    check_qwen3_attention(arch, "Qwen3")


def layer_spec(arch: ModelArch, use_te: bool) -> Any:
    """megatron's GPT layer spec with q/k layernorm: Transformer Engine when available (GPU), local otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)


def megatron_fields(arch: ModelArch) -> dict[str, Any]:
    return {"qk_layernorm": True}


SPEC = FamilySpec(name="qwen3", hf_model_types=("qwen3",), hf_layer_prefix="model.layers.",
                  weights=weights, check_supported=check_supported,
                  qkv_bias=lambda cfg: bool(cfg.get("attention_bias", False)),
                  layer_spec=layer_spec, megatron_fields=megatron_fields)

from tripod.parallel.families import register_family  # noqa: E402

register_family(SPEC)
