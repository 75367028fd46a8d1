"""`make_rollout_engine`: picks a rollout backend by name (kept apart from base.py, which backends import)."""
from __future__ import annotations

from typing import Any

from tripod.engine.rollout.base import ROLLOUT_NAMES, RolloutEngine, tp_size_and_rank, validate_rollout_tp
from tripod.parallel.arch import ModelArch


def make_rollout_engine(name: str, arch: ModelArch, tp_group: Any = None, **kwargs: Any) -> RolloutEngine:
    """Build the rollout backend called `name` ("embedded", "sglang" or "vllm") for this TP group.

    Errors (unknown name, sglang / vllm not installed, bad TP size, a model vLLM cannot run) are raised here,
    before any weights move.
    """
    if name not in ROLLOUT_NAMES:
        raise ValueError(f"rollout.name={name!r} is not a rollout backend; set actor_rollout_ref.rollout.name "
                         f"to one of {list(ROLLOUT_NAMES)}")
    validate_rollout_tp(arch, tp_size_and_rank(tp_group)[0])
    if name == "embedded":
        from tripod.engine.rollout.embedded import EmbeddedRolloutEngine

        return EmbeddedRolloutEngine(arch, tp_group, **kwargs)
    if name == "vllm":
        from tripod.engine.rollout.vllm_engine import VLLMRolloutEngine, require_vllm

        require_vllm(arch, tp_size_and_rank(tp_group)[0])
        return VLLMRolloutEngine(arch, tp_group, **kwargs)
    from tripod.engine.rollout.sglang_engine import SGLangRolloutEngine, require_sglang

    require_sglang()
    return SGLangRolloutEngine(arch, tp_group, **kwargs)
