"""Tests that start processes: torchrun / gloo worlds (worker scripts in workers/), the tripod CLI, SLURM."""
