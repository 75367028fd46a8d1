"""The rollout interface every generation backend implements (the factory is engine/rollout/factory.py).

Owns `SamplingParams`, `RolloutOutput`, the `RolloutEngine` ABC and `validate_rollout_tp`; it imports no
backend. Backends: "embedded" (engine/rollout/embedded.py: our own TP decoder that generates straight
from the resharded generation shard), "sglang" (engine/rollout/sglang_engine.py) and "vllm"
(engine/rollout/vllm_engine.py).

Log-prob convention (both backends): `RolloutOutput.log_probs[i, t]` is
log_softmax(logits / temperature)[token] over the real vocabulary (padded vocab ids dropped),
taken BEFORE top-k / top-p truncation; for greedy decoding the temperature is 1, i.e. the
model's own log-prob. This is what SGLang returns by default (temperature-scaled, not the
truncated distribution that was actually sampled from). The PPO trainer recomputes old
log-probs with the training engine anyway; these are for diagnostics and mismatch checks.
vLLM differs only with top-k / top-p on: it reports the truncated distribution's log-prob (vllm_engine.py).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from tripod.parallel.arch import ModelArch

ROLLOUT_NAMES = ("embedded", "sglang", "vllm")
FINISH_STOP = "stop"      # an EOS / stop id sampled, or a stop string completed (that token ends the response)
FINISH_LENGTH = "length"  # reached max_new_tokens


@dataclass(frozen=True)
class SamplingParams:
    """How to decode. `greedy=True` (or temperature == 0) means argmax; `do_sample` is its negation.

    A response ends at the first token that is one of `stop_ids(arch)` or whose addition makes the response's decoded
    text contain one of `stop` (vLLM's rule, docs/rollout.md "Stopping"); that token is the response's last.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # when True only stop_token_ids / stop / max_new_tokens end a sequence
    stop: tuple[str, ...] = ()  # stop strings (the engine needs the tokenizer to decode the response)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature}: must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p}: must be in (0, 1]; 1.0 disables top-p")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"SamplingParams.top_k={self.top_k}: must be -1 (disabled) or >= 1")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n}: must be >= 1 samples per prompt")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"SamplingParams.stop={self.stop!r}: must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        if self.temperature == 0:
            object.__setattr__(self, "greedy", True)

    @property
    def do_sample(self) -> bool:
        return not self.greedy

    def stop_ids(self, arch: ModelArch) -> set[int]:
        """Token ids that end a sequence: stop_token_ids plus, unless ignore_eos, the model's EOS ids (config.json's
        and generation_config.json's `eos_token_id`: `ModelArch.eos_token_ids`), as HF `generate` and vLLM stop."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(arch.eos_token_ids)
        return ids


@dataclass
class RolloutOutput:
    """Generated responses; row i*n + j is sample j of prompt i (prompt-major, like verl's repeat).

    response_ids: [B*n, R] int64, right-padded with `pad_token_id` past each length.
    response_lengths: [B*n] int64, number of generated tokens (the stop token included).
    log_probs: [B*n, R] float32, see the module docstring; 0 past each length.
    prompt_index: [B*n] int64, which input prompt each row answers.
    finish_reasons: "stop" or "length" per row.
    """

    prompt_index: torch.Tensor
    response_ids: torch.Tensor
    response_lengths: torch.Tensor
    log_probs: torch.Tensor
    finish_reasons: list[str]
    pad_token_id: int = 0
    # MoE with routing replay (R3): per row [prompt_len + response_len, L, k] expert ids (engine/rollout/routing_record.py)
    routed_experts: list[torch.Tensor] | None = None

    @classmethod
    def from_rows(cls, token_rows: list[list[int]], logprob_rows: list[list[float]], finish_reasons: list[str],
                  num_prompts: int, n: int, pad_token_id: int) -> "RolloutOutput":
        """An engine's ragged per-row tokens and log-probs (prompt-major, n rows per prompt) laid out as tensors."""
        width = max(1, max(map(len, token_rows)))
        response_ids = torch.full((len(token_rows), width), pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(len(token_rows), width, dtype=torch.float32)
        for row, (ids, lps) in enumerate(zip(token_rows, logprob_rows)):
            response_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            log_probs[row, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        return cls(prompt_index=torch.arange(num_prompts).repeat_interleave(n), response_ids=response_ids,
                   response_lengths=torch.tensor([len(t) for t in token_rows], dtype=torch.long),
                   log_probs=log_probs, finish_reasons=list(finish_reasons), pad_token_id=pad_token_id)

    def responses(self) -> list[list[int]]:
        """Each row's generated tokens as a plain list (padding removed)."""
        return [self.response_ids[i, : int(n)].tolist() for i, n in enumerate(self.response_lengths)]

    def __len__(self) -> int:
        return len(self.finish_reasons)


class RolloutEngine(abc.ABC):
    """A generation backend living on one rollout TP group (TP=tg, PP=1).

    Every rank of the group calls every method (collectives inside); every rank gets the same
    `RolloutOutput`. Life cycle per PPO step: resume_memory -> load_weights -> generate ->
    release_memory, driven by engine/rollout/weight_sync.py's `WeightSync` (the trainer calls only it).
    """

    def __init__(self, arch: ModelArch, tp_group: Any = None) -> None:
        self.arch = arch
        self.tp_group = tp_group

    @abc.abstractmethod
    def load_weights(self, generation_shard: dict[str, torch.Tensor]) -> None:
        """Take this rank's generation shard: {megatron name (global layer index) -> TP slice}."""

    def update_weights(self, generation_shard: dict[str, torch.Tensor]) -> None:
        self.load_weights(generation_shard)

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 row_seeds: list[int] | None = None) -> RolloutOutput:
        """Generate params.n responses for each prompt (token ids, unpadded). `row_seeds` (one per response row):
        row r samples from its own stream seeded row_seeds[r], whatever else is in the call (the agent loop's per-row
        turns, engine/agent/turns.py); None: params.seed for the call (the backends' own per-row rule)."""

    @abc.abstractmethod
    def release_memory(self) -> None:
        """Free the KV cache and the weights copy (the training phase needs the memory)."""

    @abc.abstractmethod
    def resume_memory(self) -> None:
        """Re-reserve the memory released by `release_memory`; weights must be loaded again."""

    def weight_buffers(self) -> dict[str, torch.Tensor] | None:
        """Buffers the generation shard can be gathered straight into (after `resume_memory`), or None when the
        engine keeps its weights elsewhere (SGLang) or has none reserved yet."""
        return None


def tp_size_and_rank(tp_group: Any) -> tuple[int, int]:
    """(size, rank in group) of a torch.distributed group; (1, 0) for None (single process)."""
    if tp_group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def validate_rollout_tp(arch: ModelArch, tg: int) -> None:
    """Raise ValueError unless a rollout tensor-parallel size `tg` can shard this model."""
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    if tg < 1:
        raise ValueError(f"{key}={tg}: must be >= 1")
    sizes = [("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads),
             ("intermediate_size", arch.ffn_hidden_size)]
    moe, mla = arch.moe, arch.mla
    if moe is not None:  # the embedded engine cuts every expert over the rollout TP group (moe_decoder.py)
        sizes.append(("moe_intermediate_size", moe.expert_ffn_hidden_size))
        if moe.shared_expert_ffn_hidden_size:
            sizes.append(("shared expert intermediate size", moe.shared_expert_ffn_hidden_size))
    if mla is not None:  # megatron splits the MLA down projections' outputs over TP
        sizes.append(("kv_lora_rank + qk_rope_head_dim", mla.kv_lora_rank + mla.qk_rope_head_dim))
        if mla.q_lora_rank:
            sizes.append(("q_lora_rank", mla.q_lora_rank))
    for what, count in sizes:
        if count % tg:
            divisors = [d for d in range(1, count + 1) if all(c % d == 0 for _, c in sizes)]
            raise ValueError(f"{key}={tg} does not divide the model's {what}={count} "
                             f"(num_attention_heads={arch.num_heads}, num_key_value_heads={arch.num_kv_heads}); "
                             f"set {key} to one of {divisors}")
