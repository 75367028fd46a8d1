"""Megatron GPTModel built from a `ModelArch` (Llama / Qwen2 / Qwen3, the MoE / MLA families) for one `ParallelLayout`.

Owns: the TransformerConfig mapping (RMSNorm, SwiGLU, RoPE, GQA, QKV bias, tied embeddings,
sequence parallel, virtual pipeline stages), megatron-style vocab padding, the critic's scalar value
head and the explicit causal attention mask used on CPU. The layer spec comes from the model family
(parallel/families/). Running the model is parallel/pipeline.py's job.

Shapes: the actor's GPTModel returns [b, s, V_pad / tp] logits (vocab-parallel) on the last stage.
A critic (`value_head=True`) returns [b, s, 1] float values on the last stage (the output layer is
replaced by `ValueHead`); so does a reward model (`arch.score_head`), whose head is HF's bias-free `score.weight`.
With `virtual_pipeline_model_parallel_size=v`, `build_model_chunks` gives
each rank v chunks (megatron's interleaved layout: chunk c of PP rank r holds the layers of virtual
stage c * pp + r). A layout with uneven stages (`first_stage_layers` / `last_stage_layers`) sets megatron's
num_layers_in_first/last_pipeline_stage; megatron then builds each stage's layers (parallel/stages.py).
RoPE uses the HF definition (`arch.rope_inv_freq()`), so llama3 / linear scaling match
`transformers` exactly (with MLA the rotary embedding lives in every layer's attention and each gets it).
MoE / MLA models take their extra TransformerConfig fields from the family (`FamilySpec.megatron_fields`: HF-exact
routing with load balancing off and the expert bias frozen) and their decoder block spec from
`FamilySpec.block_spec`; config overrides (moe_router_load_balancing_type, moe_aux_loss_coeff,
moe_router_bias_update_rate, ...) replace those fields. Experts are split over the layout's expert groups
(expert_model_parallel_size = layout.ep, expert_tensor_parallel_size = layout.etp). megatron refuses to train an
MoE layer with tensor parallelism but without sequence parallelism, so MoE models at tp > 1 always run with it.
Caveat: megatron's rotary embedding takes positions 0..s-1 and ignores
`position_ids`; left-padded batches must be handled by the caller (e.g. right padding).
`packed_seq_params` turns a THD-packed micro-batch (engine/workers/packing.py) into megatron's PackedSeqParams for
Transformer Engine models.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from tripod.parallel.arch import ModelArch
from tripod.parallel.convert import padded_vocab_size
from tripod.parallel.families import get_family
from tripod.parallel.layout import ParallelLayout
from tripod.parallel.megatron_patches import transformer_engine_installed

USE_TE_CHOICES = ("auto", "true", "false")


def uses_transformer_engine() -> bool:
    """Whether models are built with Transformer Engine layer specs: TE installed (megatron_patches) and CUDA."""
    return transformer_engine_installed() and torch.cuda.is_available()


def resolve_use_te(setting: str | bool, arch: ModelArch, key: str = "megatron.use_te") -> bool:
    """`megatron.use_te` -> whether this model is built with megatron's Transformer Engine layer spec.

    auto: when TE imports and CUDA is visible, except for MLA models (TE's spec replicates MLA's down projections,
    which the family table splits over TP; they keep the local spec). true: TE, or one clear line saying why not.
    false: the local (torch) spec: SDPA attention and the local norms (parallel/megatron_patches/cpu_compat.py's no-TE fixes)."""
    value = str(setting).strip().lower()
    if value not in USE_TE_CHOICES:
        raise ValueError(f"{key}={setting!r} must be one of {', '.join(USE_TE_CHOICES)}")
    if value == "false":
        return False
    if value == "true":
        if not uses_transformer_engine():
            why = "is not importable" if torch.cuda.is_available() else "needs CUDA, and this torch sees no GPU"
            raise ValueError(f"{key}=true but Transformer Engine {why}; install transformer_engine on a CUDA "
                             "machine or set it to auto/false")
        if arch.mla is not None:
            raise ValueError(f"{key}=true: {arch.family} uses MLA, whose down projections TE's spec replicates "
                             "while tripod's table splits them over TP; set it to auto or false")
        return True
    return uses_transformer_engine() and arch.mla is None


def transformer_config_from_arch(arch: ModelArch, layout: ParallelLayout, *,
                                 params_dtype: torch.dtype = torch.float32,
                                 sequence_parallel: bool = False, **overrides: Any):
    """megatron TransformerConfig for `arch` sharded by `layout`; `overrides` set any config field."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from tripod.parallel.families.spec import check_tp_size

    layout.validate_for(arch)
    family = get_family(arch.family)
    if arch.mla is not None:
        check_tp_size(arch, layout.tp)  # MLA's down projections split over TP as well
    if arch.moe is not None and arch.moe.expert_ffn_hidden_size % layout.etp:
        ffn = arch.moe.expert_ffn_hidden_size
        raise ValueError(f"{layout.name} expert_tensor_parallel_size={layout.etp} does not divide "
                         f"moe_intermediate_size={ffn}; use one of {[d for d in range(1, ffn + 1) if ffn % d == 0]}")
    if arch.moe is not None and any(arch.moe.layer_is_moe) and layout.tp > 1:
        sequence_parallel = True  # megatron: MoE + TP trains only with SP (moe_layer.py)
    if sequence_parallel and layout.tp == 1:
        sequence_parallel = False  # megatron requires tp > 1 for SP; it is a no-op at tp=1
    fields = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        sequence_parallel=sequence_parallel,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
    )
    fields.update(layout.stage_split(arch.num_layers).config_fields())  # uneven first / last stage (megatron's)
    if arch.moe is not None:
        fields.update(expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp)
    if family.megatron_fields is not None:
        fields.update(family.megatron_fields(arch))
    config_class = MLATransformerConfig if arch.mla is not None else TransformerConfig
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"transformer_config_from_arch: unknown TransformerConfig fields {unknown}")
    fields.update(overrides)
    return config_class(**fields)


class ValueHead(torch.nn.Module):
    """Critic head replacing GPTModel.output_layer: hidden [s, b, h] -> values [s, b, 1].

    The weight is replicated over TP (every TP rank sees the full hidden state, so the grads are
    identical and need no TP all-reduce); with sequence parallel the hidden state is gathered first and
    its gradient split back (not summed: every TP rank computed the same full gradient).
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool, tp_group,
                 seed: int = 1234, device: torch.device | str = "cpu", bias: bool = True) -> None:
        super().__init__()
        # same init on every rank (TP and DP replicas must agree), independent of the global RNG: drawn on the host,
        # then placed on the device the rest of the model lives on
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=generator).to(dtype) * hidden_size ** -0.5
        self.weight = torch.nn.Parameter(weight.to(device))
        # a reward model's head is HF's `score` Linear, which has no bias
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device)) if bias else None
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        return F.linear(hidden, self.weight, self.bias), None


