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

What reaches it (`causal_masks`, engine/workers/megatron_worker.py): unpacked rows come with no mask and run SDPA's
`is_causal` (on CUDA the flash kernel is eligible and no [s, s] bias exists per layer); a mask comes only with packed
rows (shared prompts, padding-free) and tripod's all-gather CP. Grouped-query heads go through SDPA's `enable_gqa`
(K / V not copied per query head) wherever a fused kernel takes them (`_kernel_takes_gqa`).

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
    np: grouped-query attention), boolean mask [b or 1, 1, sq, sk] (True = masked) or None (causal: `is_causal`,
    no bias tensor, so CUDA can pick the flash kernel). Returns the context [sq, b, np * hn]."""
    q = query.permute(1, 2, 0, 3)  # [b, heads, s, hn]
    # K / V of their own: megatron's value (and key without RoPE / norm) is a view of the fused QKV projection, whose
    # whole [s, b, (np + 2 ng) hn] storage autograd would otherwise keep alive for the backward
    k, v = (t.permute(1, 2, 0, 3).contiguous() for t in (key, value))
    bias = None
    if attention_mask is not None:
        bias = torch.zeros(attention_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
            attention_mask.to(q.device), MASK_VALUE)
    elif q.shape[2] != k.shape[2]:  # SDPA's is_causal aligns the triangle top-left: wrong for fewer queries than keys
        raise ValueError(f"causal attention without a mask needs as many queries as keys, got {q.shape[2]} and "
                         f"{k.shape[2]}; pass the explicit [b, 1, sq, sk] mask")
    gqa = k.shape[1] != q.shape[1]
    if gqa and not _kernel_takes_gqa(q, k, v, bias):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        gqa = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None, scale=scale,
                                         enable_gqa=gqa)
    sq, b = query.shape[0], query.shape[1]
    return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def _kernel_takes_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether SDPA runs these grouped-query inputs in a fused kernel without copying K / V per query head. CPU: its
    flash kernel does, masked or not. CUDA: flash does (no mask only); whether memory-efficient attention (the one
    that takes a mask) does depends on the torch build, so ask torch's own dispatch checks; where no fused kernel
    takes GQA, SDPA would fall back to the math kernel ([b, heads, s, s] scores): expand K / V instead."""
    if not q.is_cuda:
        return True
    from torch.backends import cuda

    params = cuda.SDPAParams(q, k, v, bias, 0.0, bias is None, True)
    return any(check(params, False) for check in (cuda.can_use_flash_attention, cuda.can_use_efficient_attention,
                                                  cuda.can_use_cudnn_attention))


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
                if attention_mask is None and not query.is_cuda:  # megatron's own causal mask is CUDA-only
                    attention_mask = causal_mask(query.shape[0], query.device)
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


def causal_mask(seq: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """megatron's boolean causal mask [1, 1, seq, seq] (True = masked)."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]


def runs_causal_without_mask(chunk) -> bool:
    """Whether a model chunk (a GPTModel, DDP-wrapped or not) computes plain causal rows from attention_mask=None:
    on CUDA every core attention does (tripod's SDPA one: `is_causal`; TE's: its causal mask type; megatron's local
    one: its default causal mask), on CPU only tripod's SDPA one (megatron's default mask is CUDA-only). Not tripod's
    all-gather context parallelism, whose local queries need the explicit [S / cp, S] rows."""
    from tripod.parallel.context_parallel import is_allgather_cp

    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    cores = [layer.self_attention.core_attention for layer in getattr(chunk.decoder, "layers", [])]
    if any(is_allgather_cp(core) for core in cores):
        return False
    on_cuda = any(p.is_cuda for p in chunk.parameters())
    return on_cuda or all(type(core) is sdpa_dot_product_attention() for core in cores)


def causal_masks(chunks: list, seqs, device: torch.device) -> dict[int, torch.Tensor | None]:
    """The attention mask of unpacked rows of each length in `seqs`: None where every chunk runs causal rows without
    one (`runs_causal_without_mask`: no [s, s] bias per layer, flash-eligible on CUDA), else megatron's causal mask."""
    unmasked = all(runs_causal_without_mask(c) for c in chunks)
    return {s: None if unmasked else causal_mask(s, device) for s in set(seqs)}
