"""Rule rewards for the PPO trainer, chosen per sample by data source.

    from tripod.engine.rewards import RewardPool, get_reward_fn, register_reward

    check_data_sources(train_dataset.data_sources)          # fail before training on an unknown data source
    with RewardPool(cfg.reward_model.num_workers, cfg.reward_model.timeout_s, cfg.reward_model.use_ray) as pool:
        scores, metrics = pool.score(responses_text, ground_truths, data_sources, extra_infos)

Built in: "openai/gsm8k" / "gsm8k" (verl's GSM8K strict rule), "arithmetic" (`#### N`, numeric compare) and
"target_char" (share of the response that is a given character: learnable from a random init).
"""
from tripod.engine.rewards import arithmetic, gsm8k, target_char  # noqa: F401  (registers the built-in rewards)
from tripod.engine.rewards.pool import RewardPool
from tripod.engine.rewards.registry import check_data_sources, get_reward_fn, register_reward, registered_data_sources

__all__ = ["RewardPool", "check_data_sources", "get_reward_fn", "register_reward", "registered_data_sources"]
