"""How much of each row's response a model pass lays out: shared by the packed layouts (engine/workers/packing.py),
routing replay's token map (parallel/router_replay.py) and the trainer's last-token reads."""
from __future__ import annotations

import torch


def response_span(response_mask: torch.Tensor) -> torch.Tensor:
    """[N] int64: each row's response tokens up to its last counted one (its mask's sum when the counted tokens are
    contiguous from the start; a multi-turn row's mask has holes, and tokens after its last counted one, a tool turn
    the budget cut, predict nothing trained). What a packed layout lays out of each response."""
    counted = response_mask > 0
    last = counted.shape[-1] - counted.flip(-1).to(torch.int8).argmax(-1)
    return torch.where(counted.any(-1), last, torch.zeros_like(last)).long()
