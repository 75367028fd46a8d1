"""Core attention through PyTorch's scaled_dot_product_attention for megatron's local (non-TE) layer spec.

megatron-core 0.16.1's local `DotProductAttention` materialises the [b, heads, s, s] scores, their fp32 softmax and
its 16-bit cast (at Qwen3-30B-A3B with 1.5k-token sequences, 121 GB of activations per micro-batch), and runs them as
separate baddbmm / masked_fill / softmax / bmm passes. `SDPADotProductAttention` hands the same computation to SDPA's
fused kernels (on CUDA memory-efficient attention with tripod's explicit masks, flash attention without a mask; on
CPU torch's flash-attention kernel, which takes the mask too), which keep only q, k, v, the output and the per-row
log-sum-exp. `sdpa_core_attention` is the computation itself (tested against megatron's on CPU). build_gpt_model puts
the class into the local spec of every non-MLA layer on every device (parallel/model.py; MLA layers keep megatron's
attention), parallel/memory_plan.py counts what it keeps, and tests/multiprocess/test_precision.py measures that
on CPU. It also takes less time than megatron's attention on CPU, forward and backward (bench/RESULTS.md).

Masks: megatron's boolean mask (True = masked) becomes an additive -10000 bias (megatron's masked_fill value), so a
fully masked row (a left-padding query) stays finite as it does in megatron; its output is never read. In a row with
a visible key the masked keys get probability 0, as in megatron: exp(score - 10000 - max) underflows in fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MASK_VALUE = -10000.0  # megatron's attention_mask_func fill value


def sdpa_core_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """megatron's core attention in its own layout: query [sq, b, np, hn], key / value [sk, b, ng, hn] (ng divides
    np: grouped-query attention), boolean mask [b or 1, 1, sq, sk] (True = masked) or None (causal).
    Returns the context [sq, b, np * hn]."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if attention_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        bias = torch.zeros(attention_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
            attention_mask.to(q.device), MASK_VALUE)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    sq, b = query.shape[0], query.shape[1]
    return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def _sdpa_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPADotProductAttention(DotProductAttention):
        """megatron's DotProductAttention, computed by `sdpa_core_attention` (same inputs, same output); what SDPA
        cannot express (attention dropout while training, query-key layer scaling, a learnable softmax offset, packed
        sequences, attention bias) falls back to megatron's own forward."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            cfg = self.config
            plain = (packed_seq_params is None and attention_bias is None and self.softmax_offset is None
                     and not cfg.apply_query_key_layer_scaling
                     and (not self.training or self.attention_dropout.p == 0.0))
            if not plain:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            return sdpa_core_attention(query, key, value, attention_mask, self.softmax_scale)

    return SDPADotProductAttention


_CLASS = None


def sdpa_dot_product_attention() -> type:
    """The SDPA core-attention class (built once, on first use: megatron is imported lazily)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _sdpa_class()
    return _CLASS


def use_sdpa_core_attention(spec) -> None:
    """Point every layer of a local spec (one layer spec, or a decoder block spec) whose core attention is megatron's
    plain DotProductAttention at the SDPA one; MLA layers (their own core attention) are left alone."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = layer.submodules.self_attention.submodules
        if getattr(attention, "core_attention", None) is DotProductAttention and hasattr(attention, "linear_qkv"):
            attention.core_attention = sdpa_dot_product_attention()
