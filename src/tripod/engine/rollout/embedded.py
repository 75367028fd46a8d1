"""The embedded rollout engine: batched KV-cached generation from the resharded generation shard.

Every rank of the rollout TP group runs `generate` together. Prompts are left-padded into one batch and
prefilled in one forward pass (each prompt once: its KV cache rows and last logits are then copied to its n
samples), then decoded one token per step. A finished row (stop token, stop string: stop_strings.py, or
max_new_tokens) is no longer sampled; its cache row is dropped from the batch once at most half of the rows are
live (until then it rides along: a CPU decode step streams all the weights whatever its row count, and every
compaction copies the whole cache); the loop ends when no row is live. The draws are those of dropping each
finished row at once (one per live row and step, in the same order), up to the float rounding of other batch
sizes. Sampling runs on every rank with the same seeded generator and rank 0's tokens are broadcast, so the TP ranks
always agree. Works in fp32 on CPU (tests, demo) and in bf16 on GPU.
"""
from __future__ import annotations

import contextlib
import secrets
from typing import Any, Callable

import torch
import torch.distributed as dist

from tripod.engine.rollout.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    tp_size_and_rank,
    validate_rollout_tp,
)
from tripod.engine.rollout.sampling import sample_next_token
from tripod.engine.rollout.stop_strings import StopStrings, load_tokenizer
from tripod.engine.rollout.tp_decoder import KVCache
from tripod.parallel.arch import ModelArch
from tripod.parallel.families import get_family

DENSE_DECODER = "tripod.engine.rollout.tp_decoder:TPDecoder"
MOE_DECODER = "tripod.engine.rollout.moe_decoder:MoEDecoder"


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch's intra-op threads set to `n` for the block (n <= 0: unchanged)."""
    before = torch.get_num_threads()
    if n > 0 and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def decoder_class(arch: ModelArch) -> type:
    """The decoder class the family of `arch` names (`FamilySpec.rollout_decoder`, "module:Class"); a family that
    keeps the dense default but has routed experts or latent attention (`arch.moe` / `arch.mla`) gets `MoEDecoder`."""
    import importlib

    name = get_family(arch.family).rollout_decoder
    if name == DENSE_DECODER and (getattr(arch, "moe", None) is not None or getattr(arch, "mla", None) is not None):
        name = MOE_DECODER
    module, _, cls = name.partition(":")
    return getattr(importlib.import_module(module), cls)


