"""Pure-tensor HF <-> Megatron conversion (parallel.convert): round trips, the layout contract, errors.

No process groups: these run in the pytest process on real `transformers` model state dicts.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from tripod.parallel.arch import arch_from_hf
from tripod.parallel.convert import (
    canonical_names,
    family_of,
    hf_to_megatron,
    megatron_to_hf,
    pad_vocab,
    padded_vocab_size,
    unpad_vocab,
)


def tp_shard(arch, name, full, tp, rank):
    return family_of(arch).shard(arch, name, full, tp, rank)

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=64)
VARIANTS = {
    "qwen2_gqa_bias_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2_gqa_bias_untied": ("qwen2", dict(tie_word_embeddings=False)),
    "llama_untied": ("llama", dict(tie_word_embeddings=False)),
    "llama_mha_tied": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=8)),
    # Qwen3 dense: q/k norm rows, no bias, head_dim 16 != hidden / heads = 8
    "qwen3_qknorm_tied": ("qwen3", dict(tie_word_embeddings=True)),
    "qwen3_qknorm_untied": ("qwen3", dict(tie_word_embeddings=False)),
}


def _hf_model(family: str, seed: int = 0, **overrides):
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    cfg = cls[0](**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = cls[1](cfg)
    with torch.no_grad():
        for p in model.parameters():  # fresh random values everywhere, incl. norms and biases
            p.copy_(torch.randn_like(p))
    return model


def _hf_state(model) -> dict[str, torch.Tensor]:
    state = {k: v for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # save_pretrained drops the tied duplicate
    return state


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_round_trip_every_tp_bit_exact(variant):
    family, overrides = VARIANTS[variant]
    model = _hf_model(family, **overrides)
    arch = arch_from_hf(model.config.to_dict())
    hf_state = _hf_state(model)
    full = hf_to_megatron(arch, hf_state)
    assert list(full) == canonical_names(arch)
    for name, t in full.items():
        assert tuple(t.shape) == family_of(arch).shape(arch, name), name
    for tp in (1, 2, 4):
        rebuilt: dict[str, torch.Tensor] = {}
        for name, t in full.items():
            shards = [tp_shard(arch, name, t, tp, r) for r in range(tp)]
            if name.endswith("word_embeddings.weight") or name == "output_layer.weight":
                assert all(s.shape[0] == padded_vocab_size(arch.vocab_size, tp) // tp for s in shards)
            merged = family_of(arch).merge(arch, name, shards)
            for hf_name, tensor in megatron_to_hf(arch, name, merged):
                assert hf_name not in rebuilt
                rebuilt[hf_name] = tensor
        assert sorted(rebuilt) == sorted(hf_state), f"tp={tp}"
        for k, v in hf_state.items():
            assert rebuilt[k].dtype == v.dtype and torch.equal(rebuilt[k], v), f"tp={tp} {k}"


def test_layout_contract_qkv_fc1_vocab():
    """Check the documented layout element by element against the HF tensors (index arithmetic)."""
    model = _hf_model("qwen2", seed=1)
    arch = arch_from_hf(model.config.to_dict())
    hf = _hf_state(model)
    full = hf_to_megatron(arch, hf)
    hd, hpg, nkv = arch.head_dim, arch.heads_per_group, arch.num_kv_heads
    pre = "model.layers.1.self_attn."
    qkv_w = full["decoder.layers.1.self_attention.linear_qkv.weight"]
    qkv_b = full["decoder.layers.1.self_attention.linear_qkv.bias"]
    group_rows = (hpg + 2) * hd
    for g in range(nkv):
        base = g * group_rows
        for j in range(hpg):  # q head g*hpg+j
            head = g * hpg + j
            rows = slice(base + j * hd, base + (j + 1) * hd)
            assert torch.equal(qkv_w[rows], hf[pre + "q_proj.weight"][head * hd:(head + 1) * hd])
            assert torch.equal(qkv_b[rows], hf[pre + "q_proj.bias"][head * hd:(head + 1) * hd])
        k_rows = slice(base + hpg * hd, base + (hpg + 1) * hd)
        v_rows = slice(base + (hpg + 1) * hd, base + group_rows)
        assert torch.equal(qkv_w[k_rows], hf[pre + "k_proj.weight"][g * hd:(g + 1) * hd])
        assert torch.equal(qkv_w[v_rows], hf[pre + "v_proj.weight"][g * hd:(g + 1) * hd])
        assert torch.equal(qkv_b[v_rows], hf[pre + "v_proj.bias"][g * hd:(g + 1) * hd])
    # TP shard r holds whole KV groups r*nkv/t ... and fc1 shard = [gate chunk r, up chunk r]
    tp = 2
    shard = tp_shard(arch, "decoder.layers.1.self_attention.linear_qkv.weight", qkv_w, tp, 1)
    assert torch.equal(shard, qkv_w[(nkv // tp) * group_rows:])
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    f = arch.ffn_hidden_size // tp
    fc1 = tp_shard(arch, "decoder.layers.0.mlp.linear_fc1.weight",
                   full["decoder.layers.0.mlp.linear_fc1.weight"], tp, 1)
    assert torch.equal(fc1, torch.cat([gate[f:], up[f:]]))
    proj = tp_shard(arch, "decoder.layers.0.self_attention.linear_proj.weight",
                    full["decoder.layers.0.self_attention.linear_proj.weight"], tp, 0)
    assert torch.equal(proj, hf["model.layers.0.self_attn.o_proj.weight"][:, : arch.num_heads * hd // tp])
    # vocab: padded to a multiple of 128*tp with zero rows; the shard boundary is in the padded space
    emb = hf["model.embed_tokens.weight"]
    assert padded_vocab_size(300, 1) == 384 and padded_vocab_size(300, 2) == 512
    padded = pad_vocab(arch, emb, 2)
    assert padded.shape == (512, arch.hidden_size) and torch.count_nonzero(padded[300:]) == 0
    assert torch.equal(unpad_vocab(arch, padded), emb)
    emb_shard1 = tp_shard(arch, "embedding.word_embeddings.weight", emb, 2, 1)
    assert torch.equal(emb_shard1[:44], emb[256:]) and torch.count_nonzero(emb_shard1[44:]) == 0
    # layernorms replicated
    norm = full["decoder.final_layernorm.weight"]
    assert torch.equal(tp_shard(arch, "decoder.final_layernorm.weight", norm, 4, 3), norm)


def test_missing_and_extra_tensors_are_listed():
    model = _hf_model("qwen2", seed=2)
    arch = arch_from_hf(model.config.to_dict())
    hf = _hf_state(model)
    broken = dict(hf)
    del broken["model.layers.1.self_attn.k_proj.bias"]
    del broken["model.norm.weight"]
    broken["model.layers.2.mlp.gate_proj.weight"] = torch.randn(3, 3)
    with pytest.raises(ValueError) as err:
        hf_to_megatron(arch, broken)
    msg = str(err.value)
    for needle in ("missing 2", "model.layers.1.self_attn.k_proj.bias", "model.norm.weight",
                   "unexpected 1", "model.layers.2.mlp.gate_proj.weight", "config.json"):
        assert needle in msg, (needle, msg)
    wrong_shape = dict(hf)
    wrong_shape["model.layers.0.mlp.down_proj.weight"] = torch.randn(arch.hidden_size, 7)
    with pytest.raises(ValueError, match="down_proj.weight: shape"):
        hf_to_megatron(arch, wrong_shape)


def test_bad_tp_and_unsupported_configs():
    model = _hf_model("llama", seed=3, num_key_value_heads=2)
    arch = arch_from_hf(model.config.to_dict())
    full = hf_to_megatron(arch, _hf_state(model))
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 must divide .*num_key_value_heads=2"):
        tp_shard(arch, name, full[name], 4, 0)
    with pytest.raises(ValueError, match="attention_bias=true"):
        hf_to_megatron(arch_from_hf({**model.config.to_dict(), "attention_bias": True}), {})
    with pytest.raises(ValueError, match="model_type='gpt2'.*not supported"):
        arch_from_hf({**model.config.to_dict(), "model_type": "gpt2"})
    with pytest.raises(KeyError, match="not a parameter"):
        megatron_to_hf(arch, "decoder.layers.9.mlp.linear_fc2.weight", torch.randn(1))
    qwen3 = {**TINY, "model_type": "qwen3"}
    with pytest.raises(ValueError, match=r"attention_bias=true \(Qwen3\) is not supported"):
        hf_to_megatron(arch_from_hf({**qwen3, "attention_bias": True}), {})
    with pytest.raises(ValueError, match=r"use_sliding_window=true \(Qwen3\) is not supported"):
        hf_to_megatron(arch_from_hf({**qwen3, "layer_types": ["full_attention", "sliding_attention"]}), {})
