"""Prompt datasets: verl-layout parquet files -> tokenized prompts, and a seeded, resumable batch loader.

Parquet layout (verl's, written by scripts/preprocess_gsm8k.py and scripts/make_arithmetic_data.py):

    prompt        list<struct<role: string, content: string>> (chat messages) or a plain string
    data_source   string, selects the reward function (engine.rewards.get_reward_fn)
    reward_model  struct<style: string, ground_truth: string>
    extra_info    struct<...>, optional, passed through to the reward function

`PromptDataset` reads and tokenizes every row once (chat template applied, generation prompt added, with
data.apply_chat_template_kwargs and the tool schemas: a row's `extra_info.tool_selection` narrows them to its tools, as
verl 0.9.1's agent loop does), drops prompts longer than `max_prompt_length`, and hands out `PromptBatch`es, which
carry each prompt's chat messages (`raw_prompts`, verl's raw_prompt: the agent loop's conversation starts with them).
With a `token_cache_dir` the token ids come from a cache keyed by the file, the tokenizer and the settings
(engine/data/token_cache.py): one rank of a node tokenizes a file, the others and later runs read its entry. `PromptDataLoader` walks it in a per-epoch order
that depends only on (seed, epoch), and its `state_dict()` ({epoch, offset}) lets a resumed run see exactly the
batches the interrupted run would have seen.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from tripod.engine.data.token_cache import cached_token_ids


def _read_rows(path: str, required: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of a prompt file: parquet, or JSON lines (`.jsonl`: one row per line, the same fields; what the
    offline GPU check writes, so its bundle needs no pyarrow)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path} does not exist; check data.train_files / data.val_files "
                                "(scripts/preprocess_gsm8k.py and scripts/make_arithmetic_data.py write them)")
    if path.endswith(".jsonl"):
        return _read_jsonl(path, required)
    return _read_parquet(path, required)


def _read_jsonl(path: str, required: Sequence[str]) -> list[dict[str, Any]]:
    import json

    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"data file {path} line {n} is not JSON ({e})") from None
    if not rows:
        raise ValueError(f"data file {path} is empty (0 rows); regenerate it or drop it from the file list")
    for column in required:
        top, _, sub = column.partition(".")
        if top not in rows[0] or (sub and not (isinstance(rows[0][top], dict) and sub in rows[0][top])):
            raise ValueError(f"data file {path} has no field '{column}' in its first row; its fields are "
                             f"{sorted(rows[0])}. Write verl's layout (prompt, data_source, reward_model.ground_truth)")
    return rows


def _read_parquet(path: str, required: Sequence[str]) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"data file {path} is not a readable parquet file ({e})") from None
    present = table.column_names
    for column in required:
        top = column.split(".")[0]
        if top not in present:
            raise ValueError(f"data file {path} has no column '{column}'; its columns are {present}. "
                             "Write it with verl's layout (prompt, data_source, reward_model.ground_truth) or "
                             "point data.prompt_key / data.reward_fn_key at the right columns")
        if "." in column:
            sub = column.split(".", 1)[1]
            kind = table.schema.field(top).type
            if not pa.types.is_struct(kind) or kind.get_field_index(sub) < 0:
                raise ValueError(f"data file {path}: column '{top}' must be a struct with field '{sub}' "
                                 f"(column '{column}'); it has type {kind}")
    if table.num_rows == 0:
        raise ValueError(f"data file {path} is empty (0 rows); regenerate it or drop it from the file list")
    return table.to_pylist()


def prompt_tools(cfg: Any) -> list[dict] | None:
    """The tool schemas the chat template renders into every prompt (verl's agent loop passes them as
    apply_chat_template's `tools`): those of actor_rollout_ref.rollout.multi_turn's tool_config_path and
    function_tool_path when multi-turn is on, else None (prompts render as without tools)."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if not (multi_turn.enable and (multi_turn.tool_config_path or multi_turn.function_tool_path)):
        return None
    from tripod.engine.agent import load_all_tools, tool_schemas

    return tool_schemas(load_all_tools(multi_turn.tool_config_path, multi_turn.function_tool_path)) or None


def _messages(prompt: Any, where: str) -> list[dict[str, Any]]:
    """A prompt as chat messages ({role, content}; a string is one user message)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "content" in m for m in prompt):
        return [{"role": m.get("role", "user"), "content": m["content"]} for m in prompt]
    raise ValueError(f"{where}: a prompt must be a string or a list of {{role, content}} messages, "
                     f"got {type(prompt).__name__}")


def _row_tools(tools: list[dict] | None, extra_info: Any) -> list[dict] | None:
    """The schemas a row's prompt lists: its extra_info.tool_selection's, in that order (verl 0.9.1; None or empty:
    all of them)."""
    selection = extra_info.get("tool_selection") if isinstance(extra_info, dict) else None
    if not tools or not selection:
        return tools
    by_name = {t["function"]["name"]: t for t in tools}
    return [by_name[n] for n in selection if n in by_name]


def _prompt_text(prompt: Any, tokenizer: Any, apply_chat_template: bool, where: str,
                 tools: list[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The text to tokenize: the chat template's rendering (with the generation prompt, `chat_template_kwargs` and,
    given, the tool schemas: a template that reads `tools` lists them, as Qwen's do in the system turn) or the raw
    content."""
    messages = _messages(prompt, where)
    if not apply_chat_template:
        return "\n".join(m["content"] for m in messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: the tokenizer has no chat template; set data.apply_chat_template=false "
                         "to tokenize the raw text, or use an instruct model's tokenizer")
    extra = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    except TypeError as e:  # e.g. a keyword of data.apply_chat_template_kwargs the template call does not take
        raise ValueError(f"{where}: apply_chat_template raised TypeError: {e}; check data.apply_chat_template_kwargs "
                         f"{sorted(chat_template_kwargs or {})}") from None


@dataclass
class PromptBatch:
    """A batch of prompts, one entry per prompt (rollout samples each `rollout.n` times)."""
    input_ids: list[list[int]]  # unpadded prompt token ids
    ground_truths: list[str]
    data_sources: list[str]
    indices: list[int]  # row position in the concatenated files: unique, stable id of the prompt (GRPO groups)
    extra_infos: list[dict[str, Any]] = field(default_factory=list)
    # each prompt's chat messages ({role, content}; the dataset's own lists, shared, not copied); None when a prompt of
    # the batch is plain text (or the batch was built without them)
    raw_prompts: list[list[dict[str, Any]]] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)


