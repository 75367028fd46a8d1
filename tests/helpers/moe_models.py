"""Tiny random HF Mixture-of-Experts checkpoints for tests: Qwen3-MoE, Qwen2-MoE and DeepSeek-V3 (MLA).

`make_tiny_moe_model(tmp, family, seed)` builds the model with transformers (fresh random weights: norms near
1, biases and the DeepSeek expert bias random and nonzero, routers with larger logits so top-k choices are
not near ties), saves it with `save_pretrained` (per-expert names on disk) and returns the directory.
Shapes let (tp, pp, ep) in {1, 2} all divide: 4 heads, 4 layers, 4 experts.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

COMMON: dict[str, Any] = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                              pad_token_id=0, rope_theta=10000.0)
FAMILIES: dict[str, dict[str, Any]] = {
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
}
# DeepSeek-V2-Lite-like: no q_lora (q_proj), softmax routing without renormalisation, two shared experts
DEEPSEEK_V2 = dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                   n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=24,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, topk_method="greedy")

# DeepSeek-V3's published RoPE: YaRN with mscale == mscale_all_dim (scaled softmax, unscaled cos/sin)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}


def hf_moe_model(family: str, seed: int, **overrides: Any):
    """The random transformers model (fp32, eager attention and experts) of a FAMILIES key or "deepseek_v2"."""
    import torch
    import transformers

    cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "deepseek_v3": transformers.DeepseekV3Config, "deepseek_v2": transformers.DeepseekV2Config}[family]
    config = cls(**{**COMMON, **FAMILIES.get(family, DEEPSEEK_V2 if family == "deepseek_v2" else {}), **overrides})
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
    """Save a tiny random fp32 MoE checkpoint of `family` (a key of FAMILIES); return its directory."""
    out = Path(tmp_path) / (subdir or f"{family}_seed{seed}")
    hf_moe_model(family, seed, **overrides).save_pretrained(out, safe_serialization=True)
    return str(out)
