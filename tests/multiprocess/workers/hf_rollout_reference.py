"""Helpers for the rollout tests: tiny HF checkpoints, their generation shards, and HF references.

Shared by tests/multiprocess/test_rollout.py (in-process, TP=1) and tests/multiprocess/workers/tp2_rollout_check.py (torchrun).
The references are `transformers` itself: `generate(do_sample=False)` for greedy tokens and a plain
forward over prompt + response for the log-probs. Shards come from the converter
(`tripod.parallel.convert.hf_to_megatron` + `FamilySpec.shard`), i.e. exactly what the resharder hands the engine.
"""
from __future__ import annotations

import os

import torch

# Three variants cover the contract: Qwen2 (qkv bias, tied embeddings), Llama (llama3 rope scaling, untied output
# layer) and Qwen3 (per-head q/k RMSNorm, head_dim 32 != hidden / heads = 16, tied). Small enough for a 2-core
# machine; 4 heads / 2 KV heads so TP=2 splits GQA.
VARIANTS: dict[str, tuple[str, dict]] = {
    "qwen2_bias_tied": ("qwen2", dict(num_hidden_layers=2, vocab_size=300, tie_word_embeddings=True)),
    "llama_rope_llama3": ("llama", dict(num_hidden_layers=2, vocab_size=300, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    "qwen3_qknorm_tied": ("qwen3", dict(num_hidden_layers=2, vocab_size=300, head_dim=32, tie_word_embeddings=True)),
}
# Checked at TP=1 only: yarn scaling has attention_scaling != 1, which multiplies cos/sin.
TP1_ONLY_VARIANTS: dict[str, tuple[str, dict]] = {
    "qwen2_rope_yarn": ("qwen2", dict(num_hidden_layers=2, vocab_size=300, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})),
}
EOS_ID, PAD_ID = 2, 0


def tiny_checkpoint(tmp_dir: str, variant: str) -> str:
    from tests.helpers.common import make_tiny_hf_model

    family, overrides = {**VARIANTS, **TP1_ONLY_VARIANTS}[variant]
    return make_tiny_hf_model(tmp_dir, family, seed=7, subdir=variant, **overrides)


def load_hf(model_dir: str):
    """(arch, HF model in eval mode fp32, HF state dict as saved on disk)."""
    import transformers
    from safetensors.torch import load_file

    from tripod.parallel.arch import arch_from_hf

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    return arch_from_hf(model_dir), model, state


def generation_shard(arch, hf_state: dict[str, torch.Tensor], tp_size: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """This TP rank's generation shard {megatron name: TP slice} built by the converter."""
    from tripod.parallel.convert import family_of, hf_to_megatron

    full, family = hf_to_megatron(arch, hf_state), family_of(arch)
    return {name: family.shard(arch, name, t, tp_size, tp_rank) for name, t in full.items()}


def random_prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts of the given lengths with ids in [3, vocab) (no pad / bos / eos)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None = EOS_ID) -> list[list[int]]:
    """HF `generate(do_sample=False)` on a left-padded batch; each response cut after its first EOS. `eos_id` None:
    the model's own EOS ids (its generation_config.json's `eos_token_id`, an int or a list, as HF reads it)."""
    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    eos = {} if eos_id is None else dict(eos_token_id=eos_id)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=PAD_ID, top_k=None, top_p=None, temperature=None, **eos)
    if eos_id is None:
        eos_ids = model.generation_config.eos_token_id
        stops = set([eos_ids] if isinstance(eos_ids, int) else eos_ids or [])
    else:
        stops = {eos_id}
    responses = []
    for row in out[:, longest:].tolist():
        ends = [i for i, t in enumerate(row) if t in stops]
        responses.append(row[: ends[0] + 1] if ends else row)
    return responses


@torch.no_grad()
def hf_response_logprobs(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(HF logits / temperature) at each response token, from one forward over prompt+response."""
    seq = torch.tensor([prompt + response])
    logits = model(input_ids=seq).logits[0, len(prompt) - 1: -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def check_against_hf(engine, model, prompts: list[list[int]], max_new_tokens: int) -> int:
    """Greedy engine output == HF generate token for token; log-probs == HF forward to 1e-5.

    Returns the number of generated tokens compared. Raises AssertionError with details otherwise.
    """
    from tripod.engine.rollout import SamplingParams

    out = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, greedy=True))
    expected = hf_greedy(model, prompts, max_new_tokens)
    got = out.responses()
    assert got == expected, f"greedy tokens differ from HF generate:\n ours {got}\n   hf {expected}"
    compared = 0
    for row, (prompt, response) in enumerate(zip(prompts, got)):
        ref = hf_response_logprobs(model, prompt, response)
        ours = out.log_probs[row, : len(response)]
        err = (ours - ref).abs().max().item()
        assert err < 1e-5, f"row {row}: log-probs differ from HF by {err:.2e}"
        compared += len(response)
        assert out.finish_reasons[row] == ("stop" if response[-1] == EOS_ID else "length")
    return compared
