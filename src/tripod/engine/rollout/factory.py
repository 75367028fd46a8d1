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
    sequence of this run rather than the model's context; with stop strings, every backend's tokenizer directory."""
    rollout = cfg.actor_rollout_ref.rollout
    tokenizer = dict(tokenizer=cfg.data.tokenizer or cfg.actor_rollout_ref.model.path) if rollout.stop else {}
    if rollout.name == "embedded":
        return dict(pad_token_id=pad_token_id, dtype=dtype, device=device, tp_order=tp_order, **tokenizer)
    kwargs = dict(model_path=cfg.actor_rollout_ref.model.path, mem_fraction_static=rollout.mem_fraction_static,
                  dtype=str(dtype).removeprefix("torch."), **tokenizer, **rollout.engine_kwargs)
    if rollout.name == "vllm":
        kwargs.setdefault("max_model_len", cfg.data.max_prompt_length + rollout.response_length)
        lora = cfg.actor_rollout_ref.model.lora
        if lora.rank > 0 and not lora.merge:  # vLLM serves the adapters (engine/rollout/vllm_lora.py)
            kwargs["lora_rank"] = lora.rank
    if rollout.name == "sglang" and rollout.enable_rollout_routing_replay:  # each token's experts (R3)
        kwargs["enable_return_routed_experts"] = True
    return kwargs


REPLICA_SEED_STRIDE = 1 << 24  # response rows one replica's request may hold before its seeds reach the next's
REPLICA_SEED_SLOTS = 1 << 16  # rollout replicas with seeds of their own


def replica_seed(base: int, replica: int) -> int:
    """Rollout replica `replica`'s seed for a generation batch seeded by `base`. vLLM and SGLang seed response row k
    of a replica's request with seed + k, the embedded engine draws its rows from one generator of the seed: with
    `base` folded into the bits above the replica's, and replicas REPLICA_SEED_STRIDE apart, every (replica, row,
    sample) of a generation batch has its own seed (a non-negative int below 2**63, as vLLM and SGLang take)."""
    if not 0 <= replica < REPLICA_SEED_SLOTS:
        raise ValueError(f"rollout replica {replica} is outside the {REPLICA_SEED_SLOTS} replicas the seeds tell apart")
    return ((base % (1 << 23)) * REPLICA_SEED_SLOTS + replica) * REPLICA_SEED_STRIDE


def step_sampling_params(cfg, validate: bool, step: int, gen_batch: int, replica: int):
    """The rollout's `SamplingParams` for a training step's `gen_batch`-th generation batch (`validate=False`;
    engine/algorithms/dynamic_sampling.py) or for validation, on rollout replica `replica`: the seed is a function of
    (trainer.seed, step, gen_batch, replica), so a batch draws the same samples wherever and whenever it is generated
    (`replica_seed`: every replica, row and sample of it has a seed of its own)."""
    from tripod.engine.rollout.base import SamplingParams

    r = cfg.actor_rollout_ref.rollout
    kw = r.val_kwargs if validate else r
    greedy = not kw.do_sample or kw.temperature == 0
    return SamplingParams(max_new_tokens=r.response_length, temperature=0.0 if greedy else kw.temperature,
                          top_p=kw.top_p, top_k=kw.top_k, n=kw.n, greedy=greedy,
                          seed=replica_seed(cfg.trainer.seed * 1_000_003 + step * 7919 + gen_batch * 104_729, replica),
                          stop_token_ids=tuple(r.stop_token_ids), stop=tuple(r.stop))


def stop_problems(arch: ModelArch, rollout) -> list[str]:
    """Why the rollout's stop settings cannot work with this model (one line each, naming the key): stop ids outside
    the vocabulary."""
    key = "actor_rollout_ref.rollout.stop_token_ids"
    bad = [t for t in rollout.stop_token_ids if not 0 <= t < arch.vocab_size]
    return [f"{key}={list(rollout.stop_token_ids)}: {bad} outside the model's vocabulary [0, {arch.vocab_size}); "
            "list token ids of this model's tokenizer"] if bad else []


def describe_stops(arch: ModelArch, rollout) -> str:
    """One line naming every token id and string that ends a rollout response, and where each id comes from."""
    from tripod.engine.rollout.base import SamplingParams

    ids = SamplingParams(max_new_tokens=1, stop_token_ids=tuple(rollout.stop_token_ids)).stop_ids(arch)
    eos = arch.eos_token_id
    return (f"rollout stops at token ids {sorted(ids)} (config.json eos_token_id: {eos}; generation_config.json "
            f"eos_token_id: {list(arch.generation_eos_token_ids) or 'none'}; actor_rollout_ref.rollout.stop_token_ids: "
            f"{list(rollout.stop_token_ids)}) and at stop strings {list(rollout.stop)}")
