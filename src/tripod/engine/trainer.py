"""The PPO trainer: one explicit step, top to bottom, every stage timed.

    rollout (hybrid engine: reshard -> generate -> back) -> rewards (+ DAPO's overlong shaping and dynamic
    sampling: engine/algorithms/dynamic_sampling.py) -> old log-probs (actor, or the rollout's: bypass_mode) -> ref
    log-probs -> values (critic) -> KL in reward -> rollout correction (engine/algorithms/rollout_correction.py)
    -> advantages -> critic update -> actor update -> log / checkpoint

Every rank runs this same code; each model runs on its own parallel layout (parallel/layout.py). The batch holds
only the rows this rank's DP rank updates where the step allows it (engine/workers/row_shards.py), else every row
(workers take their DP rows). Critic-free estimators (grpo, rloo, reinforce++) skip the
critic entirely; the reference model is only built when a KL term needs it, the reward model
(engine/workers/reward_model.py) only when reward_model.enable. The trainer's state across steps (checkpoint,
resume, the divergence guard's rollback) is engine/trainer_state.py's.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist

from tripod.engine.algorithms import apply_kl_penalty, build_kl_controller
from tripod.engine.algorithms.dynamic_sampling import DynamicSampler
from tripod.engine.algorithms.rollout_correction import correct_batch
from tripod.engine.async_rollout.schedule import StalenessSchedule
from tripod.engine.async_rollout.source import ColocatedRollout, QueuedRollout, dump_rollout
from tripod.engine.checkpoints import CheckpointManager
from tripod.engine.config import TripodConfig, save_resolved_config
from tripod.engine.config_loading import config_to_dict
from tripod.engine.data import PromptBatch, PromptDataLoader, PromptDataset, prompt_tools
from tripod.engine.data.token_cache import resolve_cache_dir
from tripod.engine.device import DeviceGuard, check_devices_enabled, current_device, freeze_long_lived_objects
from tripod.engine.divergence_guard import DivergenceGuard
from tripod.engine.logging import StepProfiler, Timer, Tracker
from tripod.engine.offload import flags_of, manager_for
from tripod.engine.precision import rollout_dtype
from tripod.engine.rewards import RewardPool, registered_data_sources
from tripod.engine.rewards.overlong import OverlongShaper
from tripod.engine.rewards.replica_scoring import pool_workers, score_where_generated
from tripod.engine.rollout import SamplingParams, make_rollout_engine
from tripod.engine.rollout.factory import describe_stops, engine_kwargs, step_sampling_params
from tripod.engine.rollout.routing_record import attach_rollout_routing
from tripod.engine.rollout.weight_sync import WeightSync
from tripod.engine.throughput import PerfCounter
from tripod.engine.trainer_state import TrainerState
from tripod.engine.validation import validate
from tripod.engine.workers.batch import batch_metrics, response_span
from tripod.engine.workers.model_options import layout_of, model_options, reference_pass
from tripod.engine.workers.ppo_workers import CriticWorker, PolicyWorker
from tripod.engine.workers.reward_model import build_reward_model, combine_rewards
from tripod.engine.workers.row_shards import StepRows, step_advantages, step_batch
from tripod.parallel.arch import arch_from_hf
from tripod.parallel.hybrid_engine.engine import HybridEngine
from tripod.parallel.router_replay import routed, stage_metrics


class PPOTrainer(TrainerState):
    def __init__(self, cfg: TripodConfig, placement=None):
        """`placement` (engine/async_rollout/bridge.py): this trainer rank's side of a world split with the rollout's
        own ranks; None: the rollout is colocated."""
        from transformers import AutoTokenizer

        self.cfg, self.rank, self.world = cfg, dist.get_rank(), dist.get_world_size()
        if cfg.trainer.threads_per_rank > 0:  # resolved before the ranks started (preflight.resolve_threads)
            torch.set_num_threads(cfg.trainer.threads_per_rank)
        self.device = current_device()  # chosen once per rank by engine/device.py (trainer.device, LOCAL_RANK)
        arc, actor_cfg = cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor
        path = arc.model.path
        self.arch = arch_from_hf(path)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.data.tokenizer or path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

        # data and rewards first: bad data stops the run before any model is built
        ds_args = dict(tokenizer=self.tokenizer, prompt_key=cfg.data.prompt_key,
                       max_prompt_length=cfg.data.max_prompt_length,
                       filter_overlong_prompts=cfg.data.filter_overlong_prompts,
                       apply_chat_template=cfg.data.apply_chat_template, reward_fn_key=cfg.data.reward_fn_key,
                       token_cache_dir=resolve_cache_dir(cfg.data.token_cache_dir), tools=prompt_tools(cfg))
        self.train_set = PromptDataset(cfg.data.train_files, **ds_args)
        self.val_set = PromptDataset(cfg.data.val_files, **ds_args) if cfg.data.val_files else None
        self.loader = PromptDataLoader(self.train_set, cfg.data.gen_batch_size, cfg.data.shuffle, cfg.data.seed)
        sources = self.train_set.data_sources | (self.val_set.data_sources if self.val_set else set())
        if cfg.reward_model.enable:  # the reward model scores the rows whose data source has no rule function
            sources &= set(registered_data_sources())
        # every rollout replica's first rank scores its own rows (engine/rewards/replica_scoring.py); the pool starts
        # its workers on first use, so the other ranks start none
        self.rewards = RewardPool(pool_workers(cfg.reward_model.num_workers, cfg.trainer.n_gpus_per_node,
                                               arc.rollout.tensor_model_parallel_size), cfg.reward_model.timeout_s,
                                  cfg.reward_model.use_ray, data_sources=sources)

        algo = cfg.algorithm
        self.sampler = DynamicSampler(algo.filter_groups, cfg.data.train_batch_size, arc.rollout.n,
                                      draw=lambda: next(iter(self.loader)),
                                      shaper=OverlongShaper(cfg.reward_model.overlong_buffer, arc.rollout.response_length))
        self.use_critic, self.use_ref = cfg.uses_critic, cfg.uses_reference
        self.kl_ctrl = build_kl_controller(algo.kl_ctrl.type, algo.kl_ctrl.kl_coef, algo.kl_ctrl.target_kl,
                                           algo.kl_ctrl.horizon, warmup_steps=algo.kl_ctrl.warmup_steps)

        self.total_steps = cfg.trainer.total_training_steps or len(self.loader) * cfg.trainer.total_epochs
        # optimizer steps of the run, for the LR schedules: one per mini-batch per PPO epoch of every step that
        # updates the model (the actor sits out the critic warm-up)
        updates = lambda m: m.ppo_epochs * (cfg.data.train_batch_size // m.ppo_mini_batch_size)  # noqa: E731
        actor_layout = layout_of(actor_cfg.megatron, "actor", self.arch)
        self.actor = PolicyWorker("actor", self.arch, actor_layout, path, seed=actor_cfg.megatron.seed,
                                  optim=actor_cfg.optim, grad_clip=actor_cfg.grad_clip,
                                  share_prompt_prefix=actor_cfg.share_prompt_prefix,
                                  remove_padding=arc.model.use_remove_padding,
                                  routing_replay=actor_cfg.router_replay.mode != "disabled"
                                  or arc.rollout.enable_rollout_routing_replay,  # R2 / R3, or the mismatch metric
                                  total_steps=max(self.total_steps - cfg.trainer.critic_warmup, 1) * updates(actor_cfg),
                                  **model_options(actor_cfg.megatron, actor_layout, "actor_rollout_ref.actor",
                                                   self.arch, True, actor_cfg.optim.optimizer, arc.model.lora))
        ref_layout = layout_of(arc.ref.megatron, "reference", self.arch)
        self.ref = (PolicyWorker("reference", self.arch, ref_layout, path, trainable=False, seed=arc.ref.megatron.seed,
                                 share_prompt_prefix=actor_cfg.share_prompt_prefix,
                                 routing_replay=actor_cfg.router_replay.mode == "R3",
                                 remove_padding=arc.model.use_remove_padding,
                                 **model_options(arc.ref.megatron, ref_layout, "actor_rollout_ref.ref", self.arch,
                                                  False)) if self.use_ref and not arc.model.lora.rank else None)
        critic_layout = layout_of(cfg.critic.megatron, "critic", self.arch)
        self.critic = (CriticWorker("critic", self.arch, critic_layout, cfg.critic.model.path, value_head=True,
                                    seed=cfg.critic.megatron.seed, optim=cfg.critic.optim,
                                    grad_clip=cfg.critic.grad_clip, total_steps=self.total_steps * updates(cfg.critic),
                                    share_prompt_prefix=cfg.critic.share_prompt_prefix,
                                    remove_padding=cfg.critic.model.use_remove_padding,
                                    **model_options(cfg.critic.megatron, critic_layout, "critic", self.arch, True,
                                                     cfg.critic.optim.optimizer, cfg.critic.model.lora))
                       if self.use_critic else None)
        self.reward_model = build_reward_model(cfg.reward_model, self.pad_id, self.tokenizer) if cfg.reward_model.enable else None

        # host offload between phases (engine/offload.py): moves on CUDA, recorded only on CPU
        self.offload = manager_for({"actor": self.actor, "critic": self.critic, "reference": self.ref}, {
            "actor": flags_of(actor_cfg.megatron, True), "critic": flags_of(cfg.critic.megatron, True),
            "reference": flags_of(arc.ref.megatron, False, arc.ref.offload)}, self.device)
        rollout = arc.rollout
        gen_dtype = rollout_dtype(rollout.dtype, self.device)
        # rollout TP groups ordered for locality (parallel/hybrid_engine/regroup.py) only where the engine takes an
        # explicit slice order (embedded); vLLM / SGLang put slice j on the group's j-th rank
        self.hybrid = HybridEngine(self.arch, actor_layout, rollout.tensor_model_parallel_size, dtype=gen_dtype,
                                   vpp=actor_cfg.megatron.virtual_pipeline_model_parallel_size,
                                   local_order=rollout.name == "embedded")
        # with the rollout on its own ranks this engine only validates
        engine = make_rollout_engine(rollout.name, self.arch, self.hybrid.rollout_tp_group,
                                     **engine_kwargs(cfg, self.pad_id, gen_dtype, self.device,
                                                     self.hybrid.rollout_tp_order))
        if rollout.name == "embedded":
            engine.decode_threads = rollout.decode_threads
            engine.record_routing = rollout.enable_rollout_routing_replay  # each token's experts (R3, the metric)
        if self.rank == 0:
            print(describe_stops(self.arch, rollout), flush=True)
        self.weight_sync = WeightSync(self.hybrid, engine, self.actor.model)  # owns resume/load/generate/release
        # where each step's scored batch comes from: this engine now, or the rollout ranks' queue
        self.source = ColocatedRollout(self) if placement is None else \
            QueuedRollout(self, placement, StalenessSchedule(cfg.async_training.staleness_threshold,
                                                             cfg.async_training.trigger_parameter_sync_step,
                                                             self.total_steps))
        if placement is not None and self.rank == 0:
            print(self.source.schedule.describe(), flush=True)

        self.run_dir = cfg.trainer.default_local_dir
        self.ckpt = CheckpointManager(os.path.join(self.run_dir, "checkpoints"), self.arch, path,
                                      keep={"actor": cfg.trainer.max_actor_ckpt_to_keep,
                                            "critic": cfg.trainer.max_critic_ckpt_to_keep})
        self.perf = PerfCounter(self.arch, self.world)
        self.guard = DivergenceGuard(cfg.trainer.divergence_guard, actor_cfg, algo.kl_ctrl.target_kl, self.ckpt.root)
        if self.rank == 0:
            self.ckpt.on_complete.append(self.guard.mark_good)  # every checkpoint saved is of an accepted step
        self.profiler = StepProfiler(self.run_dir, cfg.global_profiler.steps or (), cfg.global_profiler.tool, self.rank)
        self.val_samples: list[dict] = []  # of the last validation, for the tracker (trainer.log_val_generations)
        self.step = 0
        freeze_long_lived_objects()  # the models are built: the per-stage heap trims stop rescanning them

    # ---- rollout -----------------------------------------------------------------------------
    def sampling_params(self, validate: bool, step: int, gen_batch: int = 0) -> SamplingParams:
        """The rollout's `SamplingParams` for a training step's `gen_batch`-th generation batch (`validate=False`;
        engine/algorithms/dynamic_sampling.py) or for validation, on this rank's rollout replica."""
        return step_sampling_params(self.cfg, validate, step, gen_batch, self.hybrid.rollout_dp_rank)

    def score(self, batch: PromptBatch, responses: list[list[int]], n: int) -> tuple[list[float], dict]:
        """Rule rewards (each rollout replica's rows on its first rank's pool, exchanged as one float tensor),
        combined with the reward model's scores when it is on (every rank)."""
        payload = score_where_generated(self.rewards, self.tokenizer, batch, responses, n,
                                        self.hybrid.plan.rollout_tp_groups, self.hybrid.rollout_dp_rank,
                                        where_defined=self.reward_model is not None, agent=self.weight_sync.agent)
        rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731  prompt-major like the rollout
        if self.reward_model is None:
            return payload[0], payload[1]
        rm = self.cfg.reward_model
        model = self.reward_model.score([p + r for p, r in zip(rep(batch.input_ids), responses)],
                                        rm.micro_batch_size_per_gpu)
        scores, metrics = combine_rewards(payload[0], model, rm.combine, rm.reward_weight)
        return scores, {**payload[1], **metrics}

    # ---- one PPO step ----------------------------------------------------------------------------
    def phase(self, timer: Timer):
        """`with phase(name):` one stage of the step: its models placed for it (engine/offload.py), timed, and a
        profiler range (the timer's)."""
        @contextlib.contextmanager
        def stage(name: str):
            with timer(name):
                self.offload.enter(name)
                yield
        return stage

    def train_step(self, prompts: PromptBatch | None = None) -> dict[str, float]:
        """One PPO step on the next scored batch of `self.source` (`prompts`: the colocated rollout's prompts instead
        of the loader's next batch)."""
        cfg, timer = self.cfg, Timer(self.profiler.range)
        arc, algo = cfg.actor_rollout_ref, cfg.algorithm
        n, temperature = arc.rollout.n, arc.rollout.temperature
        bypass = algo.rollout_correction.bypass_mode
        # where the rows live, decided in the exchange from their lengths (row_shards.py); dynamic sampling (the kept
        # rows are known after scoring) and a reward model (it scores every row) keep the whole batch
        step_rows = StepRows(self.source.shards_rows and not self.sampler.enable and self.reward_model is None, n,
                             algo=algo, bypass=bypass, actor=self.actor, actor_cfg=arc.actor, critic=self.critic,
                             critic_cfg=cfg.critic, ref=self.ref)
        phase = self.phase(timer)
        with timer("step"):
            rollout, reward_metrics = self.source.next_batch(self.step, step_rows, timer, prompts)
            if cfg.trainer.rollout_data_dir and self.rank == 0:
                dump_rollout(cfg.trainer.rollout_data_dir, self.step + 1, rollout,
                             self.source.versions_of(self.step, len(rollout.responses)), self.tokenizer)
            shards = step_rows.shards  # model outputs stay on the DP rank that updates their rows
            prompts, all_scores = rollout.prompts, rollout.rewards
            batch, scores = step_batch(prompts.input_ids, prompts.indices, n, rollout.responses,
                                       rollout.rollout_log_probs, rollout.finish_reasons, all_scores,
                                       arc.rollout.response_length, self.pad_id, shards, rollout.token_codes)
            replay, moe, experts = arc.actor.router_replay.mode, self.arch.moe, rollout.routed_experts
            batch, rollout = batch.to(self.device), None  # the rollout's rows live on in the batch only
            routing_bytes = attach_rollout_routing(  # the rollout's experts per token, laid out as the rows
                batch, experts, shards.rows if shards is not None else range(batch.size), moe) \
                if arc.rollout.enable_rollout_routing_replay and moe is not None else None
            mask = batch["response_mask"]
            with timer("reward"):
                token_rewards = torch.zeros_like(mask)
                last = (response_span(mask) - 1).clamp(min=0)  # a multi-turn row's last model token
                token_rewards[torch.arange(batch.size, device=self.device), last] = torch.tensor(
                    scores, dtype=torch.float32, device=self.device)
            ro, ref, critic = arc.rollout, arc.ref, cfg.critic  # micro-batches: rows, or a token budget (dynamic bsz)
            if bypass:  # verl's bypass mode: the rollout's log-probs are the old ones, nothing is recomputed
                batch["old_log_probs"] = batch["rollout_log_probs"]
            elif not self.on_policy_update(len(all_scores)):  # else the update takes them from its own forward
                with phase("old_log_prob"), routed(self.actor, batch, "old", replay):  # R2 records, R3 replays
                    batch["old_log_probs"], _ = self.actor.compute_log_probs(
                        batch, ro.log_prob_micro_batch_size_per_gpu or batch.size, temperature,
                        token_budget=ro.log_prob_max_token_len_per_gpu if ro.log_prob_use_dynamic_bsz else None)
            if self.use_ref:  # with LoRA: the actor with its adapters off (no reference model)
                ref_model = self.ref or self.actor
                with phase("ref"), routed(ref_model, batch, "ref", replay), reference_pass(self.actor, self.ref):
                    batch["ref_log_probs"], _ = ref_model.compute_log_probs(
                        batch, ref.log_prob_micro_batch_size_per_gpu or batch.size, temperature,
                        token_budget=ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None)
            if self.critic is not None:
                with phase("values"):
                    batch["values"] = self.critic.compute_values(
                        batch, critic.ppo_micro_batch_size_per_gpu or batch.size,
                        token_budget=critic.forward_max_token_len_per_gpu if critic.use_dynamic_bsz else None)
            metrics = dict(reward_metrics)
            metrics.update(stage_metrics(self.actor))  # moe/routing_mismatch_frac (rollout vs the old-log-prob pass)
            if routing_bytes is not None:
                metrics["moe/routed_experts_bytes"] = float(routing_bytes)  # this rank's rows
            updates = True  # False when rollout correction rejected every row: the step then updates nothing
            with timer("adv"):
                if algo.use_kl_in_reward:
                    token_rewards, kl = apply_kl_penalty(token_rewards, batch["old_log_probs"], batch["ref_log_probs"],
                                                         mask, self.kl_ctrl.value, algo.kl_penalty,
                                                         **({} if shards is None else {"mean": shards.masked_mean}))
                    metrics.update({"actor/reward_kl_penalty": float(kl), "actor/reward_kl_penalty_coeff":
                                    self.kl_ctrl.value})
                    self.kl_ctrl.update(float(kl), n_steps=cfg.data.train_batch_size)
                batch["token_rewards"] = token_rewards
                scored = mask  # rejected rows keep their scores in their groups' statistics, as verl's
                if batch.recomputed_old_log_probs and not bypass and "rollout_log_probs" in batch.tensors:
                    corr, kept = correct_batch(batch, algo.rollout_correction, shards)  # may reject sequences
                    metrics.update(corr)
                    mask, updates = batch["response_mask"], kept > 0
                adv, ret = step_advantages(algo, token_rewards, mask, batch, all_scores, shards, scored) if updates \
                    else (torch.zeros_like(token_rewards),) * 2
                batch["advantages"], batch["returns"] = adv, ret
            if self.critic is not None and updates:
                with phase("update_critic"):
                    metrics.update(self.critic.update(batch, cfg.critic, n))
            if self.step >= cfg.trainer.critic_warmup and updates:
                # without a recompute, the rollout / train gap is measured on the update's first forward
                gap = "rollout_log_probs" in batch.tensors and (bypass or not batch.recomputed_old_log_probs)
                with phase("update_actor"), routed(self.actor, batch, "update", replay):
                    metrics.update(self.actor.update(batch, arc.actor, temperature, n, rollout_gap=gap))
                metrics.update(stage_metrics(self.actor))  # the mismatch where no old-log-prob pass ran
        timings = timer.metrics()
        metrics.update(batch_metrics(batch, all_scores, shards))
        metrics.update(timings)
        metrics.update(self.perf.metrics(batch.lengths, timings, arc.actor.ppo_epochs,
                                         recomputed_old_log_probs=batch.recomputed_old_log_probs and not bypass,
                                         shared_prompts=self.actor.share_prompt_prefix and self.actor.can_pack))
        return metrics

    def checked_train_step(self) -> dict[str, float]:
        """`train_step`, under engine.device.DeviceGuard when TRIPOD_CHECK_DEVICES=1 (fails on a stray tensor)."""
        if not check_devices_enabled():
            return self.train_step()
        with DeviceGuard(self.device) as guard:
            metrics = self.train_step()
        if guard.violations:
            raise RuntimeError(f"step {self.step}: tensors off the chosen device {self.device}: {guard.report()}")
        if self.rank == 0:
            print(f"DEVICE_CHECK step={self.step} device={self.device} ops_off_device=0", flush=True)
        return metrics

    def on_policy_update(self, rows: int) -> bool:
        """True when the actor update is exactly on-policy: one epoch of one mini-batch, with the weights that
        generated the rollout. Then the old log-probs equal the update's own forward (detached), so recomputing
        them is skipped (the ratio is exactly 1, the gradient unchanged). KL-in-reward and rollout correction need them."""
        a, algo = self.cfg.actor_rollout_ref.actor, self.cfg.algorithm
        return (a.ppo_epochs == 1 and a.ppo_mini_batch_size * self.cfg.actor_rollout_ref.rollout.n >= rows
                and not algo.use_kl_in_reward and not algo.rollout_correction.active
                and self.step >= self.cfg.trainer.critic_warmup)

    # ---- validation -----------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        return validate(self)  # engine/validation.py

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        cfg = self.cfg
        self.resume(cfg.trainer.resume)
        start_step = self.step
        self.source.start(self.step)
        if self.rank == 0:
            save_resolved_config(cfg, self.run_dir)
        tracker = Tracker(self.run_dir, cfg.trainer.logger, resume_step=self.step if self.step else None,
                          total_steps=self.total_steps, project_name=cfg.trainer.project_name,
                          experiment_name=cfg.trainer.experiment_name, config=config_to_dict(cfg)) \
            if self.rank == 0 else None
        last_val: dict[str, float] = {}
        if (self.step == 0 and cfg.trainer.val_before_train or cfg.trainer.val_only) and self.val_set is not None:
            last_val = self.validate()
            if tracker:
                tracker.log(last_val, 0)
                tracker.log_samples(self.val_samples, 0)
        while self.step < self.total_steps and not cfg.trainer.val_only:
            self.profiler.begin_step(self.step + 1)  # traces of global_profiler.steps (logging/profiler.py)
            metrics = self.guard.run_step(self.checked_train_step)
            self.step += 1
            done = self.step >= self.total_steps
            if not self.judged(metrics):  # rolled back: self.step is the last good checkpoint's
                continue
            metrics.update(self.source.updated(self.step))  # only judged weights reach the rollout's own ranks
            metrics.update(self.ckpt.poll())  # an asynchronous save every rank has written becomes visible
            if self.val_set is not None and ((cfg.trainer.test_freq > 0 and self.step % cfg.trainer.test_freq == 0)
                                             or done):
                with self.profiler.range("validation"):
                    last_val = self.validate()
                if not self.judged(last_val):  # validation reward collapsed
                    continue
                metrics.update(last_val)
            metrics["training/epoch"] = self.loader.epoch
            metrics["training/start_step"] = start_step  # where this process began: 0, or the resumed step
            if (cfg.trainer.save_freq > 0 and self.step % cfg.trainer.save_freq == 0) or done:
                with self.profiler.range("checkpoint"):
                    self.offload.enter("checkpoint")
                    start = time.perf_counter()
                    self.ckpt.save(self.step, self.state_dict(), self.trainable_workers(),
                                           asynchronous=cfg.trainer.async_save)
                    metrics["timing_s/checkpoint"] = time.perf_counter() - start  # what the step waited for
                    metrics.update(self.ckpt.poll())  # a synchronous save's own metrics
            if tracker:
                tracker.log(metrics, self.step)
                tracker.log_samples(self.val_samples if "val/reward_mean" in metrics else [], self.step)
            self.ckpt.retain()  # old checkpoints go once a newer one is complete and its step logged
        last_save = self.ckpt.wait()  # the last asynchronous save (finished after the last step's metrics)
        self.ckpt.retain()
        if last_save and self.rank == 0:
            print(f"tripod: checkpoint of step {self.step} written in {last_save['timing_s/checkpoint_write']:.1f} s", flush=True)
        self.profiler.end_step()
        self.source.close()
        if tracker:
            tracker.close()
        if self.rewards is not None:
            self.rewards.close()
        return last_val
