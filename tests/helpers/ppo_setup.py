"""A complete tiny PPO setup made offline (a random checkpoint with the character tokenizer, arithmetic prompt files,
a tiny run's overrides, a random PPO batch): defined in tripod/engine/data/tiny_ppo.py, which scripts/ use too."""
from tripod.engine.data.tiny_ppo import make_ppo_setup, random_ppo_batch, tiny_overrides  # noqa: F401
