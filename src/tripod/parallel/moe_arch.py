"""Mixture-of-Experts and Multi-head Latent Attention as tripod reads them from a Hugging Face config.

Owns the parsing of the MoE / MLA parts of `config.json` for Qwen3-MoE, Qwen2-MoE, DeepSeek-V3 and DeepSeek-V2
into two typed records (`MoEArch`, `MLAArch`), the refusal of routers megatron-core cannot reproduce exactly,
and the matching megatron `TransformerConfig` fields. Dense parts (attention heads, norms, RoPE) stay in
`tripod.parallel.arch`. The router equivalences below were checked against transformers' routers (logits equal
HF's to ~6e-7; tests/multiprocess/workers/moe_parity_worker.py holds whole models to HF's logits):

  HF router                                        megatron-core 0.16.1
  softmax, top-k, renormalise (norm_topk_prob)     score_function=softmax, pre_softmax=False (top-k, softmax)
  softmax, top-k, no renormalisation               score_function=softmax, pre_softmax=True
  sigmoid (+ e_score_correction_bias for choice),  score_function=sigmoid, enable_expert_bias (a buffer, update
  top-k, renormalise, x routed_scaling_factor       rate 0 unless trained), topk_scaling_factor
  group score = sum of top-2 per group (V3)        num_groups/group_topk: sum of top-(topk/group_topk) -> equal
                                                   only when topk / topk_group == 2
  group score = max per group (V2 limited greedy)  equal only when topk / topk_group == 1
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "glm4_moe")


@dataclass(frozen=True)
class MoEArch:
    """The routed-expert MLP of an MoE model (per layer: MoE or dense, from `layer_is_moe`)."""

    num_experts: int
    topk: int
    expert_ffn_hidden_size: int
    layer_is_moe: tuple[bool, ...]
    score_function: str  # softmax | sigmoid
    pre_softmax: bool  # softmax over all experts before top-k (no renormalisation over the k)
    topk_scaling_factor: float | None
    shared_expert_ffn_hidden_size: int | None  # None: no shared expert
    shared_expert_gate: bool  # Qwen2-MoE: sigmoid gate on the shared expert's output
    expert_bias: bool  # DeepSeek-V3 e_score_correction_bias (a persistent buffer, selection only)
    num_groups: int | None  # group-limited routing (DeepSeek)
    group_topk: int | None


@dataclass(frozen=True)
class MLAArch:
    """DeepSeek's multi-head latent attention (low-rank q and kv projections, decoupled RoPE dims)."""

    q_lora_rank: int | None  # None: q is projected directly (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