class PromptDataset:
    """Tokenized prompts of one or more parquet files.

    Item i is a dict {input_ids: list[int], ground_truth: str, data_source: str, index: int, extra_info: dict,
    raw_prompt: list[dict] | None (the chat messages; None for a plain-text prompt)}. `num_filtered` counts prompts
    dropped for being longer than `max_prompt_length`. `tools`: OpenAI function schemas handed to the chat template
    (`prompt_tools`); `chat_template_kwargs`: data.apply_chat_template_kwargs.
    """

    def __init__(self, files: str | Sequence[str], tokenizer: Any, prompt_key: str = "prompt",
                 max_prompt_length: int = 512, filter_overlong_prompts: bool = True,
                 apply_chat_template: bool = True, reward_fn_key: str = "data_source",
                 token_cache_dir: str | None = None, tools: list[dict] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> None:
        files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        if not files:
            raise ValueError("PromptDataset got no files; set data.train_files / data.val_files")
        if max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length={max_prompt_length} must be >= 1")
        self.files = [os.fspath(f) for f in files]
        self.max_prompt_length = max_prompt_length
        rows, ids = [], []
        # A chat template already renders BOS etc.; raw text gets the tokenizer's own special tokens.
        encode = lambda texts: tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"]  # noqa: E731
        settings = {"prompt_key": prompt_key, "apply_chat_template": apply_chat_template}
        if tools and apply_chat_template:
            settings["tools"] = tools  # the cache key; absent without tools, so earlier entries stay valid
        if chat_template_kwargs and apply_chat_template:
            settings["chat_template_kwargs"] = dict(sorted(chat_template_kwargs.items()))  # the key's order fixed
        for path in self.files:
            file_rows = _read_rows(path, [prompt_key, reward_fn_key, "reward_model.ground_truth"])
            no_truth = [i for i, row in enumerate(file_rows) if (row["reward_model"] or {}).get("ground_truth") is None]
            if no_truth:  # str(None) would be scored as the answer "None": reward 0 for every sample, silently
                raise ValueError(f"data file {path}: {len(no_truth)} of {len(file_rows)} rows have no "
                                 f"reward_model.ground_truth (null; first at row {no_truth[0]}); fill it in or drop "
                                 "those rows")
            rows += file_rows
            texts = lambda: [_prompt_text(row[prompt_key], tokenizer, apply_chat_template, f"{path} row {i}",  # noqa: E731
                                          _row_tools(tools, row.get("extra_info")), chat_template_kwargs)
                             for i, row in enumerate(file_rows)]
            ids += cached_token_ids(path, len(file_rows), texts, encode, tokenizer, settings, token_cache_dir)
        self.items: list[dict[str, Any]] = []
        too_long = []
        for position, (row, input_ids) in enumerate(zip(rows, ids)):
            if len(input_ids) > max_prompt_length:
                too_long.append(len(input_ids))
                if filter_overlong_prompts:
                    continue
            ground_truth = row["reward_model"]["ground_truth"]
            prompt = row[prompt_key]
            raw = None if isinstance(prompt, str) else _messages(prompt, f"row {position} of {self.files}")
            self.items.append({"input_ids": list(input_ids), "ground_truth": str(ground_truth),
                               "data_source": str(row[reward_fn_key]), "index": position,
                               "extra_info": dict(row.get("extra_info") or {}), "raw_prompt": raw})
        self.num_filtered = len(too_long) if filter_overlong_prompts else 0
        if too_long and not filter_overlong_prompts:
            raise ValueError(f"{len(too_long)} prompt(s) in {self.files} are longer than data.max_prompt_length="
                             f"{max_prompt_length} tokens (longest {max(too_long)}); raise data.max_prompt_length "
                             "or set data.filter_overlong_prompts=true")
        if not self.items:
            raise ValueError(f"every prompt is longer than data.max_prompt_length={max_prompt_length} tokens "
                             f"(shortest {min(too_long)}) in {self.files}; raise data.max_prompt_length")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]

    @property
    def data_sources(self) -> set[str]:
        """Every data source present: check it against the reward registry before training starts."""
        return {item["data_source"] for item in self.items}

    def batch(self, indices: Sequence[int]) -> PromptBatch:
        items = [self.items[i] for i in indices]
        return PromptBatch(input_ids=[it["input_ids"] for it in items],
                           ground_truths=[it["ground_truth"] for it in items],
                           data_sources=[it["data_source"] for it in items],
                           indices=[it["index"] for it in items],
                           extra_infos=[it["extra_info"] for it in items],
                           raw_prompts=None if any(it["raw_prompt"] is None for it in items)
                           else [it["raw_prompt"] for it in items])


