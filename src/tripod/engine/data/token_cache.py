"""Tokenized prompts cached on disk, so that the ranks of a node (and a rerun) tokenize a data file once.

`cached_token_ids(path, rows, texts, encode, tokenizer, settings, cache_dir)` returns the token ids of every row of
one data file. The cache entry is named by a key over everything the ids depend on: the file's bytes (sha256), the
tokenizer (its class, its full serialisation or vocabulary, its special tokens and chat template) and the settings
the caller passes (prompt column, chat template on or off). So a changed file or tokenizer gets a new entry; stale
entries are never read.

Once per node: the first rank to take the entry's lock (`fcntl.flock` on `KEY.lock` in the cache directory)
tokenizes and writes the entry atomically (a temporary file in the same directory, then `os.replace`); the ranks
waiting on the lock then read it. No collective is needed, and a rerun with the same inputs reads it too.

An entry is trusted only if it parses without pickle (`numpy.load(allow_pickle=False)`), names the same key and
format version, has one row per row of the file, consistent offsets, and its payload's sha256 matches the one it
records. Anything else (truncated, edited, another key) is reported in one line and rebuilt. `cache_dir=None`
turns the cache off (every rank tokenizes); an unwritable directory is reported and tokenizing goes on uncached.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any, Callable

import numpy as np

FORMAT_VERSION = 1


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/tripod/prompt_tokens (~/.cache when unset): where data.token_cache_dir='' puts entries."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "tripod", "prompt_tokens")


def resolve_cache_dir(value: str | None) -> str | None:
    """data.token_cache_dir -> the directory to use: "" the default one, null None (no cache), else the path."""
    return None if value is None else default_cache_dir() if value == "" else os.path.expanduser(value)


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over what decides a tokenizer's ids: its class, its whole serialisation (fast tokenizers) or its
    vocabulary, its special tokens and its chat template."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else
             json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    specials = {k: str(v) for k, v in (getattr(tokenizer, "special_tokens_map", None) or {}).items()}
    h.update(json.dumps([specials, str(getattr(tokenizer, "chat_template", None))], sort_keys=True).encode())
    return h.hexdigest()


def entry_key(path: str, tokenizer: Any, settings: dict[str, Any]) -> str:
    parts = [FORMAT_VERSION, file_digest(path), tokenizer_fingerprint(tokenizer), sorted(settings.items())]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def _payload_digest(ids: np.ndarray, offsets: np.ndarray) -> str:
    return hashlib.sha256(ids.tobytes() + offsets.tobytes()).hexdigest()


def read_entry(entry: str, key: str, rows: int) -> list[list[int]]:
    """The ids an entry holds; ValueError saying what is wrong unless it passes every check (module docstring)."""
    try:
        with np.load(entry, allow_pickle=False) as z:
            meta, ids, offsets = json.loads(str(z["meta"])), z["ids"], z["offsets"]
    except Exception as e:  # noqa: BLE001  any unreadable file is untrusted, whatever numpy raises
        raise ValueError(f"unreadable ({type(e).__name__}: {e})") from None
    if meta.get("key") != key or meta.get("version") != FORMAT_VERSION:
        raise ValueError("it names another key or format version")
    if ids.dtype != np.int32 or offsets.dtype != np.int64 or offsets.shape != (rows + 1,):
        raise ValueError(f"it holds {offsets.shape[0] - 1 if offsets.ndim == 1 else '?'} rows of the wrong layout, "
                         f"the file has {rows}")
    if offsets[0] != 0 or offsets[-1] != ids.shape[0] or (np.diff(offsets) < 0).any() or (ids < 0).any():
        raise ValueError("its offsets or ids are inconsistent")
    if meta.get("payload_sha256") != _payload_digest(ids, offsets):
        raise ValueError("its payload does not match its checksum")
    return [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(rows)]


def write_entry(entry: str, key: str, token_ids: list[list[int]]) -> None:
    """Write an entry atomically (a temporary file beside it, then a rename)."""
    offsets = np.zeros(len(token_ids) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(x) for x in token_ids])
    ids = np.fromiter((t for x in token_ids for t in x), dtype=np.int32, count=int(offsets[-1]))
    meta = json.dumps({"key": key, "version": FORMAT_VERSION, "payload_sha256": _payload_digest(ids, offsets)})
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(entry), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, meta=np.array(meta), ids=ids, offsets=offsets)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, entry)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def cached_token_ids(path: str, rows: int, texts: Callable[[], list[str]],
                     encode: Callable[[list[str]], list[list[int]]], tokenizer: Any, settings: dict[str, Any],
                     cache_dir: str | None, say: Callable[[str], None] = print) -> list[list[int]]:
    """The token ids of the `rows` rows of data file `path`: `encode(texts())`, from the cache when an entry for the
    same file, tokenizer and `settings` is there (see the module docstring), else computed once and stored."""
    if cache_dir is None:
        return [list(x) for x in encode(texts())]
    import fcntl

    key = entry_key(path, tokenizer, settings)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock = open(os.path.join(cache_dir, key + ".lock"), "a")
    except OSError as e:
        say(f"data.token_cache_dir={cache_dir} is not writable ({e}); tokenizing {path} without the cache "
            "(set data.token_cache_dir to a writable directory, or null to turn the cache off)")
        return [list(x) for x in encode(texts())]
    entry = os.path.join(cache_dir, key + ".npz")
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one rank of the node tokenizes; the others wait, then read its entry
        if os.path.exists(entry):
            try:
                return read_entry(entry, key, rows)
            except ValueError as e:
                say(f"token cache {entry} for {path} is not trusted: {e}; tokenizing again")
        token_ids = [list(x) for x in encode(texts())]
        if len(token_ids) != rows:
            raise ValueError(f"tokenizing {path} gave {len(token_ids)} rows for {rows}")
        try:
            write_entry(entry, key, token_ids)
        except OSError as e:
            say(f"could not write the token cache {entry} ({e}); going on without it")
        return token_ids