class EmbeddedRolloutEngine(RolloutEngine):
    """Generates with this rank's TP slice; `dtype`/`device` say where the weights copy lives."""

    def __init__(self, arch: ModelArch, tp_group: Any = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", pad_token_id: int | None = None,
                 tp_order: list[int] | None = None, tokenizer: Any = None) -> None:
        """`tp_order`: the TP group's global ranks in TP-slice order (entry j holds slice j), when that is not the
        ranks' sorted order (the hybrid engine's `rollout_tp_order`); None: slice j on the group's j-th rank.
        `tokenizer` (a transformers tokenizer or its directory, loaded on first use) decodes the responses for stop
        strings (`SamplingParams.stop`); None: a request with stop strings is refused."""
        super().__init__(arch, tp_group)
        self.tp_size, self.tp_rank = tp_size_and_rank(tp_group)
        slice_owner = None
        if tp_order is not None and tp_group is not None:
            ranks = sorted(tp_order)
            if ranks != sorted(dist.get_process_group_ranks(tp_group)):
                raise ValueError(f"tp_order {tp_order} is not the TP group's ranks {ranks}")
            self.tp_rank = tp_order.index(dist.get_rank())
            slice_owner = None if tp_order == ranks else [ranks.index(r) for r in tp_order]
        validate_rollout_tp(arch, self.tp_size)
        self.dtype, self.device = dtype, torch.device(device)
        self._fp32_names: set[str] | None = None
        self.pad_token_id = pad_token_id if pad_token_id is not None else self._default_pad_id(arch)
        self.tokenizer = tokenizer
        self.decoder = decoder_class(arch)(arch, tp_group, self.tp_size, self.tp_rank)
        self.decoder.slice_owner = slice_owner
        self._weights_loaded = False
        self._released_shapes: dict[str, torch.Size] | None = None
        self.kv_cache: KVCache | None = None
        self._resumed = False
        self.decode_threads = 0  # torch threads of the one-token decode steps (0: leave torch's setting)
        # partial rollouts (engine/async_rollout/server.py): called after each sampled token but the last; True when
        # it loaded new weights, after which the live sequences' KV cache is recomputed under them
        self.between_tokens: Callable[[int], bool] | None = None
        self.recompute_after_switch = True  # False keeps the old weights' keys and values (tests show the difference)
        self.record_routing = False  # MoE: return each token's routed experts (R3, engine/rollout/routing_record.py)

    @staticmethod
    def _default_pad_id(arch: ModelArch) -> int:
        pad = arch.hf_config.get("pad_token_id")
        if pad is None:
            eos = arch.eos_token_id
            pad = eos if isinstance(eos, int) else (eos[0] if eos else 0)
        return int(pad)

    # ---- memory / weights -----------------------------------------------------------------------
    def load_weights(self, generation_shard: dict[str, torch.Tensor]) -> None:
        """Take the shard: copied into existing buffers (after `resume_memory`), else adopted without a copy
        when dtype and device already match (the hybrid engine's freshly gathered shard: no second copy)."""
        self.decoder.check_shard(generation_shard)
        weights = self.decoder.weights
        for name, tensor in generation_shard.items():
            buf = weights.get(name)
            if buf is tensor:  # gathered straight into our buffer (WeightSync passes weight_buffers())
                continue
            if buf is None or buf.shape != tensor.shape:
                weights[name] = tensor.detach().to(self.device, self._dtype_of(name))
            else:
                buf.copy_(tensor.detach())
        self._weights_loaded = True
        self._released_shapes = None

    def release_memory(self) -> None:
        """Free the weights copy and any KV cache; `resume_memory` + `load_weights` bring them back."""
        if self.decoder.weights:
            self._released_shapes = {n: t.shape for n, t in self.decoder.weights.items()}
        self.decoder.weights = {}
        self.kv_cache = None
        self._weights_loaded = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Re-reserve the weight buffers released earlier: allocated when `weight_buffers()` asks for them (a
        caller that hands over ready tensors, e.g. views of the actor's parameters, never pays for them)."""
        self._resumed = self._released_shapes is not None

    def _allocate_released(self) -> None:
        if self._resumed and self._released_shapes is not None and not self.decoder.weights:
            self.decoder.weights = {n: torch.empty(s, dtype=self._dtype_of(n), device=self.device)
                                    for n, s in self._released_shapes.items()}
        self._resumed = False

    def _dtype_of(self, name: str) -> torch.dtype:
        """The rollout dtype, except rows the family holds in fp32 (the router's expert bias)."""
        if self._fp32_names is None:
            from tripod.parallel.families import get_family
            self._fp32_names = {n for n, w in get_family(self.arch.family).rows(self.arch).items() if w.fp32}
        return torch.float32 if name in self._fp32_names else self.dtype

    def weight_buffers(self) -> dict[str, torch.Tensor] | None:
        self._allocate_released()
        return self.decoder.weights or None

    def memory_bytes(self) -> int:
        """Bytes held by the weights copy and the KV cache."""
        tensors = list(self.decoder.weights.values())
        if self.kv_cache is not None:
            tensors += self.kv_cache.keys + self.kv_cache.values
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- generation -----------------------------------------------------------------------------
    def _left_pad(self, prompts: list[list[int]], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [B*n, P], real-token mask [B*n, P]) with prompt i repeated n times (rows i*n .. i*n+n-1)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate(prompts=...): need a non-empty list of non-empty token-id lists")
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), longest, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, longest - len(prompt):] = True
        if ids.max() >= self.arch.vocab_size or ids.min() < 0:
            raise ValueError(f"generate(prompts=...): token ids must be in [0, {self.arch.vocab_size})")
        return ids.repeat_interleave(n, 0).to(self.device), mask.repeat_interleave(n, 0).to(self.device)

    def _make_generator(self, seed: int | None) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        if seed is None:
            seed = secrets.randbits(62)  # leaves torch's global RNG alone; rank 0's tokens are broadcast anyway
        generator.manual_seed(seed)
        return generator

    def _broadcast_from_first_rank(self, *tensors: torch.Tensor) -> None:
        if self.tp_size > 1:
            for t in tensors:
                dist.broadcast(t, group=self.tp_group, group_src=0)

    def _recompute_cache(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, generated: torch.Tensor,
                         capacity: int):
        """After a weight switch mid-generation: the live sequences (left-padded prompt + tokens so far) prefilled
        again under the new weights, so every later token is exactly what they generate from that prefix (keeping
        the old weights' keys and values would sample from a mix of both); returns (the new cache, the next
        token's logits)."""
        full = torch.cat([prompt_ids, generated], 1)
        mask = torch.cat([prompt_mask, torch.ones_like(generated, dtype=torch.bool)], 1)
        cache = self.decoder.allocate_cache(full.shape[0], capacity, self.dtype, self.device)
        self.kv_cache = cache
        cache.valid[:, : full.shape[1]] = mask
        return cache, self.decoder.forward(full, (mask.long().cumsum(-1) - 1).clamp(min=0), cache)

    def running_batch(self, params: SamplingParams) -> Any:
        """A running decode batch that sequences join between steps (engine/rollout/running_batch.py); None when this
        engine records routing (R3: `generate` only)."""
        from tripod.engine.rollout.running_batch import RunningBatch

        return None if self.record_routing and self.arch.moe is not None else RunningBatch(self, params)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 row_seeds: list[int] | None = None) -> RolloutOutput:
        if not self._weights_loaded:
            raise RuntimeError("EmbeddedRolloutEngine.generate: no weights loaded (after construction or "
                               "release_memory/resume_memory); call load_weights(generation_shard) first")
        ids, prompt_mask = self._left_pad(prompts, 1)
        prompt_len, total = ids.shape[1], len(prompts) * params.n
        stop_ids = torch.tensor(sorted(params.stop_ids(self.arch)), dtype=torch.long, device=self.device)
        text_stops = None
        if params.stop:
            self.tokenizer = load_tokenizer(self.tokenizer)
            text_stops = StopStrings(self.tokenizer, params.stop, [p for p in prompts for _ in range(params.n)])
        if row_seeds is not None and len(row_seeds) != total:
            raise ValueError(f"generate(row_seeds=...): {len(row_seeds)} seeds for {total} response rows")
        generator = self._make_generator(params.seed) if row_seeds is None else \
            [self._make_generator(s) for s in row_seeds]

        out_ids = torch.full((total, params.max_new_tokens), self.pad_token_id, dtype=torch.long)
        out_logp = torch.zeros(total, params.max_new_tokens, dtype=torch.float32)
        lengths = torch.zeros(total, dtype=torch.long)
        finish = [FINISH_LENGTH] * total

        # the prompt is prefilled once and its cache rows copied to its n samples (row i*n + j: sample j of prompt i)
        cache = self.decoder.allocate_cache(len(prompts), prompt_len + params.max_new_tokens, self.dtype, self.device)
        self.kv_cache = cache
        cache.valid[:, :prompt_len] = prompt_mask
        recorder = None
        if self.record_routing and self.arch.moe is not None:
            from tripod.engine.rollout.routing_record import RoutingRecorder
            recorder = RoutingRecorder(self.decoder, self.arch.moe, total, prompt_len + params.max_new_tokens)
        # position of a real token = number of real tokens before it (HF: cumsum(mask) - 1)
        positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        samples = torch.arange(len(prompts), device=self.device).repeat_interleave(params.n)
        next_position = prompt_mask.sum(-1)[samples]
        rows = torch.arange(total)  # original row of each batch entry
        active = torch.arange(total)  # batch entries still generating (the others ride along until compaction)
        try:
            logits = self.decoder.forward(ids, positions, cache)
            if recorder is not None:
                recorder.prefill_ran(samples)
            if params.n > 1:
                cache.keep_rows(samples)
                logits = logits[samples]
            self.last_kv_cache_bytes = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
            feed = torch.empty(total, dtype=torch.long, device=self.device)  # each batch entry's next input token
            for step in range(params.max_new_tokens):
                batch_size = feed.shape[0]
                on = active.to(self.device)
                mine = rows[active]
                tokens, logp = sample_next_token(logits if len(active) == batch_size else logits[on], params,
                                                 [generator[r] for r in mine.tolist()]
                                                 if isinstance(generator, list) else generator)
                tokens, logp = tokens.contiguous(), logp.float().contiguous()
                self._broadcast_from_first_rank(tokens, logp)
                out_ids[mine, step] = tokens.cpu()
                out_logp[mine, step] = logp.cpu()
                lengths[mine] += 1
                stopped = torch.isin(tokens, stop_ids).cpu()
                if text_stops is not None:
                    stopped |= torch.tensor(text_stops.update(mine.tolist(), tokens.tolist()), dtype=torch.bool)
                for r in mine[stopped].tolist():
                    finish[r] = FINISH_STOP
                if step + 1 == params.max_new_tokens or bool(stopped.all()):
                    break
                feed[on] = tokens  # a finished entry keeps its last token: its outputs are never read again
                active = active[~stopped]
                if 2 * len(active) <= batch_size:  # copy the cache rows only when at most half are still live
                    keep = active.to(self.device)
                    cache.keep_rows(keep)
                    rows, feed, next_position = rows[active], feed[keep], next_position[keep]
                    active = torch.arange(len(active))
                switched = self.between_tokens is not None and self.between_tokens(step)
                if switched and self.recompute_after_switch:
                    if len(active) < feed.shape[0]:  # only live sequences are recomputed
                        keep = active.to(self.device)
                        rows, feed, next_position = rows[active], feed[keep], next_position[keep]
                        active = torch.arange(len(active))
                    cache, logits = self._recompute_cache(ids[samples[rows.to(self.device)]],
                                                          prompt_mask[samples[rows.to(self.device)]],
                                                          out_ids[rows, : step + 1].to(self.device),
                                                          prompt_len + params.max_new_tokens)
                    if recorder is not None:
                        recorder.forward_ran(rows, 0)
                else:
                    cache.valid[:, cache.length] = True
                    with _torch_threads(self.decode_threads):
                        logits = self.decoder.forward(feed[:, None], next_position[:, None], cache)
                    if recorder is not None:
                        recorder.forward_ran(rows, cache.length - 1)
                next_position = next_position + 1
        finally:
            self.kv_cache = None
            if recorder is not None:
                recorder.close()

        return RolloutOutput(prompt_index=torch.arange(len(prompts)).repeat_interleave(params.n),
                             response_ids=out_ids[:, : int(lengths.max())], response_lengths=lengths,
                             log_probs=out_logp[:, : int(lengths.max())], finish_reasons=finish,
                             pad_token_id=self.pad_token_id, routed_experts=None if recorder is None else
                             recorder.per_row(prompt_mask, lengths, samples))
