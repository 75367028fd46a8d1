"""Prompt data for the PPO trainer: parquet prompt datasets, a resumable loader, token batching, task generators.

    from tripod.engine.data import PromptDataset, PromptDataLoader, split_by_token_budget, unpad_input, pad_input

    ds = PromptDataset(cfg.data.train_files, tokenizer, cfg.data.prompt_key, cfg.data.max_prompt_length,
                       cfg.data.filter_overlong_prompts, cfg.data.apply_chat_template, cfg.data.reward_fn_key)
    loader = PromptDataLoader(ds, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed)
    for epoch in range(loader.epoch, cfg.trainer.total_epochs):
        for batch in loader:            # PromptBatch: input_ids, ground_truths, data_sources, indices, extra_infos
            ...
            checkpoint["data"] = loader.state_dict()   # restore with loader.load_state_dict(...)
"""
from tripod.engine.data.arithmetic import make_arithmetic_rows, make_arithmetic_splits
from tripod.engine.data.batching import (
    balanced_partition,
    packed_position_ids,
    pad_input,
    pad_sequences,
    split_by_token_budget,
    unpad_input,
)
from tripod.engine.data.dataset import PromptBatch, PromptDataLoader, PromptDataset, prompt_tools, write_prompt_parquet

__all__ = ["PromptBatch", "PromptDataLoader", "PromptDataset", "prompt_tools", "write_prompt_parquet", "make_arithmetic_rows",
           "make_arithmetic_splits", "balanced_partition", "split_by_token_budget", "pad_sequences", "unpad_input",
           "pad_input", "packed_position_ids"]
