"""A recipe's model scaled to one host (engine/bench/scaled_model.py) keeps every per-layer shape of the recipe's model,
gives each kept expert the recipe's tokens, and falls back in the documented order when memory is short."""
from __future__ import annotations

import json

import pytest

from tripod import CHECKOUT
from tripod.engine.bench.scaled_model import fit_scaled_model, run_bytes, scale_config
from tripod.engine.throughput import active_matmul_params
from tripod.parallel.arch import arch_from_hf

MODEL_CONFIGS = CHECKOUT / "recipes" / "model_configs"


class _Tokenizer:  # what scale_config reads of a tokenizer
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __len__(self) -> int:
        return 1000


def _hf(name: str) -> dict:
    return json.loads((MODEL_CONFIGS / f"{name}.json").read_text())


def _layer_shapes(arch) -> dict:
    moe = arch.moe
    return {"hidden": arch.hidden_size, "heads": arch.num_heads, "kv_heads": arch.num_kv_heads,
            "head_dim": arch.head_dim, "ffn": arch.ffn_hidden_size, "qkv_bias": arch.qkv_bias, "mla": arch.mla,
            "expert_ffn": moe and moe.expert_ffn_hidden_size, "topk": moe and moe.topk,
            "shared": moe and moe.shared_expert_ffn_hidden_size, "rope": arch.rope_inv_freq()[0].tolist()}


@pytest.mark.parametrize("name,dp", [("Qwen--Qwen2.5-7B-Instruct", 2), ("Qwen--Qwen3-8B", 2),
                                     ("Qwen--Qwen3-30B-A3B", 2), ("deepseek-ai--DeepSeek-V3", 16)])
def test_scaled_model_keeps_every_layer_shape(name: str, dp: int):
    hf = _hf(name)
    scaled = scale_config(hf, layers=2, data_parallel=dp, tokenizer=_Tokenizer())
    full, small = arch_from_hf(hf), arch_from_hf(scaled.config)
    assert _layer_shapes(small) == _layer_shapes(full)
    assert small.num_layers == 2 and small.vocab_size == 1000 and small.eos_token_id == 2
    if full.moe is not None:
        assert any(small.moe.layer_is_moe)
        # each expert receives T * k / E' tokens of a T-token micro-batch on one rank, T * DP * k / E in the recipe
        assert small.moe.topk / small.num_experts == pytest.approx(dp * full.moe.topk / full.num_experts)
    else:  # a dense model's layers are all alike: the scaled one's active parameters are 2 of the full model's
        assert active_matmul_params(small) * full.num_layers == active_matmul_params(full) * 2


def test_fit_falls_back_in_order_and_refuses_what_cannot_fit():
    hf = _hf("deepseek-ai--DeepSeek-V3")
    roomy = fit_scaled_model(hf, layers=2, data_parallel=16, tokenizer=_Tokenizer(), memory_gb=1e4, critic=False,
                             reference=False)
    assert roomy.config["num_hidden_layers"] == 2 and roomy.config["n_routed_experts"] == 16
    limit_gb = run_bytes(roomy.params, critic=False, reference=False) / 2 ** 30 * 0.6
    tight = fit_scaled_model(hf, layers=2, data_parallel=16, tokenizer=_Tokenizer(), memory_gb=limit_gb, critic=False,
                             reference=False)
    assert tight.config["num_hidden_layers"] == 1  # depth goes first
    assert run_bytes(tight.params, critic=False, reference=False) <= limit_gb * 2 ** 30
    # halving experts and top-k together keeps each expert's tokens per micro-batch
    cut = fit_scaled_model(hf, layers=1, data_parallel=16, tokenizer=_Tokenizer(), memory_gb=8.0, critic=False,
                           reference=False)
    assert cut.config["tie_word_embeddings"] is True
    assert cut.config["num_experts_per_tok"] / cut.config["n_routed_experts"] == pytest.approx(16 * 8 / 256)
    assert any("experts" in c for c in cut.changes) and "embeddings tied" in cut.changes
    with pytest.raises(ValueError, match="memory_gb=0.5 is less"):
        fit_scaled_model(hf, layers=1, data_parallel=16, tokenizer=_Tokenizer(), memory_gb=0.5, critic=False,
                         reference=False)
