"""Reward-model training (`tripod train-rm`): config schema, preference data, the Bradley-Terry loop."""