class PromptDataLoader:
    """Batches of a `PromptDataset` in a seeded per-epoch order, resumable at batch granularity.

    `for batch in loader` yields the remaining batches of the current epoch and then moves to the next epoch, so
    the trainer loop is `for epoch in range(loader.epoch, total_epochs): for batch in loader: ...`. `state_dict()`
    after a step, restored with `load_state_dict()`, continues with exactly the next batch.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, shuffle: bool = True, seed: int = 1,
                 drop_last: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1 (data.train_batch_size / data.val_batch_size)")
        if drop_last and batch_size > len(dataset):
            raise ValueError(f"data.train_batch_size={batch_size} is larger than the {len(dataset)} prompts of "
                             f"{dataset.files} (after filtering); use a smaller batch or more data")
        self.dataset, self.batch_size, self.shuffle, self.seed, self.drop_last = (
            dataset, batch_size, shuffle, seed, drop_last)
        self.epoch = 0
        self.offset = 0  # batches of `epoch` already handed out

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch`: a function of (seed, epoch) only."""
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def _roll_over(self) -> None:
        if self.offset >= len(self):
            self.epoch, self.offset = self.epoch + 1, 0

    def __iter__(self) -> Iterator[PromptBatch]:
        self._roll_over()
        epoch, order = self.epoch, self.epoch_order(self.epoch)
        while self.epoch == epoch and self.offset < len(self):
            start = self.offset * self.batch_size
            self.offset += 1
            yield self.dataset.batch(order[start:start + self.batch_size].tolist())
        self._roll_over()

    def state_dict(self) -> dict[str, int]:
        self._roll_over()
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "batch_size": self.batch_size,
                "num_samples": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, mine in (("seed", self.seed), ("batch_size", self.batch_size), ("num_samples", len(self.dataset))):
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume the data loader: the checkpoint has {key}={state[key]} but this run "
                                 f"has {mine}; resume with the same data files, data.seed, data.train_batch_size and "
                                 "data.gen_batch_size")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


def write_prompt_parquet(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    """Write rows in the layout above (atomically: temp file + rename); a `.jsonl` path writes JSON lines."""
    if not rows:
        raise ValueError(f"refusing to write {path}: no rows")
    for key in ("prompt", "data_source", "reward_model"):
        if key not in rows[0]:
            raise ValueError(f"rows for {path} need a '{key}' field (verl's prompt parquet layout)")
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    if path.endswith(".jsonl"):
        import json

        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), tmp)
    os.replace(tmp, path)
