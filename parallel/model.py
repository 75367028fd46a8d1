"""Megatron GPTModel built from a `ModelArch` (Llama / Qwen2) for one `ParallelLayout`.

Owns: the TransformerConfig mapping (RMSNorm, SwiGLU, RoPE, GQA, QKV bias, tied embeddings),
megatron-style vocab padding, the critic's scalar value head, the explicit causal attention mask
used on CPU, and `forward_logits`, a forward-only pass through the pipeline schedule.

Shapes: the actor's GPTModel returns [b, s, V_pad / tp] logits (vocab-parallel) on the last stage;
`forward_logits` gathers TP and strips the padding -> [b, s, V]. A critic (`value_head=True`)
returns [b, s, 1] float values on the last stage (the output layer is replaced by `ValueHead`);
`forward_logits` squeezes them to [b, s].
RoPE uses the HF definition (`arch.rope_inv_freq()`), so llama3 / linear scaling match
`transformers` exactly. Caveat: megatron's rotary embedding takes positions 0..s-1 and ignores
`position_ids`; left-padded batches must be handled by the caller (e.g. right padding).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F

from parallel.arch import ModelArch
from parallel.convert import padded_vocab_size, unwrap_model
from parallel.layout import ParallelLayout


def _transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def transformer_config_from_arch(arch: ModelArch, layout: ParallelLayout, *,
                                 params_dtype: torch.dtype = torch.float32,
                                 sequence_parallel: bool = False, **overrides: Any):
    """megatron TransformerConfig for `arch` sharded by `layout`; `overrides` set any config field."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout.validate_for(arch)
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
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"transformer_config_from_arch: unknown TransformerConfig fields {unknown}")
    fields.update(overrides)
    return TransformerConfig(**fields)


class ValueHead(torch.nn.Module):
    """Critic head replacing GPTModel.output_layer: hidden [s, b, h] -> values [s, b, 1].

    The weight is replicated over TP (every TP rank sees the full hidden state, so the grads are
    identical and need no TP all-reduce); with sequence parallel the hidden state is gathered first.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, sequence_parallel: bool, tp_group,
                 seed: int = 1234) -> None:
        super().__init__()
        # same init on every rank (TP and DP replicas must agree), independent of the global RNG
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(1, hidden_size, generator=generator).to(dtype) * hidden_size ** -0.5)
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, group=self.tp_group)
        return F.linear(hidden, self.weight, self.bias), None


def build_gpt_model(arch: ModelArch, layout: ParallelLayout, *, value_head: bool = False,
                    params_dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                    seed: int = 1234, **config_overrides: Any):
    """A megatron GPTModel (this rank's TP shard of its PP stage) for `arch` under `layout`.

    Weights are megatron's random init; load real ones with parallel.convert.load_hf_weights.
    `value_head=True` builds the critic (last stage outputs [b, s] values, untied output).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    layout.validate_for(arch)
    inv_freq, attention_scaling = arch.rope_inv_freq()
    if abs(attention_scaling - 1.0) > 1e-12:
        raise ValueError(f"rope_parameters.rope_type={arch.rope_parameters.get('rope_type')!r} scales attention "
                         f"by {attention_scaling}; megatron's RotaryEmbedding cannot; use default/linear/llama3 RoPE")
    config = transformer_config_from_arch(arch, layout, params_dtype=params_dtype,
                                          sequence_parallel=sequence_parallel, **config_overrides)
    if _transformer_engine_available():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        layer_spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    with layout.activate():
        model_parallel_cuda_manual_seed(seed, tp_rank=layout.tp_rank, ep_rank=0, etp_rank=layout.tp_rank)
        model = GPTModel(
            config=config, transformer_layer_spec=layer_spec,
            vocab_size=padded_vocab_size(arch.vocab_size, layout.tp),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=layout.is_first_stage, post_process=layout.is_last_stage,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings and not value_head,
            position_embedding_type="rope", rotary_base=int(arch.rope_theta),
            pg_collection=layout.pg_collection,
        )
    # HF defines RoPE (incl. llama3 / linear scaling); megatron's own scaling is not the same code
    model.rotary_pos_emb.inv_freq = inv_freq.to(torch.float32)
    model.tripod_arch = arch
    model.tripod_value_head = value_head
    if value_head and layout.is_last_stage:
        model.output_layer = ValueHead(arch.hidden_size, params_dtype, config.sequence_parallel,
                                       layout.tp_group, seed)
    return model


def causal_attention_mask(seq_len: int, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Megatron boolean mask (True = masked): [1, 1, s, s] causal, or [b, 1, s, s] when an HF-style
    [b, s] padding mask (1 = real token) is given. Built on CPU (megatron's default is CUDA-only)."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)[None, None]
    if attention_mask is None:
        return causal
    keys_padded = (attention_mask == 0)[:, None, None, :]
    return causal | keys_padded


def run_forward_only(model, layout: ParallelLayout, microbatches: list[dict[str, torch.Tensor]],
                     output_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor] | None:
    """Forward each micro-batch (dicts with input_ids, position_ids, attention_mask [megatron mask])
    through megatron's pipeline schedule; returns the last stage's outputs (after `output_fn`), else None."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    inner = unwrap_model(model)
    config = inner.config
    b, s = microbatches[0]["input_ids"].shape

    def forward_step(data_iterator, step_model):
        batch = next(data_iterator)
        out = step_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                         attention_mask=batch["attention_mask"])
        return out, None

    with layout.activate(), torch.no_grad():
        schedule = get_forward_backward_func(pp_size=layout.pp)
        kwargs = dict(pg_collection=layout.pg_collection)
        if layout.pp > 1:
            kwargs["p2p_communicator"] = layout.p2p_communicator(config)
        outputs = schedule(forward_step_func=forward_step, data_iterator=iter(microbatches), model=[model],
                           num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b,
                           forward_only=True, **kwargs)
        if not layout.is_last_stage:
            return None
        return [output_fn(o) if output_fn else o for o in outputs]


def gather_vocab_logits(logits: torch.Tensor, layout: ParallelLayout, vocab_size: int) -> torch.Tensor:
    """[.., V_pad/tp] vocab-parallel logits -> [.., vocab_size] full, unpadded logits (autograd-aware:
    the backward hands each TP rank its slice of the grad, so it can sit inside a loss)."""
    if layout.tp > 1:
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits, group=layout.tp_group)
    return logits[..., :vocab_size]


def forward_logits(model, layout: ParallelLayout, input_ids: torch.Tensor,
                   position_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """Forward [b, s] token ids through the (PP-staged, TP-sharded) model as one micro-batch.

    Returns [b, s, vocab] logits (TP-gathered, unpadded) on the last stage — or [b, s] values for
    a critic — and None on other stages. `attention_mask` is HF-style [b, s] (1 = real token).
    Every rank of the layout must call it with the same input_ids.
    """
    inner = unwrap_model(model)
    arch: ModelArch = inner.tripod_arch
    b, s = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    batch = dict(input_ids=input_ids, position_ids=position_ids,
                 attention_mask=causal_attention_mask(s, attention_mask))
    if inner.tripod_value_head:
        out = run_forward_only(model, layout, [batch], output_fn=lambda v: v.squeeze(-1))
    else:
        out = run_forward_only(model, layout, [batch],
                               output_fn=lambda lg: gather_vocab_logits(lg, layout, arch.vocab_size))
    return None if out is None else out[0]