def _refuse(model_type: str, key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json {key}={value!r} ({model_type}): {why}")


def _qwen_layers(cfg: dict, num_layers: int) -> tuple[bool, ...]:
    """HF Qwen MoE rule: layer i is MoE unless in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0."""
    dense = set(cfg.get("mlp_only_layers") or [])
    step = cfg.get("decoder_sparse_step", 1) or 1
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _deepseek_layers(cfg: dict, num_layers: int) -> tuple[bool, ...]:
    """HF DeepSeek rule (transformers 5): every layer from first_k_dense_replace on is MoE."""
    first = cfg.get("first_k_dense_replace", 0) or 0
    return tuple(i >= first for i in range(num_layers))


def moe_from_hf(cfg: dict) -> MoEArch | None:
    """The MoE record of an HF config dict, None for a dense model; ValueError for a router tripod cannot match."""
    model_type = cfg.get("model_type")
    if model_type not in MOE_MODEL_TYPES:
        return None
    layers = cfg["num_hidden_layers"]
    topk = cfg["num_experts_per_tok"]
    if model_type in ("qwen3_moe", "qwen2_moe"):
        norm = bool(cfg.get("norm_topk_prob", model_type == "qwen3_moe"))
        shared = cfg.get("shared_expert_intermediate_size") or None if model_type == "qwen2_moe" else None
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 writes the latter
        return MoEArch(num_experts=experts, topk=topk, expert_ffn_hidden_size=cfg["moe_intermediate_size"],
                       layer_is_moe=_qwen_layers(cfg, layers), score_function="softmax", pre_softmax=not norm,
                       topk_scaling_factor=None, shared_expert_ffn_hidden_size=shared,
                       shared_expert_gate=shared is not None, expert_bias=False, num_groups=None, group_topk=None)

    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")
    n_group, topk_group = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    n_shared = cfg.get("n_shared_experts") or 0
    common = dict(num_experts=experts, topk=topk, expert_ffn_hidden_size=cfg["moe_intermediate_size"],
                  layer_is_moe=_deepseek_layers(cfg, layers),
                  topk_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                  shared_expert_ffn_hidden_size=cfg["moe_intermediate_size"] * n_shared if n_shared else None,
                  shared_expert_gate=False)
    if model_type in ("deepseek_v3", "glm4_moe"):  # GLM-4.5's router is DeepSeek-V3's (HF Glm4MoeTopkRouter)
        if not cfg.get("norm_topk_prob", True) and topk > 1:
            raise _refuse(model_type, "norm_topk_prob", False, "megatron's sigmoid router always renormalises the "
                          "top-k weights, so logits cannot match; tripod supports norm_topk_prob=true")
        grouped = n_group > 1 and topk_group < n_group
        if grouped and topk != 2 * topk_group:
            raise _refuse(model_type, "topk_group", topk_group, f"HF scores a group by its top-2 experts, megatron "
                          f"by its top-(num_experts_per_tok/topk_group)={topk}/{topk_group}; they agree only when "
                          "num_experts_per_tok = 2 * topk_group")
        return MoEArch(score_function="sigmoid", pre_softmax=False, expert_bias=True,
                       num_groups=n_group if grouped else None, group_topk=topk_group if grouped else None, **common)
    method = cfg.get("topk_method", "greedy")
    grouped = method == "group_limited_greedy" and n_group > 1 and topk_group < n_group
    if method not in ("greedy", "group_limited_greedy"):
        raise _refuse(model_type, "topk_method", method, "tripod matches 'greedy' and 'group_limited_greedy' only")
    if grouped and topk != topk_group:
        raise _refuse(model_type, "topk_method", method, f"HF scores a group by its best expert (max), megatron by "
                      f"the sum of its top-(num_experts_per_tok/topk_group)={topk}/{topk_group}; they agree only "
                      "when num_experts_per_tok = topk_group")
    return MoEArch(score_function="softmax", pre_softmax=True, expert_bias=False,
                   num_groups=n_group if grouped else None, group_topk=topk_group if grouped else None, **common)


def mla_from_hf(cfg: dict) -> MLAArch | None:
    """The MLA record of a DeepSeek config dict, None for models with standard attention."""
    if cfg.get("model_type") not in ("deepseek_v3", "deepseek_v2") or not cfg.get("kv_lora_rank"):
        return None
    return MLAArch(q_lora_rank=cfg.get("q_lora_rank") or None, kv_lora_rank=cfg["kv_lora_rank"],
                   qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                   v_head_dim=cfg["v_head_dim"])


def megatron_moe_fields(moe: MoEArch, *, load_balancing: str = "none", aux_loss_coeff: float = 0.0,
                        bias_update_rate: float = 0.0) -> dict[str, Any]:
    """TransformerConfig fields for `moe` on megatron's local (non-TE) path, routed in fp32.

    `load_balancing` is megatron's moe_router_load_balancing_type (none | aux_loss | seq_aux_loss);
    `bias_update_rate` moves the expert bias in finalize_model_grads (0 keeps HF's bias fixed).
    """
    fields: dict[str, Any] = dict(
        num_moe_experts=moe.num_experts, moe_router_topk=moe.topk, moe_ffn_hidden_size=moe.expert_ffn_hidden_size,
        moe_layer_freq=[int(x) for x in moe.layer_is_moe], moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.pre_softmax, moe_router_topk_scaling_factor=moe.topk_scaling_factor,
        moe_router_dtype="fp32", moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        moe_router_load_balancing_type=load_balancing, moe_aux_loss_coeff=aux_loss_coeff,
        moe_router_num_groups=moe.num_groups, moe_router_group_topk=moe.group_topk,
    )
    if moe.shared_expert_ffn_hidden_size:
        fields.update(moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
                      moe_shared_expert_gate=moe.shared_expert_gate)
    if moe.expert_bias:
        fields.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=bias_update_rate)
    return fields


def megatron_mla_fields(mla: MLAArch) -> dict[str, Any]:
    """MLATransformerConfig fields: plain RoPE (the class defaults to YaRN x40), kv_channels = v_head_dim."""
    return dict(multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim,
                v_head_dim=mla.v_head_dim, kv_channels=mla.v_head_dim, qk_layernorm=True, rope_type="rope",
                rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
