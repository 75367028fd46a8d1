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


def engine_kwargs(cfg, pad_token_id: int, dtype, device, tp_order: list[int] | None) -> dict[str, Any]:
    """`make_rollout_engine`'s keyword arguments from a `TripodConfig`: the embedded engine's pad id, dtype, device and
    TP slice order; vLLM's / SGLang's model path, memory share and dtype, with vLLM's KV cache sized for the longest
    sequence of this run rather than the model's context."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "embedded":
        return dict(pad_token_id=pad_token_id, dtype=dtype, device=device, tp_order=tp_order)
    kwargs = dict(model_path=cfg.actor_rollout_ref.model.path, mem_fraction_static=rollout.mem_fraction_static,
                  dtype=str(dtype).removeprefix("torch."), **rollout.engine_kwargs)
    if rollout.name == "vllm":
        kwargs.setdefault("max_model_len", cfg.data.max_prompt_length + rollout.response_length)
    return kwargs


def step_sampling_params(cfg, validate: bool, step: int, gen_batch: int, replica: int):
    """The rollout's `SamplingParams` for a training step's `gen_batch`-th generation batch (`validate=False`;
    engine/algorithms/dynamic_sampling.py) or for validation, on rollout replica `replica`: the seed is a function of
    (trainer.seed, step, gen_batch, replica), so a batch draws the same samples wherever and whenever it is generated."""
    from tripod.engine.rollout.base import SamplingParams

    r = cfg.actor_rollout_ref.rollout
    kw = r.val_kwargs if validate else r
    greedy = not kw.do_sample or kw.temperature == 0
    return SamplingParams(max_new_tokens=r.response_length, temperature=0.0 if greedy else kw.temperature,
                          top_p=kw.top_p, top_k=kw.top_k, n=kw.n, greedy=greedy,
                          seed=cfg.trainer.seed * 1_000_003 + step * 7919 + gen_batch * 104_729 + replica)
