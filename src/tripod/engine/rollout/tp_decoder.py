"""The tensor-parallel Llama/Qwen2 decoder the embedded rollout engine runs, with a KV cache.

It computes straight from a generation shard in megatron's layout (the shapes and TP splits of every
tensor come from the model family's table, parallel/families/; docs/rollout.md): column-parallel linear_qkv / linear_fc1 give each
TP rank its own KV groups and its own slice of the FFN; row-parallel linear_proj / linear_fc2
produce partial sums that are all-reduced over the TP group; the embedding and the LM head are
vocab-parallel. Math follows the HF reference (RMSNorm in fp32, SwiGLU, RoPE from
`ModelArch.rope_inv_freq`, GQA, optional qkv bias, optional per-head q/k RMSNorm as Qwen3 has).
MoE and MLA layers: engine/rollout/moe_decoder.py.

On CPU in fp32 every linear runs through oneDNN's inner product (`linear`): with the few rows of a decode step
(one per live sequence) MKL's sgemm, behind F.linear, streams the weights at about half the rate (bench/RESULTS.md);
same math, float rounding aside.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tripod.parallel.arch import ModelArch
from tripod.parallel.families import get_family


@dataclass
class KVCache:
    """Per-layer keys/values [N, nkv_local, T, hd] preallocated for the whole generation,
    plus which slots hold real tokens (`valid` [N, T]: False for left padding and unwritten slots)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor
    length: int = 0  # slots written so far (the same for every row: prompts are left-padded)

    @classmethod
    def allocate(cls, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, value_dim: int | None = None) -> "KVCache":
        """`value_dim` (default `head_dim`): last dim of the values when it differs from the keys' (MLA)."""
        def empty(dim: int) -> torch.Tensor:
            return torch.empty(batch, kv_heads, capacity, dim, dtype=dtype, device=device)

        return cls([empty(head_dim) for _ in range(num_layers)],
                   [empty(value_dim or head_dim) for _ in range(num_layers)],
                   torch.zeros(batch, capacity, dtype=torch.bool, device=device))

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished sequences so they no longer cost compute."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.valid = self.valid.index_select(0, rows)


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); on CPU in fp32 through oneDNN (see the module docstring), elsewhere F.linear."""
    if _ONEDNN and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.numel():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's (and megatron's) non-interleaved RoPE on the first cos.shape[-1] dims of x; the rest pass through
    (partial rotary, `ModelArch.rotary_dim`)."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


class TPDecoder:
    """Forward pass of the whole model over one TP group, for prefill and decode steps."""

    def __init__(self, arch: ModelArch, tp_group: Any, tp_size: int, tp_rank: int) -> None:
        self.arch, self.tp_group, self.tp_size, self.tp_rank = arch, tp_group, tp_size, tp_rank
        self.q_heads = arch.num_heads // tp_size
        self.kv_heads = arch.num_kv_heads // tp_size
        inv_freq, self.rope_scaling = arch.rope_inv_freq()
        self.inv_freq = inv_freq.float()
        self.weights: dict[str, torch.Tensor] = {}
        # group rank holding TP slice j, when the slices are not in group-rank order (the hybrid engine's local
        # order for rollout TP > training TP, parallel/hybrid_engine/regroup.py); None: slice j on group rank j
        self.slice_owner: list[int] | None = None

    def allocate_cache(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        """The KV cache of one generate call: [batch, kv_heads / tg, capacity, head_dim] keys and values per layer."""
        return KVCache.allocate(self.arch.num_layers, batch, self.kv_heads, capacity, self.arch.head_dim, dtype,
                                device)

    # ---- weights --------------------------------------------------------------------------------
    def check_shard(self, shard: dict[str, torch.Tensor]) -> None:
        """Raise a clear error unless `shard` is exactly this rank's TP slice of every parameter."""
        emb = shard.get("embedding.word_embeddings.weight")
        if emb is None:
            raise KeyError("generation shard has no 'embedding.word_embeddings.weight'; pass the full "
                           "{megatron name (global layer index) -> TP slice} dict from the resharder")
        vocab_local = emb.shape[0]
        if vocab_local * self.tp_size < self.arch.vocab_size:
            raise ValueError(f"generation shard: embedding rows {vocab_local} x TP {self.tp_size} < "
                             f"vocab_size {self.arch.vocab_size}; was it resharded to rollout TP={self.tp_size}?")
        want = get_family(self.arch.family).local_shapes(self.arch, self.tp_size, vocab_local * self.tp_size)
        missing = sorted(set(want) - set(shard))
        extra = sorted(set(shard) - set(want))
        if missing or extra:
            raise KeyError(f"generation shard does not match the model (TP={self.tp_size}, "
                           f"{self.arch.num_layers} layers): missing {missing[:6]}, unexpected {extra[:6]}")
        for name, shape in want.items():
            if tuple(shard[name].shape) != shape:
                raise ValueError(f"generation shard[{name!r}] has shape {tuple(shard[name].shape)}, expected "
                                 f"{shape} for rollout TP={self.tp_size}; was it resharded to rollout TP={self.tp_size}?")

    def vocab_range(self) -> tuple[int, int]:
        rows = self.weights["embedding.word_embeddings.weight"].shape[0]
        return self.tp_rank * rows, (self.tp_rank + 1) * rows

    # ---- collectives ----------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            x = x.contiguous()
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.tp_group)
        if self.slice_owner is not None:
            parts = [parts[i] for i in self.slice_owner]
        return torch.cat(parts, dim=-1)

    # ---- model ----------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids in its row range, zeros elsewhere, then sum."""
        start, end = self.vocab_range()
        outside = (input_ids < start) | (input_ids >= end)
        local_ids = (input_ids - start).masked_fill(outside, 0)
        h = F.embedding(local_ids, self.weights["embedding.word_embeddings.weight"])
        return self.all_reduce(h.masked_fill(outside[..., None], 0.0))

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scaling).to(dtype), (emb.sin() * self.rope_scaling).to(dtype)

    def attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                  mask: torch.Tensor) -> torch.Tensor:
        p = f"decoder.layers.{i}.self_attention."
        N, S, _ = x.shape
        hd, group = self.arch.head_dim, self.arch.heads_per_group
        qkv = linear(x, self.weights[p + "linear_qkv.weight"], self.weights.get(p + "linear_qkv.bias"))
        # rows per KV group: [group q heads | k | v] (megatron's interleaved GQA layout)
        qkv = qkv.view(N, S, self.kv_heads, group + 2, hd)
        q = qkv[:, :, :, :group].reshape(N, S, self.q_heads, hd).transpose(1, 2)
        k = qkv[:, :, :, group].transpose(1, 2)
        v = qkv[:, :, :, group + 1].transpose(1, 2)
        if p + "q_layernorm.weight" in self.weights:  # Qwen3: RMSNorm over each head's q and k, before RoPE
            eps = self.arch.rms_norm_eps
            q = rms_norm(q, self.weights[p + "q_layernorm.weight"], eps)
            k = rms_norm(k, self.weights[p + "k_layernorm.weight"], eps)
        q, k = rope_rotate(q, cos[:, None], sin[:, None]), rope_rotate(k, cos[:, None], sin[:, None])
        start, end = cache.length, cache.length + S
        cache.keys[i][:, :, start:end] = k
        cache.values[i][:, :, start:end] = v
        out = F.scaled_dot_product_attention(q, cache.keys[i][:, :, :end], cache.values[i][:, :, :end],
                                             attn_mask=mask, enable_gqa=self.q_heads != self.kv_heads)
        out = out.transpose(1, 2).reshape(N, S, self.q_heads * hd)
        return self.all_reduce(linear(out, self.weights[p + "linear_proj.weight"]))

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"decoder.layers.{i}.mlp."
        gate, up = linear(x, self.weights[p + "linear_fc1.weight"]).chunk(2, dim=-1)
        return self.all_reduce(linear(F.silu(gate) * up, self.weights[p + "linear_fc2.weight"]))

    def attention_mask(self, cache: KVCache, new_tokens: int) -> torch.Tensor:
        """[N, 1, S, L] bool: query slot q sees key slot k iff k <= q and k holds a real token.

        A padding query may always see itself, so no row is fully masked (SDPA would give NaN);
        its output is never read by a real token.
        """
        start, end = cache.length, cache.length + new_tokens
        q_slot = torch.arange(start, end, device=cache.valid.device)[:, None]
        k_slot = torch.arange(end, device=cache.valid.device)[None, :]
        visible = (k_slot <= q_slot)[None] & (cache.valid[:, None, :end] | (k_slot == q_slot)[None])
        return visible[:, None]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run `input_ids` [N, S] (slots cache.length .. +S, already marked in cache.valid) through
        the model, extend the cache, and return float32 logits of the LAST position [N, vocab_size]."""
        w = self.weights
        eps = self.arch.rms_norm_eps
        h = self.embed(input_ids)
        cos, sin = self.rope(position_ids, h.dtype)
        mask = self.attention_mask(cache, input_ids.shape[1])
        for i in range(self.arch.num_layers):
            p = f"decoder.layers.{i}."
            h = h + self.attention(i, rms_norm(h, w[p + "input_layernorm.weight"], eps), cos, sin, cache, mask)
            h = h + self.mlp(i, rms_norm(h, w[p + "pre_mlp_layernorm.weight"], eps))
        cache.length += input_ids.shape[1]
        last = rms_norm(h[:, -1], w["decoder.final_layernorm.weight"], eps)
        head = w.get("output_layer.weight", w["embedding.word_embeddings.weight"])
        logits = self.all_gather_last_dim(linear(last, head).float())
        return logits[:, : self.arch.vocab_size]  # padded vocab ids can never be sampled
