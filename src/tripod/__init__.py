"""tripod: a Megatron-based 3D-parallel (TP x PP x DP) engine for PPO-style RLHF.

The rooms are `tripod.engine` (training loop, workers, rollout, rewards, CLI), `tripod.parallel` (layouts, model
building, conversion, the hybrid engine, precision), `tripod.runtime` (the rank's device, memory readers, host offload)
and `tripod.kernels` (fused ops with plain-torch twins); each imports only the rooms below it (docs/layout.md). They
live here, in src/tripod, and the repository root shows them as symlinks (engine/, parallel/, runtime/, kernels/);
only `tripod` is importable once installed, so Hugging Face's hub package `kernels` can sit beside it.

Importing tripod changes nothing in megatron-core: its patches are installed by the entry points (the CLI, each
rank of a launched world, the tests' workers) through `tripod.parallel.megatron_patches.apply_megatron_patches()`.
"""
__version__ = "0.1.0"

from pathlib import Path as _Path

SRC_DIR = _Path(__file__).resolve().parent.parent
"""The directory that holds the `tripod` package (src/ in a checkout): what a second interpreter puts on sys.path."""
CHECKOUT = SRC_DIR.parent
"""The source checkout of an editable install: recipes/, scripts/ and .git live here, not in the package."""
