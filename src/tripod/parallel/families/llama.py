"""Llama (LlamaForCausalLM): RMSNorm, SwiGLU, RoPE (optional llama3/linear scaling), GQA, tied or untied head.

`dense_gpt_weights` is the table of a Llama-shaped decoder; families with the same HF names (Qwen2, and the toy
family of docs/extending.md) build theirs from it.
"""
from __future__ import annotations

from typing import Any

from tripod.parallel.arch import ModelArch
from tripod.parallel.families.spec import EMBEDDING, FINAL_NORM, OUTPUT_LAYER, FamilySpec, Fuse, Layers, Split, Weight


def _qkv_rows(a: ModelArch) -> int:
    return (a.num_heads + 2 * a.num_kv_heads) * a.head_dim


def dense_gpt_weights(arch: ModelArch) -> tuple[Weight, ...]:
    """The HF Llama names of megatron's GPT layer (local-spec names, TE's in `te`), with each tensor's TP split."""
    rows = [
        Weight(EMBEDDING, ("model.embed_tokens.weight",), lambda a: (a.vocab_size, a.hidden_size), Split.VOCAB,
               per_layer=False),
        Weight("input_layernorm.weight", ("input_layernorm.weight",), lambda a: (a.hidden_size,), Split.REPLICATED,
               te="self_attention.linear_qkv.layer_norm_weight"),
        Weight("self_attention.linear_qkv.weight",
               ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
               lambda a: (_qkv_rows(a), a.hidden_size), Split.ROW, Fuse.QKV_GROUPED),
    ]
    if arch.qkv_bias:
        rows.append(Weight("self_attention.linear_qkv.bias",
                           ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
                           lambda a: (_qkv_rows(a),), Split.ROW, Fuse.QKV_GROUPED))
    rows += [
        Weight("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",),
               lambda a: (a.hidden_size, a.num_heads * a.head_dim), Split.COL),
        # TE folds it into a dense MLP's linear_fc1; before routed experts it stays a norm of its own (same name)
        Weight("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), lambda a: (a.hidden_size,),
               Split.REPLICATED, te="mlp.linear_fc1.layer_norm_weight"),
        Weight("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
               lambda a: (2 * a.ffn_hidden_size, a.hidden_size), Split.GATED_ROW, Fuse.CONCAT, layers=Layers.DENSE),
        Weight("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), lambda a: (a.hidden_size, a.ffn_hidden_size),
               Split.COL, layers=Layers.DENSE),
        Weight(FINAL_NORM, ("model.norm.weight",), lambda a: (a.hidden_size,), Split.REPLICATED, per_layer=False),
        # a reward model (HF *ForSequenceClassification, one label): the scalar head megatron's value head holds,
        # replicated over TP like the critic's
        Weight(OUTPUT_LAYER, ("score.weight",), lambda a: (1, a.hidden_size), Split.REPLICATED, per_layer=False)
        if arch.score_head else
        Weight(OUTPUT_LAYER, ("lm_head.weight",), lambda a: (a.vocab_size, a.hidden_size), Split.VOCAB,
               per_layer=False),
    ]
    return tuple(rows)


def local_gpt_layer_spec(arch: ModelArch, use_te: bool) -> Any:
    """megatron's GPT layer spec: Transformer Engine when available (GPU), the local (torch) spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")


def check_supported(arch: ModelArch) -> None:
    if arch.qkv_bias:
        # HF Llama's attention_bias also puts a bias on o_proj, which megatron's linear_proj only
        # has together with biases on every linear (add_bias_linear).
        raise ValueError("config.json attention_bias=true (Llama) is not supported: its o_proj bias has "
                         "no Megatron counterpart without add_bias_linear; use attention_bias=false")


def _qkv_bias(cfg: dict) -> bool:
    return bool(cfg.get("attention_bias", False))


SPEC = FamilySpec(name="llama", hf_model_types=("llama",), hf_layer_prefix="model.layers.",
                  weights=dense_gpt_weights, check_supported=check_supported, qkv_bias=_qkv_bias,
                  layer_spec=local_gpt_layer_spec)

from tripod.parallel.families import register_family  # noqa: E402

register_family(SPEC)
