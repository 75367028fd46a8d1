"""A complete tiny PPO setup made offline: a random checkpoint (engine/data/tiny_models.py) with the character-level
tokenizer (chat template, EOS) saved beside it, arithmetic prompt files, the `tripod train` overrides of a tiny run,
and a random PPO batch for the worker-level update checks. What the trainer tests, scripts/bench_memory.py and the GPU
check's steps run."""
from __future__ import annotations

import os
from typing import Any

from tripod.engine.data.char_tokenizer import char_tokenizer
from tripod.engine.data.tiny_models import make_tiny_hf_model, make_tiny_moe_model


def make_ppo_setup(tmp_path: str | os.PathLike, *, family: str = "qwen2", n_train: int = 32, n_val: int = 8,
                   data_suffix: str = ".parquet", max_digits: int = 1, **model_overrides: Any) -> dict[str, str]:
    """{'model': dir, 'train': parquet, 'val': parquet} (`data_suffix=".jsonl"`: JSON lines); prompts are short
    arithmetic questions. `family`: llama / qwen2 (`make_tiny_hf_model`) or an MoE family (`make_tiny_moe_model`:
    qwen3_moe, qwen2_moe, deepseek_v3). `max_digits` 2 gives prompts of different lengths (1: all the same length)."""
    from tripod.engine.data import make_arithmetic_rows, write_prompt_parquet

    overrides = dict(max_position_embeddings=256, vocab_size=128)
    overrides.update(model_overrides)
    if family in ("llama", "qwen2"):
        model = make_tiny_hf_model(tmp_path, family, **overrides)
    else:
        model = make_tiny_moe_model(tmp_path, family, **overrides)
    char_tokenizer().save_pretrained(model)
    instruction = "Answer as #### N."
    paths = {"model": model}
    for split, count, seed in (("train", n_train, 0), ("val", n_val, 1)):
        rows = make_arithmetic_rows(count, seed=seed, max_digits=max_digits, instruction=instruction, split=split)
        paths[split] = os.path.join(str(tmp_path), f"{split}{data_suffix}")
        write_prompt_parquet(rows, paths[split])
    return paths


def tiny_overrides(setup: dict[str, str], run_dir: str, world: int = 1, tp: int = 1, pp: int = 1,
                   steps: int = 2) -> list[str]:
    """`tripod train recipes/defaults.yaml` overrides of a tiny GAE run of `steps` steps on `setup`
    (`make_ppo_setup`), `world` ranks, the actor at TP x PP, writing to `run_dir`."""
    return [
        f"data.train_files={setup['train']}", f"data.val_files={setup['val']}",
        "data.max_prompt_length=64", "data.max_response_length=8", "data.train_batch_size=4", "data.shuffle=false",
        f"actor_rollout_ref.model.path={setup['model']}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.temperature=1.0",
        "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k3",
        f"trainer.total_training_steps={steps}", f"trainer.n_gpus_per_node={world}",
        f"trainer.default_local_dir={run_dir}", "trainer.logger=[jsonl,tensorboard]", "trainer.resume=disable",
    ]


def random_ppo_batch(vocab_size: int, n: int = 8, resp_len: int = 6, seed: int = 11):
    """Fresh random prompts (4-8 tokens) and responses (2..resp_len tokens) with random advantages, the same on every
    rank: the batch the worker-level update checks feed straight to the workers. Returns (batch, prompts,
    responses, generator) so a caller can draw more from the same stream."""
    import torch

    from tripod.engine.workers.batch import build_ppo_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab_size, (int(k),), generator=g).tolist()
               for k in torch.randint(4, 9, (n,), generator=g)]
    responses = [torch.randint(3, vocab_size, (int(k),), generator=g).tolist()
                 for k in torch.randint(2, resp_len + 1, (n,), generator=g)]
    batch = build_ppo_batch(prompts, responses, resp_len, 0, list(range(n)))
    batch["advantages"] = torch.randn(n, resp_len, generator=g) * batch["response_mask"]
    return batch, prompts, responses, g
