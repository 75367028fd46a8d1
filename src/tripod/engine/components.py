"""The parts a rank of a run is assembled from, built once and alike for the trainer's ranks and the rollout's own.

    parts = build_components(cfg, "trainer" | "rollout")   # tokenizer, datasets (with the prompts' tools), loader,
                                                            # reward pool, dynamic sampler: no model yet, so bad data
                                                            # stops the run before any model is built
    parts.build_rollout(replicas, device, session_of, reward_model)
                                                            # the rollout engine, the generator the steps use
                                                            # (single-turn, or the agent loop over the engine) and the
                                                            # scorer (rules, plus the reward model on the trainer)

`PPOTrainer` (engine/trainer.py) adds its megatron models, the hybrid engine and `WeightSync` (whose `loaded` is its
generator's session); `RolloutServer` (engine/async_rollout/server.py) adds the weight receiver and keeps its engine
loaded between batches. Neither builds a part of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from tripod.engine.algorithms.dynamic_sampling import DynamicSampler
from tripod.engine.rollout.generators import RolloutReplicas, Session, SingleTurnGenerator, standing_engine

Role = Literal["trainer", "rollout"]


@dataclass
class Components:
    """One rank's parts (see the module docstring); the rollout's are None until `build_rollout`."""
    cfg: Any
    arch: Any
    tokenizer: Any
    pad_id: int
    train_set: Any
    val_set: Any
    loader: Any
    pool: Any
    sampler: DynamicSampler
    engine: Any = None
    generator: Any = None
    scorer: Any = None

    def build_rollout(self, replicas: RolloutReplicas, device: torch.device,
                      session_of: Callable[[Any], Session] = standing_engine, reward_model: Any = None,
                      score_group: Any = None) -> None:
        """The rollout engine on `replicas` (this rank's TP group), the generator the steps use and the scorer.
        `session_of(engine)`: the engine with the weights to generate with (the trainer's `WeightSync.loaded`; the
        rollout's own ranks: the engine as it stands)."""
        from tripod.engine.rewards.scorer import RowScorer
        from tripod.engine.rollout import make_rollout_engine
        from tripod.engine.rollout.factory import engine_kwargs
        from tripod.parallel.precision import rollout_dtype

        cfg, rollout = self.cfg, self.cfg.actor_rollout_ref.rollout
        engine = make_rollout_engine(rollout.name, self.arch, replicas.group,
                                     **engine_kwargs(cfg, self.pad_id, rollout_dtype(rollout.dtype, device), device,
                                                     replicas.tp_order))
        recording = bool(rollout.enable_rollout_routing_replay and self.arch.moe is not None)
        if rollout.name == "embedded":
            engine.decode_threads = rollout.decode_threads
            engine.record_routing = rollout.enable_rollout_routing_replay  # each token's experts (R3, the metric)
        session = session_of(engine)
        routing_of = self.arch.moe if recording and getattr(engine, "record_routing", False) else None
        if rollout.multi_turn.enable:
            from tripod.engine.agent.rollout import build_agent

            generator = build_agent(cfg, self.tokenizer, engine, replicas, session, routing_of)
        else:
            generator = SingleTurnGenerator(engine, replicas, session, routing_of)
        self.engine, self.generator = engine, generator
        self.scorer = RowScorer(self.pool, self.tokenizer, replicas, where_defined=cfg.reward_model.enable,
                                reward_model=reward_model, rm_cfg=cfg.reward_model, group=score_group)


def build_components(cfg: Any, role: Role) -> Components:
    """Tokenizer, datasets, loader, reward pool and dynamic sampler of `role` (see the module docstring)."""
    from transformers import AutoTokenizer

    from tripod.engine.data import PromptDataLoader, PromptDataset, prompt_tools
    from tripod.engine.data.token_cache import resolve_cache_dir
    from tripod.engine.rewards import RewardPool, registered_data_sources
    from tripod.engine.rewards.overlong import OverlongShaper
    from tripod.engine.rewards.replica_scoring import pool_workers
    from tripod.parallel.arch import arch_from_hf

    arc, d = cfg.actor_rollout_ref, cfg.data
    path = arc.model.path
    arch = arch_from_hf(path)
    tokenizer = AutoTokenizer.from_pretrained(d.tokenizer or path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ds_args = dict(tokenizer=tokenizer, prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                   filter_overlong_prompts=d.filter_overlong_prompts, apply_chat_template=d.apply_chat_template,
                   reward_fn_key=d.reward_fn_key, token_cache_dir=resolve_cache_dir(d.token_cache_dir),
                   tools=prompt_tools(cfg), chat_template_kwargs=dict(d.apply_chat_template_kwargs or {}))
    train_set = PromptDataset(d.train_files, **ds_args)
    # the rollout's own ranks generate training batches only: the trainer validates
    val_set = PromptDataset(d.val_files, **ds_args) if d.val_files and role == "trainer" else None
    loader = PromptDataLoader(train_set, d.gen_batch_size, d.shuffle, d.seed)
    sources = train_set.data_sources | (val_set.data_sources if val_set else set())
    if cfg.reward_model.enable:  # the reward model scores the rows whose data source has no rule function
        sources &= set(registered_data_sources())
    # every rollout replica's first rank scores its own rows (engine/rewards/replica_scoring.py); the pool starts
    # its workers on first use, so the other ranks start none
    gpus = cfg.trainer.n_gpus_per_node if role == "trainer" else cfg.rollout.n_gpus_per_node
    pool = RewardPool(pool_workers(cfg.reward_model.num_workers, gpus, arc.rollout.tensor_model_parallel_size),
                      cfg.reward_model.timeout_s, cfg.reward_model.use_ray, data_sources=sources)
    sampler = DynamicSampler(cfg.algorithm.filter_groups, d.train_batch_size, arc.rollout.n,
                             draw=lambda: next(iter(loader)),
                             shaper=OverlongShaper(cfg.reward_model.overlong_buffer, arc.rollout.response_length))
    return Components(cfg, arch, tokenizer, pad_id, train_set, val_set, loader, pool, sampler)
