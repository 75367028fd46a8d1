"""`data.*`: the prompt data (verl's data section)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from tripod.engine.config.common import _positive


@dataclass
class DataConfig:
    train_files: Any = field(default_factory=list)
    """Training prompt parquet file(s): one path or a list. verl: data.train_files."""
    val_files: Any = field(default_factory=list)
    """Validation prompt parquet file(s); empty disables validation. verl: data.val_files."""
    prompt_key: str = "prompt"
    """Column holding the prompt (a chat message list or a string). verl: data.prompt_key."""
    reward_fn_key: str = "data_source"
    """Column whose value selects the rule reward function of each row (engine/rewards). verl: data.reward_fn_key."""
    max_prompt_length: int = 512
    """Longest prompt, in tokens (longer ones are filtered or refused, see filter_overlong_prompts).
    verl: data.max_prompt_length."""
    max_response_length: int = 512
    """Longest generated response, in tokens. verl: data.max_response_length."""
    train_batch_size: int = 1024
    """Prompts per PPO step (each sampled rollout.n times). verl: data.train_batch_size."""
    gen_batch_size: int = "${data.train_batch_size}"
    """Prompts drawn from the data loader per generation batch: with algorithm.filter_groups.enable, batches are
    generated until data.train_batch_size groups are kept (DAPO uses 3x the train batch); without it, it must equal
    data.train_batch_size. verl: data.gen_batch_size."""
    val_batch_size: Optional[int] = None
    """Prompts generated and scored per validation batch; null: the whole validation set at once.
    verl: data.val_batch_size."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch. verl: data.shuffle."""
    seed: int = 1
    """Seed of the training-prompt shuffle (the same on every rank and across resumes). verl: data.seed."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than max_prompt_length (false: refuse them at start). verl: data.filter_overlong_prompts."""
    apply_chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template. (verl always applies it.)"""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of every apply_chat_template call that renders the prompts (and the agent loop's tool /
    user turns), e.g. {enable_thinking: false} for Qwen3's template. verl: data.apply_chat_template_kwargs."""
    return_raw_chat: bool = True
    """verl: the dataset also hands each prompt's chat messages (raw_prompt) to the rollout; verl 0.9.1 hands them
    always. tripod keeps them always too (PromptBatch.raw_prompts: the agent loop's conversation starts with them),
    so either value runs the same. verl: data.return_raw_chat."""
    tokenizer: Optional[str] = None
    """Tokenizer directory; null: the actor model's. verl: data.tokenizer."""
    token_cache_dir: Optional[str] = ""
    """Where tokenized prompts are cached, keyed by data file, tokenizer and prompt settings, so one rank of a node
    tokenizes a file and the others (and reruns) read it (engine/data/token_cache.py). "": $XDG_CACHE_HOME (or
    ~/.cache)/tripod/prompt_tokens; null: no cache, every rank tokenizes every file."""

    def check(self, key: str = "data") -> list[str]:
        e = [] if self.train_files else [f"{key}.train_files is empty; give one or more parquet files"]
        e += _positive({f"{key}.max_prompt_length": self.max_prompt_length,
                        f"{key}.max_response_length": self.max_response_length,
                        f"{key}.train_batch_size": self.train_batch_size, f"{key}.gen_batch_size": self.gen_batch_size})
        for files_key, files in (("train_files", self.train_files), ("val_files", self.val_files)):
            e += [f"{key}.{files_key}: file {path} does not exist; point {key}.{files_key} at existing parquet files "
                  "(scripts/preprocess_gsm8k.py or scripts/make_arithmetic_data.py write them)"
                  for path in files if not os.path.isfile(os.path.expanduser(path))]
        if self.val_batch_size is not None and self.val_batch_size < 1:
            e.append(f"{key}.val_batch_size={self.val_batch_size} must be >= 1 (or null for the whole validation set)")
        return e
