"""Test-only forward passes of a tripod GPTModel, on the production pipeline driver (parallel/pipeline.py).

`forward_logits` gives [b, s, vocab] logits (TP-gathered, unpadded) of an actor, or [b, s] values of a
critic, on the last stage (None elsewhere), for parity checks against `transformers`. At context_parallel_size > 1
each CP rank runs its load-balanced slots (parallel/context_parallel.py) and the output is all-gathered back into
sequence order.
"""
from __future__ import annotations

import torch


def gather_vocab_logits(logits: torch.Tensor, layout, vocab_size: int) -> torch.Tensor:
    """[.., V_pad/tp] vocab-parallel logits -> [.., vocab_size] (autograd-aware: each TP rank gets its grad slice)."""
    if layout.tp > 1:
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits, group=layout.tp_group)
    return logits[..., :vocab_size]


def forward_logits(model, layout, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """One micro-batch through `model` (a GPTModel or its list of chunks). `attention_mask`: HF-style [b, s]."""
    from tripod.parallel.convert import model_chunks
    from tripod.parallel.model import causal_attention_mask
    from tripod.parallel.pipeline import run_pipeline

    chunks = model_chunks(model)
    b, s = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    batch = dict(input_ids=input_ids, position_ids=position_ids, attention_mask=causal_attention_mask(s, attention_mask))
    cp = getattr(layout, "cp", 1)
    if cp > 1:
        from tripod.parallel.context_parallel import split_for_cp

        ids, slots, mask = split_for_cp(input_ids, torch.arange(s), batch["attention_mask"], cp, layout.cp_rank)
        for chunk in chunks:
            chunk.rotary_pos_emb.tripod_positions = slots
        batch = dict(input_ids=ids, position_ids=position_ids[:, :ids.shape[1]], attention_mask=mask)
    value_head, vocab = chunks[-1].tripod_value_head, chunks[-1].tripod_arch.vocab_size

    def forward_step(mb, chunk):
        out = chunk(input_ids=mb["input_ids"], position_ids=mb["position_ids"], attention_mask=mb["attention_mask"])
        post = (lambda o: o.squeeze(-1)) if value_head else (lambda o: gather_vocab_logits(o, layout, vocab))
        return out, lambda o: (o.sum() * 0.0, post(o))

    out = run_pipeline(chunks, layout, [batch], forward_step, forward_only=True, seq_length=s, micro_batch_size=b)
    if cp > 1 and layout.is_last_stage:
        from tripod.parallel.context_parallel import gather_sequence

        return gather_sequence(out[0].transpose(0, 1), layout.cp_group).transpose(0, 1)
    return out[0] if layout.is_last_stage else None
