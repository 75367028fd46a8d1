"""Per-model patches of a built megatron GPTModel (installed by engine/workers/megatron_worker.py on every model
chunk it builds; see the table in this package's docstring for what each fixes and its canary).

    bypass_output_layer      the output layer returns the hidden state; tripod.kernels.logprobs_from_hidden applies
                             the vocab-parallel LM head (no [tokens, vocab] logits)
    rope_with_slot_positions RoPE takes a position per sequence slot (`rotary_pos_emb.tripod_positions`), which a
                             packed micro-batch of shared prompts needs
    cast_floating_params     every parameter in params_dtype (the local-spec RMSNorm builds fp32 weights)
"""
from __future__ import annotations

import torch


def bypass_output_layer(model, tp_group) -> None:
    """Make GPTModel return hidden states [b, s, h] (the LM head is applied by the fused log-prob kernel).

    With sequence parallel the hidden state is gathered over the sequence first; that gather's backward
    reduce-scatters, so it also sums the vocab-parallel partial gradients (see `MegatronWorker.token_logprobs`)."""
    sequence_parallel = model.config.sequence_parallel

    def forward(hidden, weight=None, runtime_gather_output=None):
        if sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
        return hidden, None

    model.output_layer.forward = forward


def rope_with_slot_positions(model) -> bool:
    """Let `model.rotary_pos_emb.tripod_positions` ([S] positions, [B, S] per row, or None for megatron's 0..S-1)
    choose the RoPE position of each sequence slot: what a packed micro-batch needs. False (nothing installed) for
    models whose rotary embedding is not megatron's plain RoPE."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = getattr(model, "rotary_pos_emb", None)
    if type(rope) is not RotaryEmbedding or rope.rotary_interleaved or model.config.multi_latent_attention \
            or model.config.context_parallel_size > 1:
        return False
    if hasattr(rope, "tripod_positions"):
        return True
    megatron_forward = rope.forward
    rope.tripod_positions = None

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        positions = rope.tripod_positions
        if positions is None:
            return megatron_forward(max_seq_len, offset, packed_seq, cp_group)
        if positions.shape[-1] != max_seq_len:
            raise RuntimeError(f"packed RoPE positions cover {positions.shape[-1]} slots, the model runs {max_seq_len}")
        seq = positions.to(rope.inv_freq.device, rope.inv_freq.dtype)  # as get_freqs_non_repeated, per slot
        if rope.seq_len_interpolation_factor is not None:
            seq = seq * (1 / rope.seq_len_interpolation_factor)
        freqs = seq[..., None] * rope.inv_freq  # [S, d/2] or [B, S, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        # megatron applies it to [S, B, heads, d]: [S, 1, 1, d] for all rows, or [S, B, 1, d] row by row
        return emb[:, None, None, :] if emb.dim() == 2 else emb.transpose(0, 1)[:, :, None, :]

    rope.forward = forward  # pyright: ignore[reportAttributeAccessIssue]
    return True


def cast_floating_params(model, dtype: torch.dtype) -> None:
    """Every parameter in `dtype`. megatron's CPU (local-spec) RMSNorm builds fp32 weights whatever params_dtype is,
    where TE's norm uses params_dtype; megatron's Float16 optimizer checkpoints assume all params are 16-bit."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
