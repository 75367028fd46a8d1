"""Mixture-of-Experts and Multi-head Latent Attention layers for the embedded rollout engine (`MoEDecoder`).

`MoEDecoder` is `TPDecoder` (engine/rollout/tp_decoder.py) with two layer kinds swapped in where the model has them;
embedding, norms, dense MLPs, the LM head and the sampling loop are the dense decoder's.

Sharding at rollout TP = tg (decided here, documented in docs/rollout.md): every rollout TP rank holds EVERY expert,
each cut like a dense MLP (linear_fc1 [gate; up] halves chunked over tg, linear_fc2 chunked along its input dim):
SGLang's TP-only MoE (`--tp N` without `--ep`). It is the hybrid engine's zero-redundancy rule applied to expert
rows: rank j of the rollout TP group receives TP slice j of every tensor and nothing else, whatever the training
EP / expert-TP layout was, so the generation shard is 1/tg of the model on every rank. The router, its expert bias,
the shared-expert gate and the latent norms are replicated; every rank routes the same tokens the same way (the
hidden state is replicated after each all-reduce), computes its slice of every selected expert and of the shared
expert, and ONE all-reduce per MoE layer sums the partial outputs.

Router arithmetic is megatron's own function (`topk_routing_with_score_function`: softmax / sigmoid, pre-softmax,
expert bias for selection only, group-limited top-k, top-k scaling), fed fp32 logits as megatron's
moe_router_dtype="fp32" does; the shared expert's sigmoid gate multiplies its output (megatron's SharedExpertMLP).

MLA (DeepSeek-V2/V3): q = up(norm(down(x))) (or a direct projection without q_lora), the compressed kv latent
c = norm(kv_down(x)[:kv_lora]) and the decoupled RoPE key k_rot = rope(kv_down(x)[kv_lora:]) shared by all heads.
The KV cache stores the latent and k_rot (kv_lora + rope numbers per token per layer, replicated over TP, as HF
and SGLang cache them); each step expands cached latents to this rank's heads with linear_kv_up_proj ([k_nope; v]
per head). RoPE pairs interleaved dims (x0, x1), (x2, x3), ... (HF rope_interleave=True, megatron's MLA rope), with
HF's frequencies and attention scaling (`ModelArch.rope_inv_freq`, YaRN included) and HF's softmax scale.
The down projections may arrive split over TP (megatron's local spec makes them column-parallel): a partial
output is all-gathered along its last dim.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tripod.engine.rollout.tp_decoder import KVCache, TPDecoder, linear, rms_norm
from tripod.parallel.arch import ModelArch
from tripod.parallel.moe_arch import MoEArch


def route(logits: torch.Tensor, moe: MoEArch, expert_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E] fp32, routing map [T, E] bool) of fp32 router logits [T, E], as megatron's TopKRouter."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    return topk_routing_with_score_function(
        logits.float(), moe.topk, use_pre_softmax=moe.pre_softmax, num_groups=moe.num_groups,
        group_topk=moe.group_topk, scaling_factor=moe.topk_scaling_factor, score_function=moe.score_function,
        expert_bias=None if expert_bias is None else expert_bias.float())


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs; `cos`/`sin` are cat(freqs, freqs) broadcastable to x (first half used)."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MoEDecoder(TPDecoder):
    """TPDecoder with routed-expert MLPs on MoE layers and/or multi-head latent attention."""

    def __init__(self, arch: ModelArch, tp_group: Any, tp_size: int, tp_rank: int) -> None:
        super().__init__(arch, tp_group, tp_size, tp_rank)
        self.moe, self.mla = arch.moe, arch.mla
        # a list: each MoE layer's expert ids [N, S, k] of every forward are appended (engine/rollout/routing_record.py)
        self.routing_log: list[torch.Tensor] | None = None
        self.softmax_scale = None
        if self.mla is not None:  # RoPE (incl. YaRN) over the qk_rope_head_dim dims: ModelArch.head_dim is that
            from tripod.parallel.families.deepseek import softmax_scale

            if arch.head_dim != self.mla.qk_rope_head_dim:
                raise ValueError(f"ModelArch.head_dim={arch.head_dim} must be qk_rope_head_dim="
                                 f"{self.mla.qk_rope_head_dim} for an MLA model (parallel/arch.py)")
            self.softmax_scale = softmax_scale(arch)  # HF's: 1/sqrt(nope + rope dims), x YaRN mscale^2

    # ---- KV cache -------------------------------------------------------------------------------
    def allocate_cache(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        """MLA: per layer the normalised latent [N, 1, T, kv_lora] ("keys") and the roped k_rot [N, 1, T, rope]
        ("values"); dense attention: the TPDecoder's per-head cache."""
        if self.mla is None:
            return super().allocate_cache(batch, capacity, dtype, device)
        return KVCache.allocate(self.arch.num_layers, batch, 1, capacity, self.mla.kv_lora_rank, dtype, device,
                                value_dim=self.mla.qk_rope_head_dim)

    # ---- layers ---------------------------------------------------------------------------------
    def _down(self, x: torch.Tensor, name: str, full: int) -> torch.Tensor:
        """A down projection whose output rows may be split over TP: gather the full output."""
        y = linear(x, self.weights[name])
        return y if y.shape[-1] == full else self.all_gather_last_dim(y)

    def attention(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                  mask: torch.Tensor) -> torch.Tensor:
        if self.mla is None:
            return super().attention(i, x, cos, sin, cache, mask)
        m, w, eps = self.mla, self.weights, self.arch.rms_norm_eps
        p = f"decoder.layers.{i}.self_attention."
        N, S, _ = x.shape
        nope, rope, vd, heads = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, self.q_heads
        if m.q_lora_rank:
            q_lat = rms_norm(self._down(x, p + "linear_q_down_proj.weight", m.q_lora_rank),
                             w[p + "q_layernorm.weight"], eps)
            q = linear(q_lat, w[p + "linear_q_up_proj.weight"])
        else:
            q = linear(x, w[p + "linear_q_proj.weight"])
        q_nope, q_rot = q.view(N, S, heads, nope + rope).transpose(1, 2).split([nope, rope], dim=-1)
        latent, k_rot = self._down(x, p + "linear_kv_down_proj.weight", m.kv_lora_rank + rope).split(
            [m.kv_lora_rank, rope], dim=-1)
        cos, sin = cos[:, None], sin[:, None]
        q_rot = rope_interleaved(q_rot, cos, sin)
        start, end = cache.length, cache.length + S
        cache.keys[i][:, 0, start:end] = rms_norm(latent, w[p + "kv_layernorm.weight"], eps)
        cache.values[i][:, 0, start:end] = rope_interleaved(k_rot[:, None], cos, sin)[:, 0]
        kv = linear(cache.keys[i][:, 0, :end], w[p + "linear_kv_up_proj.weight"])
        k_nope, v = kv.view(N, end, heads, nope + vd).transpose(1, 2).split([nope, vd], dim=-1)
        k = torch.cat([k_nope, cache.values[i][:, :, :end].expand(-1, heads, -1, -1)], dim=-1)
        out = F.scaled_dot_product_attention(torch.cat([q_nope, q_rot], dim=-1), k, v, attn_mask=mask,
                                             scale=self.softmax_scale)
        out = out.transpose(1, 2).reshape(N, S, heads * vd)
        return self.all_reduce(linear(out, w[p + "linear_proj.weight"]))

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"decoder.layers.{i}.mlp."
        w = self.weights
        if p + "router.weight" not in w:
            return super().mlp(i, x)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs, routing_map = route(linear(tokens.float(), w[p + "router.weight"].float()), self.moe,
                                   w.get(p + "router.expert_bias"))
        if self.routing_log is not None:
            from tripod.engine.rollout.routing_record import topk_ids

            self.routing_log.append(topk_ids(routing_map, self.moe.topk).view(*shape[:-1], self.moe.topk))
        out = torch.zeros_like(tokens)
        for e in routing_map.any(0).nonzero().flatten().tolist():
            rows = routing_map[:, e].nonzero().flatten()
            q = p + f"experts.local_experts.{e}."
            gate, up = linear(tokens[rows], w[q + "linear_fc1.weight"]).chunk(2, dim=-1)
            y = linear(F.silu(gate) * up, w[q + "linear_fc2.weight"])
            out.index_add_(0, rows, y * probs[rows, e, None].to(y.dtype))
        if p + "shared_experts.linear_fc1.weight" in w:
            gate, up = linear(tokens, w[p + "shared_experts.linear_fc1.weight"]).chunk(2, dim=-1)
            shared = linear(F.silu(gate) * up, w[p + "shared_experts.linear_fc2.weight"])
            if p + "shared_experts.gate_weight" in w:  # a scalar per token: scaling the TP partial sums is exact
                shared = shared * torch.sigmoid(linear(tokens, w[p + "shared_experts.gate_weight"]))
            out = out + shared
        return self.all_reduce(out).view(shape)
