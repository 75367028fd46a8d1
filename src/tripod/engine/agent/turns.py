"""A response's turns from its tokens and their codes (engine/agent/loop.py): what the rollout dump writes
(trainer.rollout_data_dir's `turns`), for multi-turn and single-turn rows alike."""
from __future__ import annotations

from typing import Any, Callable

from tripod.engine.agent.loop import MODEL, ROLE_OF


def turns_of(response: list[int], codes: Any = None, decode: Callable[[list[int]], str] | None = None) -> list[dict]:
    """[{role, text, n_tokens, trained}] per run of tokens of one code (None: all the model's, one assistant turn);
    text is None without `decode`."""
    codes = [MODEL] * len(response) if codes is None else [int(c) for c in codes]
    out: list[dict] = []
    start = 0
    for k in range(1, len(response) + 1):
        if k == len(response) or codes[k] != codes[start]:
            ids = response[start:k]
            out.append({"role": ROLE_OF[codes[start]], "text": decode(ids) if decode else None, "n_tokens": len(ids),
                        "trained": codes[start] == MODEL})
            start = k
    return out
