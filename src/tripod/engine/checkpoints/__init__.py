"""Trainer checkpoints (atomic save, exact resume); model checkpoints themselves are parallel/checkpoint.py."""
from tripod.engine.checkpoints.manager import CheckpointManager, latest_complete

__all__ = ["CheckpointManager", "latest_complete"]
