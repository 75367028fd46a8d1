"""Tiny random Hugging Face checkpoints made offline (`save_pretrained`, no download): dense Llama / Qwen2 / Qwen3
(`make_tiny_hf_model`) and Mixture-of-Experts Qwen3-MoE / Qwen2-MoE / DeepSeek-V3 with MLA / GLM-4.5
(`make_tiny_moe_model`).

What the test suite, the benchmarks (scripts/bench_*.py) and the GPU check's steps train and compare. Shapes let
TP in {1, 2}, PP in {1, 2, 4} and EP in {1, 2} all divide: 4 heads (2 KV heads), 4 layers, 4 experts. Weights are
fresh random draws with nothing at a trivial value: norms near 1, biases (and DeepSeek's expert bias) random and
nonzero, MoE routers with larger logits so that top-k choices are not near ties. The same (family, seed, overrides)
gives the same weights.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TINY_CONFIG: dict[str, Any] = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0)
MOE_FAMILIES: dict[str, dict[str, Any]] = {
    # qk-norm, softmax top-2 of 4 renormalised, a dense layer (mlp_only_layers)
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2]),
    # shared expert with a sigmoid gate, softmax without renormalisation, qkv bias
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False),
    # MLA with q_lora, sigmoid routing + expert bias, 2 groups (top-1 group), routed scaling, a shared expert,
    # first layer dense
    "deepseek_v3": dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True, num_nextn_predict_layers=0),
    # GLM-4.5: GQA with q/k/v bias, per-head q/k norm, RoPE on half of each head's dims, DeepSeek-V3's router
    # (sigmoid + correction bias, 2 groups), a shared expert, first layer dense
    "glm4_moe": dict(head_dim=16, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
                     moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                     n_shared_experts=1, routed_scaling_factor=1.5, norm_topk_prob=True, first_k_dense_replace=1,
                     num_nextn_predict_layers=0),
}
# DeepSeek-V2-Lite-like: no q_lora (q_proj), softmax routing without renormalisation, two shared experts
DEEPSEEK_V2 = dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                   n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=24,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, topk_method="greedy")
# DeepSeek-V3's published RoPE: YaRN with mscale == mscale_all_dim (scaled softmax, unscaled cos/sin)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}


def make_tiny_hf_model(tmp_path: str | os.PathLike, family: str, *, seed: int = 0,
                       subdir: str | None = None, sequence_classification: bool = False, **overrides: Any) -> str:
    """Save a tiny random fp32 Llama, Qwen2 or Qwen3 checkpoint with `save_pretrained`; return its directory.

    `family` is "llama", "qwen2" (always has QKV bias) or "qwen3" (per-head q/k norm; pass `head_dim`, whose
    Qwen3Config default is 128). `overrides` go into the HF config,
    e.g. `tie_word_embeddings=True`, `num_hidden_layers=2`,
    `rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}`.
    Weights are drawn from N(0, 0.02) but biases and norm weights are randomised too, so no
    parameter is at a trivial value. The same (family, seed, overrides) gives the same weights.
    `sequence_classification=True` saves a `*ForSequenceClassification` model with one label (a reward model:
    a `score` head [1, hidden] instead of `lm_head`).
    """
    import torch
    import transformers

    configs = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    models = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
              "qwen3": transformers.Qwen3ForCausalLM}
    if family not in configs:
        raise ValueError(f"make_tiny_hf_model family={family!r}; use one of {sorted(configs)}")
    kwargs = dict(TINY_CONFIG)
    if sequence_classification:
        kwargs["num_labels"] = 1
        models = {k: getattr(transformers, v.__name__.replace("ForCausalLM", "ForSequenceClassification"))
                  for k, v in models.items()}
    kwargs.update(overrides)
    config = configs[family](**kwargs)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = models[family](config).to(torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.05 * torch.randn_like(p))
    out = Path(tmp_path) / (subdir or f"{family}_seed{seed}")
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


def hf_moe_model(family: str, seed: int, **overrides: Any):
    """The random transformers model (fp32, eager attention and experts) of a MOE_FAMILIES key or "deepseek_v2"."""
    import torch
    import transformers

    cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "deepseek_v3": transformers.DeepseekV3Config, "deepseek_v2": transformers.DeepseekV2Config,
           "glm4_moe": transformers.Glm4MoeConfig}[family]
    family_config = MOE_FAMILIES.get(family, DEEPSEEK_V2 if family == "deepseek_v2" else {})
    config = cls(**{**TINY_CONFIG, **family_config, **overrides})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                r = torch.randn(p.shape, generator=g)
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * r)
                elif name.endswith(".bias"):
                    p.copy_(0.1 * r)
                elif name.endswith("gate.weight"):
                    p.copy_(0.5 * r)
                else:
                    p.copy_(0.05 * r)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model.eval()


def make_tiny_moe_model(tmp_path: str | os.PathLike, family: str, *, seed: int = 0, subdir: str | None = None,
                        **overrides: Any) -> str:
    """Save a tiny random fp32 MoE checkpoint of `family` (a key of MOE_FAMILIES, or "deepseek_v2") with
    `save_pretrained` (per-expert names on disk); return its directory."""
    out = Path(tmp_path) / (subdir or f"{family}_seed{seed}")
    hf_moe_model(family, seed, **overrides).save_pretrained(out, safe_serialization=True)
    return str(out)
