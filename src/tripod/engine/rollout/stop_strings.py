"""Stop strings for the embedded engine: per response row, its decoded text so far and whether a stop string appeared.

The rule is vLLM's (v1 `IncrementalDetokenizer.update` + `check_stop_strings`), so every backend ends a response at
the same token: each row's text is decoded incrementally with the tokenizer's `tokenizers.decoders.DecodeStream`
primed with the row's prompt (special tokens skipped, vLLM's default), and after each new token the text is searched
for a stop string that ends inside the characters this token added. The token that completes a stop string is the
response's last token (vLLM keeps it in `token_ids` too and only trims the text). A tokenizer without a fast
backend falls back to decoding the whole response each step (`tokenizer.decode(..., skip_special_tokens=True)`).
"""
from __future__ import annotations

import os
from typing import Any, Sequence

STOP_KEY = "actor_rollout_ref.rollout.stop"


def load_tokenizer(tokenizer: Any) -> Any:
    """A transformers tokenizer from itself or from a directory path; None stays None."""
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    return tokenizer


def first_stop(text: str, new_chars: int, stops: Sequence[str]) -> str | None:
    """The stop string that ends earliest in the last `new_chars` characters of `text` (None if none does): vLLM's
    `check_stop_strings`, which searches only where a match can end in the new text."""
    best, best_end = None, None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        at = text.find(stop, start)
        if at != -1 and (best_end is None or at + len(stop) < best_end):
            best, best_end = stop, at + len(stop)
    return best


class StopStrings:
    """Incremental stop-string state of the rows of one `generate` call; `rows_prompts[r]` is row r's prompt ids."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], rows_prompts: Sequence[Sequence[int]]) -> None:
        if tokenizer is None:
            raise ValueError(f"{STOP_KEY} (SamplingParams.stop) needs the tokenizer to decode responses: build the "
                             "rollout engine with tokenizer=<tokenizer or its directory> (the trainer passes "
                             "data.tokenizer or the model path)")
        self.stops = list(stops)
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.texts = [""] * len(rows_prompts)
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream

            self.streams = [DecodeStream(ids=list(p), skip_special_tokens=True) for p in rows_prompts]
        else:
            self.tokens: list[list[int]] = [[] for _ in rows_prompts]

    def add_row(self, prompt: Sequence[int]) -> int:
        """A further row (a sequence joining a running batch, engine/rollout/running_batch.py); its index."""
        self.texts.append("")
        if self.backend is not None:
            from tokenizers.decoders import DecodeStream

            self.streams.append(DecodeStream(ids=list(prompt), skip_special_tokens=True))
        else:
            self.tokens.append([])
        return len(self.texts) - 1

    def _append(self, row: int, token: int) -> int:
        """Add `token` to row's text; the number of characters it added."""
        old = self.texts[row]
        if self.backend is not None:
            self.texts[row] = old + (self.streams[row].step(self.backend, token) or "")
            return len(self.texts[row]) - len(old)
        self.tokens[row].append(token)
        self.texts[row] = self.tokenizer.decode(self.tokens[row], skip_special_tokens=True)
        # a re-decode may rewrite the tail (a multi-byte character completed): everything after the common prefix is new
        return len(self.texts[row]) - len(os.path.commonprefix([old, self.texts[row]]))

    def update(self, rows: Sequence[int], tokens: Sequence[int]) -> list[bool]:
        """Append tokens[i] to row rows[i]; True where that token completed a stop string."""
        hits = []
        for row, token in zip(rows, tokens):
            added = self._append(int(row), int(token))
            hits.append(added > 0 and first_stop(self.texts[int(row)], added, self.stops) is not None)
        return hits
