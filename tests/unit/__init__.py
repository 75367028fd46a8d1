"""In-process tests: one Python process, no torch.distributed world and no launched command."""
