"""Helpers shared by tripod's tests and their torchrun worker scripts: tiny HF checkpoints, gloo worlds, PPO setups,
training runs compared within the arithmetic's bounds. Imported as `tests.helpers.<module>` (the repository root is
on sys.path through pytest.ini's `pythonpath`, and on PYTHONPATH for launched workers)."""
