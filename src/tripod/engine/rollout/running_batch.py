"""Continuous batching: sequences join a running decode batch between two decode steps.

    batch = engine.running_batch(params)     # sampling settings; each request brings its own length budget and seed
    batch.admit([Request(key, context_ids, max_new_tokens, seed), ...])   # prefilled now, sampled from the next step
    for done in batch.step(): ...           # one token for every live sequence -> the sequences that just ended

The agent loop's per-row turns run on it (engine/agent/turns.py): while one row waits for a tool, the others keep
decoding, and a row whose tool has answered joins at the next step instead of waiting for the next generate call.
Every sequence samples from its own generator seeded by its request, so its tokens do not depend on which other
sequences share its steps (up to the float rounding of other batch sizes): they are `engine.generate(contexts,
params, row_seeds)`'s. `RunningBatch` is the embedded engine's; `VLLMRunningBatch` hands the requests to vLLM's own
scheduler (`LLMEngine.add_request` / `step`, what `LLM.generate` runs on), seeded per request likewise.

The cache is the engine's `KVCache`, whose slots all rows share (contexts left-padded to one length). A request is
prefilled on its own (identical contexts once: the n samples of a prompt), then its slots are right-aligned with the
batch's: the cache is reallocated with the longer of the two lengths plus the room the longest budget needs, the
batch's rows shifted right where the new context is the longer. Ended sequences ride along until at most half of the
rows are live (as in `EmbeddedRolloutEngine.generate`), then the cache keeps the live rows and drops the leading
columns none of them uses. Routing records (R3) and weight switches between tokens are `generate`'s only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tripod.engine.rollout.base import FINISH_LENGTH, FINISH_STOP, SamplingParams
from tripod.engine.rollout.sampling import sample_next_token
from tripod.engine.rollout.stop_strings import StopStrings, load_tokenizer
from tripod.engine.rollout.tp_decoder import KVCache


@dataclass
class Request:
    """One sequence to continue: `context` (prompt and earlier turns), at most `max_new_tokens` more, its own seed."""
    key: Any
    context: list[int]
    max_new_tokens: int
    seed: int | None = None


@dataclass
class Finished:
    """A sequence that ended: its new tokens, their log-probs (engine/rollout/base.py's convention), why it ended."""
    key: Any
    token_ids: list[int]
    log_probs: list[float]
    finish: str


@dataclass
class _Sequence:
    request: Request
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    alive: bool = True
    text_row: int = -1  # its row in the stop-string state


class RunningBatch:
    """The running decode batch of one `EmbeddedRolloutEngine` (see the module docstring). Every rank of the engine's
    TP group makes the same calls in the same order (the sampled tokens come from its first rank)."""

    def __init__(self, engine: Any, params: SamplingParams) -> None:
        if not engine._weights_loaded:
            raise RuntimeError("RunningBatch: the engine has no weights loaded; call load_weights first")
        if engine.record_routing and engine.arch.moe is not None:
            raise ValueError("RunningBatch does not record routing (R3): use EmbeddedRolloutEngine.generate")
        self.engine, self.params, self.decoder = engine, params, engine.decoder
        self.stop_ids = torch.tensor(sorted(params.stop_ids(engine.arch)), dtype=torch.long)
        self.text_stops: StopStrings | None = None
        if params.stop:
            engine.tokenizer = load_tokenizer(engine.tokenizer)
            self.text_stops = StopStrings(engine.tokenizer, params.stop, [])
        self.rows: list[_Sequence] = []  # one per cache row
        self.cache: KVCache | None = None
        self.logits: torch.Tensor | None = None  # [rows, vocab]: each row's next-token logits

    @property
    def live(self) -> int:
        return sum(s.alive for s in self.rows)

    # ---- joining ------------------------------------------------------------------------------------
    @torch.no_grad()
    def admit(self, requests: list[Request]) -> None:
        """Prefill `requests` and add them to the batch; their first token is sampled by the next `step`."""
        if not requests:
            return
        if any(r.max_new_tokens < 1 for r in requests):
            raise ValueError("RunningBatch.admit: every request needs max_new_tokens >= 1")
        engine = self.engine
        unique: dict[tuple[int, ...], int] = {}
        order = [unique.setdefault(tuple(r.context), len(unique)) for r in requests]
        ids, mask = engine._left_pad([list(c) for c in unique], 1)
        fresh = self.decoder.allocate_cache(len(unique), ids.shape[1], engine.dtype, engine.device)
        fresh.valid[:, : ids.shape[1]] = mask
        logits = self.decoder.forward(ids, (mask.long().cumsum(-1) - 1).clamp(min=0), fresh)
        if order != list(range(len(requests))):
            pick = torch.tensor(order, device=engine.device)
            fresh.keep_rows(pick)
            logits = logits[pick]
        new = [_Sequence(r, engine._make_generator(r.seed)) for r in requests]
        if self.text_stops is not None:
            for s in new:
                s.text_row = self.text_stops.add_row(s.request.context)
        keep = [i for i, s in enumerate(self.rows) if s.alive]
        self._merge(keep, fresh, logits, [r.max_new_tokens for r in requests])
        self.rows = [self.rows[i] for i in keep] + new

    def _merge(self, keep: list[int], fresh: KVCache, logits: torch.Tensor, fresh_room: list[int]) -> None:
        """The cache of the live rows `keep` and the prefilled `fresh` rows, right-aligned (module docstring)."""
        device, old = self.engine.device, self.cache
        pick = torch.tensor(keep, dtype=torch.long, device=device)
        first = old_len = 0
        if old is not None and keep:
            used = old.valid[pick, : old.length].any(0).nonzero()
            first = int(used[0]) if len(used) else old.length
            old_len = old.length - first
        new_len = fresh.length
        length = max(old_len, new_len)
        room = max([self.rows[i].request.max_new_tokens - len(self.rows[i].tokens) for i in keep] + fresh_room)
        cache = self.decoder.allocate_cache(len(keep) + len(fresh_room), length + room, self.engine.dtype, device)
        sources = [(cache.keys, fresh.keys, old.keys if old_len else None),
                   (cache.values, fresh.values, old.values if old_len else None)]
        for targets, new_tensors, old_tensors in sources:
            for layer, dst in enumerate(targets):
                dst[:, :, :length].zero_()  # left padding: read (masked) by attention, so never garbage
                if old_tensors is not None:
                    dst[: len(keep), :, length - old_len: length] = old_tensors[layer][pick, :, first: first + old_len]
                dst[len(keep):, :, length - new_len: length] = new_tensors[layer][:, :, :new_len]
        if old is not None and old_len:
            cache.valid[: len(keep), length - old_len: length] = old.valid[pick, first: first + old_len]
        cache.valid[len(keep):, length - new_len: length] = fresh.valid[:, :new_len]
        cache.length = length
        kept = [self.logits[pick]] if old_len and self.logits is not None else []
        self.cache, self.logits = cache, torch.cat(kept + [logits])

    # ---- decoding -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Finished]:
        """Sample one token for every live sequence, then run the decode step of those still live; the ended ones."""
        live = [i for i, s in enumerate(self.rows) if s.alive]
        if not live or self.cache is None or self.logits is None:
            return []
        engine = self.engine
        on = torch.tensor(live, dtype=torch.long, device=engine.device)
        logits = self.logits if len(live) == len(self.rows) else self.logits[on]
        tokens, logp = sample_next_token(logits, self.params, [self.rows[i].generator for i in live])
        tokens, logp = tokens.contiguous(), logp.float().contiguous()
        engine._broadcast_from_first_rank(tokens, logp)
        token_list, logp_list = tokens.tolist(), logp.tolist()
        stopped = torch.isin(tokens.cpu(), self.stop_ids).tolist()
        if self.text_stops is not None:
            hits = self.text_stops.update([self.rows[i].text_row for i in live], token_list)
            stopped = [a or b for a, b in zip(stopped, hits)]
        done: list[Finished] = []
        for k, i in enumerate(live):
            s = self.rows[i]
            s.tokens.append(token_list[k])
            s.log_probs.append(logp_list[k])
            if stopped[k] or len(s.tokens) >= s.request.max_new_tokens:
                s.alive = False
                done.append(Finished(s.request.key, s.tokens, s.log_probs, FINISH_STOP if stopped[k] else FINISH_LENGTH))
        still = len(live) - len(done)
        if not still:
            self.rows, self.cache, self.logits = [], None, None
            return done
        if 2 * still <= len(self.rows):
            self._compact()
        self._decode()
        return done

    def _compact(self) -> None:
        """Keep the live rows only, and drop the leading columns none of them uses."""
        assert self.cache is not None and self.logits is not None
        keep = [i for i, s in enumerate(self.rows) if s.alive]
        pick = torch.tensor(keep, dtype=torch.long, device=self.engine.device)
        cache = self.cache
        cache.keep_rows(pick)
        used = cache.valid[:, : cache.length].any(0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first:
            cache.keys = [k[:, :, first:] for k in cache.keys]
            cache.values = [v[:, :, first:] for v in cache.values]
            cache.valid = cache.valid[:, first:]
            cache.length -= first
        self.rows, self.logits = [self.rows[i] for i in keep], self.logits[pick]

    def _decode(self) -> None:
        """One decode step of every cache row (ended ones ride along: their outputs are never read)."""
        from tripod.engine.rollout.embedded import _torch_threads

        assert self.cache is not None
        device = self.engine.device
        feed = torch.tensor([[s.tokens[-1]] for s in self.rows], dtype=torch.long, device=device)
        positions = torch.tensor([[len(s.request.context) + len(s.tokens) - 1] for s in self.rows], dtype=torch.long,
                                 device=device)
        self.cache.valid[:, self.cache.length] = True
        with _torch_threads(self.engine.decode_threads):
            self.logits = self.decoder.forward(feed, positions, self.cache)


class VLLMRunningBatch:
    """The same running batch on the vLLM engine (engine/rollout/vllm_engine.py): requests go to vLLM's scheduler as
    they come, and each `step` is one of its engine steps."""

    def __init__(self, engine: Any, params: SamplingParams) -> None:
        engine._wake_kv_cache()
        self.engine, self.params = engine, params
        self.keys: dict[str, Any] = {}  # vLLM request id -> the request's key
        self._issued = 0

    @property
    def live(self) -> int:
        return len(self.keys)

    def admit(self, requests: list[Request]) -> None:
        from dataclasses import replace

        from vllm.sampling_params import RequestOutputKind

        from tripod.engine.rollout.vllm_engine import vllm_sampling_params

        lora = self.engine.adapter_slot.request if self.engine.adapter_slot is not None else None
        for r in requests:
            params = replace(self.params, max_new_tokens=r.max_new_tokens, seed=r.seed)
            sampling = vllm_sampling_params(params, self.engine.arch, 0)
            sampling.output_kind = RequestOutputKind.FINAL_ONLY
            rid = f"tripod-turn-{self._issued}"  # what the outputs carry (vLLM keeps its own internal id apart)
            self.engine.llm.llm_engine.add_request(rid, {"prompt_token_ids": list(r.context)}, sampling,
                                                   lora_request=lora)
            self._issued += 1
            self.keys[rid] = r.key

    def step(self) -> list[Finished]:
        from tripod.engine.rollout.vllm_engine import output_from_vllm

        done = []
        for result in self.engine.llm.llm_engine.step():
            if result.finished:
                out = output_from_vllm([result], 1, 1, self.engine.pad_token_id)
                ids = out.responses()[0]
                done.append(Finished(self.keys.pop(result.request_id), ids, out.log_probs[0, : len(ids)].tolist(),
                                     out.finish_reasons[0]))
        return done
