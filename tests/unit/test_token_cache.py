"""Tokenized prompts cached on disk (engine/data/token_cache.py): a second dataset of the same file and tokenizer
reads the entry instead of tokenizing, a changed file or tokenizer gets a new entry, an entry that is truncated or
whose ids were edited is not trusted (rebuilt, with one line saying so), ranks starting together tokenize once, and
`token_cache_dir=None` writes nothing. The ids are always those of tokenizing without a cache."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from tripod.engine.data import PromptDataset, make_arithmetic_rows, token_cache, write_prompt_parquet
from tripod.engine.data.char_tokenizer import char_tokenizer


class Counting:
    """A tokenizer that counts the batches it encodes (everything else is the wrapped tokenizer's)."""

    def __init__(self, tok) -> None:
        self.tok, self.calls = tok, 0

    def __call__(self, texts, **kw):
        self.calls += 1
        return self.tok(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def _data(tmp_path, name: str, seed: int, count: int = 12) -> str:
    path = str(tmp_path / name)
    write_prompt_parquet(make_arithmetic_rows(count, seed=seed, max_digits=2, instruction="Answer as #### N.",
                                              split="train"), path)
    return path


def _items(ds: PromptDataset) -> list:
    return [(it["input_ids"], it["ground_truth"], it["index"]) for it in ds.items]


def _entries(cache: str) -> list[str]:
    return sorted(f for f in os.listdir(cache) if f.endswith(".npz")) if os.path.isdir(cache) else []


def test_a_second_dataset_reads_the_entry_and_gets_the_same_ids(tmp_path):
    path, cache = _data(tmp_path, "a.parquet", 0), str(tmp_path / "cache")
    want = _items(PromptDataset(path, char_tokenizer(), max_prompt_length=256))
    first = Counting(char_tokenizer())
    assert _items(PromptDataset(path, first, max_prompt_length=256, token_cache_dir=cache)) == want
    assert first.calls == 1 and len(_entries(cache)) == 1
    again = Counting(char_tokenizer())
    assert _items(PromptDataset(path, again, max_prompt_length=256, token_cache_dir=cache)) == want
    assert again.calls == 0  # read, not tokenized
    # the filter still applies to cached ids (it is not part of the key)
    lens = [len(ids) for ids, _, _ in want]
    assert min(lens) < max(lens)
    short = PromptDataset(path, again, max_prompt_length=max(lens) - 1, token_cache_dir=cache)
    assert again.calls == 0 and [it["index"] for it in short.items] == [i for i, n in enumerate(lens) if n < max(lens)]


def test_a_changed_file_or_tokenizer_gets_a_new_entry(tmp_path):
    path, cache = _data(tmp_path, "a.parquet", 0), str(tmp_path / "cache")
    PromptDataset(path, char_tokenizer(), max_prompt_length=256, token_cache_dir=cache)
    write_prompt_parquet(make_arithmetic_rows(12, seed=5, max_digits=2, instruction="Answer as #### N.",
                                              split="train"), path)  # same name, other prompts
    changed = Counting(char_tokenizer())
    got = _items(PromptDataset(path, changed, max_prompt_length=256, token_cache_dir=cache))
    assert changed.calls == 1 and got == _items(PromptDataset(path, char_tokenizer(), max_prompt_length=256))
    other_tok = Counting(char_tokenizer(extra_chars=("\u00e9",)))  # one more token: another vocabulary
    PromptDataset(path, other_tok, max_prompt_length=256, token_cache_dir=cache)
    raw = Counting(char_tokenizer())  # the settings are part of the key too
    PromptDataset(path, raw, max_prompt_length=256, apply_chat_template=False, token_cache_dir=cache)
    assert other_tok.calls == 1 and raw.calls == 1 and len(_entries(cache)) == 4


def _edit_ids(entry: str) -> None:
    """Rewrite an entry with one token id changed, its header (key, version, checksum) kept."""
    with np.load(entry, allow_pickle=False) as z:
        meta, ids, offsets = z["meta"], z["ids"].copy(), z["offsets"]
    ids[3] += 1
    with open(entry, "wb") as f:
        np.savez(f, meta=meta, ids=ids, offsets=offsets)


def _truncate(entry: str) -> None:
    with open(entry, "r+b") as f:
        f.truncate(os.path.getsize(entry) // 2)


@pytest.mark.parametrize("damage", [_edit_ids, _truncate])
def test_a_damaged_entry_is_not_trusted(tmp_path, damage):
    path, cache = _data(tmp_path, "a.parquet", 1), str(tmp_path / "cache")
    want = _items(PromptDataset(path, char_tokenizer(), max_prompt_length=256, token_cache_dir=cache))
    (entry,) = _entries(cache)
    damage(os.path.join(cache, entry))
    with pytest.raises(ValueError, match="checksum|unreadable"):
        token_cache.read_entry(os.path.join(cache, entry), entry.removesuffix(".npz"), len(want))
    said: list[str] = []
    settings = {"prompt_key": "prompt", "apply_chat_template": True}  # PromptDataset's, for the same entry
    ids = token_cache.cached_token_ids(path, len(want), lambda: ["x"] * len(want), lambda texts: [[5]] * len(texts),
                                       char_tokenizer(), settings, cache, said.append)
    assert ids == [[5]] * len(want) and len(said) == 1 and "not trusted" in said[0], said
    # the rebuilt entry is trusted again (nothing encoded, nothing said)
    assert token_cache.cached_token_ids(path, len(want), lambda: [], lambda texts: [], char_tokenizer(), settings,
                                        cache, said.append) == ids and len(said) == 1


def test_ranks_starting_together_tokenize_once(tmp_path):
    path, cache = _data(tmp_path, "a.parquet", 2, count=40), str(tmp_path / "cache")
    toks = [Counting(char_tokenizer()) for _ in range(4)]
    start, out = threading.Barrier(len(toks)), [None] * len(toks)

    def rank(i: int) -> None:
        start.wait()
        out[i] = _items(PromptDataset(path, toks[i], max_prompt_length=256, token_cache_dir=cache))

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(toks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(t.calls for t in toks) == 1 and all(o == out[0] for o in out)
    assert [f for f in os.listdir(cache) if f.endswith(".tmp")] == []  # written atomically, nothing left over


def test_no_cache_dir_writes_nothing(tmp_path):
    path = _data(tmp_path, "a.parquet", 3)
    tok = Counting(char_tokenizer())
    PromptDataset(path, tok, max_prompt_length=256, token_cache_dir=None)
    assert tok.calls == 1 and sorted(os.listdir(tmp_path)) == ["a.parquet"]
    assert token_cache.resolve_cache_dir(None) is None and token_cache.resolve_cache_dir("").endswith(
        os.path.join("tripod", "prompt_tokens"))