def model_layer_spec(arch: ModelArch, use_te: bool, config, vp_stage: int | None = None, sdpa: bool = True,
                     cp: int = 1):
    """The family's layer spec (or decoder block spec) for `config`. The local spec first gets parallel/megatron_patches/cpu_compat.py's
    no-TE fixes, on CPU and GPU alike: its norm (WrappedTorchNorm) refuses sequence parallelism otherwise, and every
    MoE model at TP > 1 runs with it. `sdpa` (default, every device): the local spec's core attention of non-MLA
    layers runs PyTorch SDPA (parallel/sdpa_attention.py); False keeps megatron's DotProductAttention (tests compare
    against it); MLA layers keep megatron's either way. `cp` > 1: that core attention is wrapped in context
    parallelism's K / V all-gather (parallel/context_parallel.py)."""
    family = get_family(arch.family)
    if not use_te:
        from tripod.parallel.megatron_patches.cpu_compat import apply_no_te_fixes
        apply_no_te_fixes()
    spec = family.block_spec(arch, use_te, config, vp_stage) if family.block_spec is not None else \
        family.layer_spec(arch, use_te)
    if sdpa and not use_te:
        from tripod.parallel.sdpa_attention import use_sdpa_core_attention
        use_sdpa_core_attention(spec)
    if cp > 1:
        from tripod.parallel.context_parallel import use_cp_core_attention
        use_cp_core_attention(spec)
    return spec


def build_model_chunks(arch: ModelArch, layout: ParallelLayout, *, virtual_pipeline_size: int | None = None,
                       **kwargs: Any) -> list:
    """This rank's model chunks: one GPTModel, or one per virtual pipeline stage (`virtual_pipeline_size` > 1).

    `kwargs` go to `build_gpt_model` (value_head, params_dtype, sequence_parallel, seed, config overrides).
    """
    vpp = virtual_pipeline_size if virtual_pipeline_size and virtual_pipeline_size > 1 else None
    if vpp is None:
        return [build_gpt_model(arch, layout, **kwargs)]
    if layout.pp < 2:
        raise ValueError(f"{layout.name} virtual_pipeline_model_parallel_size={vpp} needs "
                         f"pipeline_model_parallel_size > 1 (is {layout.pp}); unset it or change the layout")
    layout.stage_split(arch.num_layers, vpp).check(layout.name)
    return [build_gpt_model(arch, layout, vp_stage=v, virtual_pipeline_size=vpp, **kwargs) for v in range(vpp)]


