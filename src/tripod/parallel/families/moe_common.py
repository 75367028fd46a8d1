"""Rows and hooks shared by the Mixture-of-Experts families (qwen3_moe.py, qwen2_moe.py, deepseek.py).

Owns the HF <-> megatron names of a routed-expert MLP (router, expert bias buffer, per-expert SwiGLU, shared
experts), the megatron decoder block spec of MoE / MLA models (dense and MoE layers mixed as HF mixes them) and
the TransformerConfig fields an MoE family adds. Which router settings reproduce HF exactly is
parallel/moe_arch.py's business; the CPU workarounds for megatron without Transformer Engine are
parallel/megatron_patches/cpu_compat.py's.

Megatron side (local spec, `SequentialMLP`, grouped GEMM off), per MoE layer i:
  mlp.router.weight [E, H] and mlp.router.expert_bias [E] (a persistent fp32 buffer) -- replicated;
  mlp.experts.local_experts.{e}.linear_fc1.weight [2I, H] = [gate; up] (GATED_ROW over expert-TP),
  mlp.experts.local_experts.{e}.linear_fc2.weight [H, I] (COL over expert-TP);
  mlp.shared_experts.linear_fc1/fc2.weight (split over TP like a dense MLP), mlp.shared_experts.gate_weight [1, H].
HF side: `mlp.experts.{e}.{gate,up,down}_proj.weight` (what save_pretrained writes; transformers-5's in-memory
fused `mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] are read by parallel/convert/common.py).
"""
from __future__ import annotations

from typing import Any

from tripod.parallel.arch import ModelArch
from tripod.parallel.families.spec import Fuse, Layers, Split, Weight
from tripod.parallel.moe_arch import megatron_mla_fields, megatron_moe_fields

EXPERT_FC1 = "mlp.experts.local_experts.{e}.linear_fc1.weight"
EXPERT_FC2 = "mlp.experts.local_experts.{e}.linear_fc2.weight"


def _moe(a: ModelArch):
    return a.moe


def routed_expert_weights(arch: ModelArch, *, shared_hf: str | None = None,
                          shared_gate_hf: str | None = None) -> list[Weight]:
    """The MoE-layer rows: router (+ expert bias), routed experts, optional shared expert (+ its gate).

    `shared_hf`: HF prefix of the shared expert MLP inside the layer (`mlp.shared_expert.` for Qwen2-MoE,
    `mlp.shared_experts.` for DeepSeek); `shared_gate_hf`: HF name of its sigmoid gate (Qwen2-MoE).
    """
    moe = arch.moe
    rows = [Weight("mlp.router.weight", ("mlp.gate.weight",), lambda a: (_moe(a).num_experts, a.hidden_size),
                   Split.REPLICATED, layers=Layers.MOE)]
    if moe.expert_bias:
        rows.append(Weight("mlp.router.expert_bias", ("mlp.gate.e_score_correction_bias",),
                           lambda a: (_moe(a).num_experts,), Split.REPLICATED, layers=Layers.MOE, fp32=True))
    rows += [
        Weight(EXPERT_FC1, ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
               lambda a: (2 * _moe(a).expert_ffn_hidden_size, a.hidden_size), Split.GATED_ROW, Fuse.CONCAT,
               per_expert=True, layers=Layers.MOE),
        Weight(EXPERT_FC2, ("mlp.experts.{e}.down_proj.weight",),
               lambda a: (a.hidden_size, _moe(a).expert_ffn_hidden_size), Split.COL, per_expert=True,
               layers=Layers.MOE),
    ]
    if moe.shared_expert_ffn_hidden_size:
        if shared_hf is None:
            raise ValueError(f"{arch.family}: the config has a shared expert but the family names none")
        rows += [
            Weight("mlp.shared_experts.linear_fc1.weight",
                   (shared_hf + "gate_proj.weight", shared_hf + "up_proj.weight"),
                   lambda a: (2 * _moe(a).shared_expert_ffn_hidden_size, a.hidden_size), Split.GATED_ROW,
                   Fuse.CONCAT, layers=Layers.MOE),
            Weight("mlp.shared_experts.linear_fc2.weight", (shared_hf + "down_proj.weight",),
                   lambda a: (a.hidden_size, _moe(a).shared_expert_ffn_hidden_size), Split.COL, layers=Layers.MOE),
        ]
    if moe.shared_expert_gate:
        rows.append(Weight("mlp.shared_experts.gate_weight", (shared_gate_hf,), lambda a: (1, a.hidden_size),
                           Split.REPLICATED, layers=Layers.MOE))
    return rows


def moe_block_spec(arch: ModelArch, use_te: bool, config: Any, vp_stage: int | None = None) -> Any:
    """megatron's decoder block spec for this rank's layers: dense / MoE per `config.moe_layer_freq`, MLA when
    `arch.mla` (local core attention patched for MLA's extra kwargs when Transformer Engine is absent)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from tripod.parallel.megatron_patches.cpu_compat import apply_no_te_fixes, mla_local_core_attention

    apply_no_te_fixes()
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                      vp_stage=vp_stage)
    if arch.mla is not None and not use_te:
        mla_local_core_attention(spec)
    return spec


def moe_megatron_fields(arch: ModelArch) -> dict[str, Any]:
    """TransformerConfig fields of an MoE / MLA model (HF-exact routing, expert bias frozen; the trainer overrides
    moe_router_load_balancing_type / moe_aux_loss_coeff / moe_router_bias_update_rate through build_gpt_model)."""
    fields = megatron_moe_fields(arch.moe) if arch.moe is not None else {}
    if arch.mla is not None:
        fields.update(megatron_mla_fields(arch.mla))
    return fields


def check_moe_supported(arch: ModelArch) -> None:
    """Refusals common to the MoE families (one clear line each)."""
    if arch.moe is None:
        raise ValueError(f"{arch.family}: config.json has no routed experts (num_experts / n_routed_experts)")
    if arch.moe.topk > arch.moe.num_experts:
        raise ValueError(f"config.json num_experts_per_tok={arch.moe.topk} > the {arch.moe.num_experts} experts")
