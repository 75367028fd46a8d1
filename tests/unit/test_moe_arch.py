"""MoE / MLA parsing of HF configs (parallel/moe_arch.py): which layers are MoE must equal what transformers
builds from the same config, and routers megatron cannot reproduce are refused with the reason."""
import re

import pytest
import torch

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, tie_word_embeddings=False)
CASES = {
    "qwen3_moe": dict(num_hidden_layers=5, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3]),
    "qwen2_moe": dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, norm_topk_prob=False, mlp_only_layers=[0]),
    "deepseek_v3": dict(num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=8,
                        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=8),
    "deepseek_v2": dict(num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="group_limited_greedy",
                        n_shared_experts=2, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=12,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
}


def _hf_config(model_type, **overrides):
    import transformers

    cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "deepseek_v3": transformers.DeepseekV3Config, "deepseek_v2": transformers.DeepseekV2Config}[model_type]
    return cls(**{**COMMON, **CASES[model_type], **overrides})


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_moe_layers_equal_the_hf_model(model_type):
    import transformers

    from tripod.parallel.moe_arch import mla_from_hf, moe_from_hf

    config = _hf_config(model_type)
    model = transformers.AutoModelForCausalLM.from_config(config)
    hf_moe = tuple(hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts") for layer in model.model.layers)
    moe = moe_from_hf(config.to_dict())
    assert moe.layer_is_moe == hf_moe and any(hf_moe) and not all(hf_moe)
    first = model.model.layers[hf_moe.index(True)].mlp
    experts = first.experts
    n_experts = experts.gate_up_proj.shape[0] if hasattr(experts, "gate_up_proj") else len(experts)
    assert moe.num_experts == n_experts and moe.topk == config.num_experts_per_tok
    shared = getattr(first, "shared_experts", None) or getattr(first, "shared_expert", None)
    assert (moe.shared_expert_ffn_hidden_size is None) == (shared is None)
    if shared is not None:
        assert moe.shared_expert_ffn_hidden_size == shared.gate_proj.weight.shape[0]
    assert moe.shared_expert_gate == hasattr(first, "shared_expert_gate")
    assert moe.expert_bias == any(n.endswith("e_score_correction_bias") for n, _ in model.named_buffers())
    mla = mla_from_hf(config.to_dict())
    assert (mla is not None) == model_type.startswith("deepseek")
    if mla is not None:
        attn = model.model.layers[0].self_attn
        assert attn.kv_b_proj.weight.shape[1] == mla.kv_lora_rank
        assert (mla.q_lora_rank is None) == (getattr(attn, "q_a_proj", None) is None)


def test_dense_models_have_no_moe():
    from tripod.parallel.moe_arch import mla_from_hf, moe_from_hf

    cfg = {"model_type": "qwen2", "num_hidden_layers": 2}
    assert moe_from_hf(cfg) is None and mla_from_hf(cfg) is None


@pytest.mark.parametrize("model_type, overrides, message", [
    ("deepseek_v3", dict(norm_topk_prob=False), "norm_topk_prob=False (deepseek_v3): megatron's sigmoid router"),
    ("deepseek_v3", dict(topk_group=1), "topk_group=1 (deepseek_v3): HF scores a group by its top-2 experts"),
    ("deepseek_v2", dict(num_experts_per_tok=4), "topk_method='group_limited_greedy' (deepseek_v2): HF scores a "
                                                 "group by its best expert (max)"),
])
def test_routers_megatron_cannot_match_are_refused(model_type, overrides, message):
    from tripod.parallel.moe_arch import moe_from_hf

    with pytest.raises(ValueError, match=re.escape(message)):
        moe_from_hf(_hf_config(model_type, **overrides).to_dict())


def test_megatron_fields_build_a_config():
    """Every field name we hand megatron exists on its (MLA)TransformerConfig and is accepted together."""
    from megatron.core.transformer import MLATransformerConfig

    from tripod.parallel.moe_arch import megatron_mla_fields, megatron_moe_fields, mla_from_hf, moe_from_hf

    cfg = _hf_config("deepseek_v3").to_dict()
    moe, mla = moe_from_hf(cfg), mla_from_hf(cfg)
    config = MLATransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                                  add_bias_linear=False, normalization="RMSNorm", **megatron_moe_fields(moe),
                                  **megatron_mla_fields(mla))
    assert config.moe_router_enable_expert_bias and config.moe_router_num_groups == 4
    assert config.moe_layer_freq == [0, 1, 1] and config.moe_shared_expert_intermediate_size == 16
    torch.testing.assert_close(torch.tensor(config.moe_router_topk_scaling_factor), torch.tensor(2.5))
