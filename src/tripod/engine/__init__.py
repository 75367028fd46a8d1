"""tripod engine: the PPO trainer, RL algorithms, workers, data, rewards, rollout, checkpoints, logging."""