def build_gpt_model(arch: ModelArch, layout: ParallelLayout, *, value_head: bool = False,
                    params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                    seed: int = 1234, vp_stage: int | None = None, virtual_pipeline_size: int | None = None,
                    use_te: str | bool = "auto", sdpa: bool = True, **config_overrides: Any):
    """A megatron GPTModel (this rank's TP shard of its PP stage, or of virtual stage `vp_stage`).

    Weights are megatron's random init; load real ones with parallel.convert.load_hf_weights.
    `value_head=True` builds the critic (last stage outputs [b, s] values, untied output). A reward model's arch
    (`arch.score_head`, HF *ForSequenceClassification) always gets the scalar head, without a bias like HF's `score`.
    `use_te`: `megatron.use_te` (auto | true | false, `resolve_use_te`); `model.tripod_use_te` records the outcome.
    `sdpa`: the local spec's core attention of non-MLA layers is PyTorch SDPA on every device (`model_layer_spec`);
    False builds megatron's own DotProductAttention instead (what tests compare it against; not a config key).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    layout.validate_for(arch)
    value_head = value_head or arch.score_head
    inv_freq, attention_scaling = arch.rope_inv_freq()
    if abs(attention_scaling - 1.0) > 1e-12:
        raise ValueError(f"rope_parameters.rope_type={arch.rope_parameters.get('rope_type')!r} scales attention "
                         f"by {attention_scaling}; megatron's RotaryEmbedding cannot; use default/linear/llama3 RoPE")
    if virtual_pipeline_size:
        config_overrides["virtual_pipeline_model_parallel_size"] = virtual_pipeline_size
    from tripod.parallel.context_parallel import check_cp_model
    check_cp_model(layout.name, layout.cp, arch, str(use_te).strip().lower() == "true")
    use_te = resolve_use_te(use_te, arch)
    te_cp = use_te and layout.cp > 1  # TE's own CP attention (ring by default); else tripod's all-gather CP
    if te_cp:
        config_overrides = {"context_parallel_size": layout.cp, "cp_comm_type": "p2p", **config_overrides}
    config = transformer_config_from_arch(arch, layout, params_dtype=params_dtype,
                                          sequence_parallel=sequence_parallel, **config_overrides)
    vpp = virtual_pipeline_size or 1
    first = layout.is_first_stage and (vp_stage or 0) == 0
    last = layout.is_last_stage and (vp_stage or 0) == vpp - 1
    with layout.activate():
        layer_spec = model_layer_spec(arch, use_te, config, vp_stage, sdpa=sdpa, cp=1 if te_cp else layout.cp)
        model_parallel_cuda_manual_seed(seed, tp_rank=layout.tp_rank, ep_rank=layout.ep_rank,
                                        etp_rank=layout.etp_rank)
        model = GPTModel(
            config=config, transformer_layer_spec=layer_spec,
            vocab_size=padded_vocab_size(arch.vocab_size, layout.tp),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=first, post_process=last, vp_stage=vp_stage,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings and not value_head,
            position_embedding_type="rope", rotary_base=int(arch.rope_theta),
            rotary_percent=arch.partial_rotary_factor,
            pg_collection=layout.pg_collection,
        )
    # HF defines RoPE (incl. llama3 / linear scaling); megatron's own scaling is not the same code. Every module
    # tripod adds or replaces goes on the device megatron built the model on (its RoPE computes where inv_freq is).
    device = _init_device(config)
    if arch.mla is None:
        model.rotary_pos_emb.inv_freq = inv_freq.to(device, torch.float32)
    else:  # MLA: one rotary embedding per layer, over the qk_rope_head_dim dims (arch.head_dim)
        for layer in model.decoder.layers:
            layer.self_attention.rotary_pos_emb.inv_freq = inv_freq.to(device, torch.float32)
    if layout.cp > 1 and not te_cp:  # a CP rank's slots are not 0..s-1: RoPE takes each slot's global position
        from tripod.parallel.megatron_patches.gpt_model import rope_with_slot_positions
        rope_with_slot_positions(model)
    model.tripod_arch = arch
    model.tripod_value_head = value_head
    model.tripod_use_te = use_te
    if value_head and last:
        model.output_layer = ValueHead(arch.hidden_size, params_dtype, config.sequence_parallel,
                                       layout.tp_group, seed, device=device, bias=not arch.score_head)
    # megatron's local-spec norm (WrappedTorchNorm = torch.nn.RMSNorm) ignores the init device and lands on the host;
    # Megatron-LM moves the whole model with .cuda() after building it, and so does this
    model.to(device)
    return model


def packed_seq_params(packed: Any, use_te: bool):
    """megatron's `PackedSeqParams` (qkv_format "thd", cu_seqlens_q = cu_seqlens_kv, max_seqlen_q/kv) for a micro-batch
    laid out by engine/workers/packing.py's `pack_thd` (it carries `cu_seqlens`), when the model is built with
    Transformer Engine's spec (`use_te`: `model.tripod_use_te`), the only attention that reads them; None otherwise
    (the local spec takes the explicit block-diagonal mask). Unrun here: no GPU, no TE (CPU unit test only)."""
    cu = getattr(packed, "cu_seqlens", None)
    if cu is None or not use_te:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = cu.to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def _init_device(config) -> torch.device:
    """Where megatron allocated the model: the host with use_cpu_initialization, else the current CUDA device."""
    return torch.device("cpu") if config.use_cpu_initialization else torch.device(torch.cuda.current_device())


def causal_attention_mask(seq_len: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Megatron boolean mask (True = masked): [1, 1, s, s] causal, or [b, 1, s, s] when an HF-style
    [b, s] padding mask (1 = real token) is given. Built on CPU (megatron's default is CUDA-only)."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)[None, None]
    if attention_mask is None:
        return causal
    keys_padded = (attention_mask == 0)[:, None, None, :]
    return causal | keys_padded
