"""The PPO trainer: one explicit step, top to bottom, every stage timed.

    rollout (engine/async_rollout/source.py: reshard -> generate -> score here, or the rollout ranks' queue)
    -> old log-probs (actor, the rollout's under bypass_mode, or none when exactly on-policy) -> ref log-probs
    -> values (critic) -> KL in reward -> rollout correction -> advantages -> critic update -> actor update

What a step does is decided once for the run (`StepPlan`, engine/step_plan.py, printed at start); the parts the
trainer is assembled from (tokenizer, data, rewards, rollout engine, generator, scorer) are engine/components.py's,
shared with the rollout's own ranks. Every rank runs this same code; each model runs on its own parallel layout
(parallel/layout.py). The batch holds only the rows this rank's DP rank updates where the plan allows it
(engine/workers/row_shards.py), else every row (workers take their DP rows). The reference model is only built when
a KL term needs it, the critic only for GAE, the reward model (engine/workers/reward_model.py) only when
reward_model.enable. The trainer's state across steps (checkpoint, resume, the divergence guard's rollback) is
engine/trainer_state.py's.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist

from tripod.engine.algorithms import apply_kl_penalty, build_kl_controller
from tripod.engine.algorithms.rollout_correction import correct_batch
from tripod.engine.async_rollout.schedule import StalenessSchedule
from tripod.engine.async_rollout.source import ColocatedRollout, QueuedRollout, dump_rollout
from tripod.engine.checkpoints import CheckpointManager
from tripod.engine.components import build_components
from tripod.engine.config import TripodConfig, save_resolved_config
from tripod.engine.config_loading import config_to_dict
from tripod.engine.data import PromptBatch
from tripod.engine.divergence_guard import DivergenceGuard
from tripod.engine.logging import StepProfiler, Timer, Tracker
from tripod.engine.rollout import SamplingParams
from tripod.engine.rollout.factory import describe_stops, step_sampling_params
from tripod.engine.rollout.generators import RolloutReplicas
from tripod.engine.rollout.routing_record import attach_rollout_routing
from tripod.engine.rollout.rows import Rollout
from tripod.engine.rollout.weight_sync import WeightSync
from tripod.engine.step_plan import StepPlan
from tripod.engine.throughput import PerfCounter
from tripod.engine.trainer_state import TrainerState
from tripod.engine.validation import validate
from tripod.engine.workers.batch import PPOBatch, batch_metrics
from tripod.engine.workers.model_options import layout_of, model_options, reference_pass
from tripod.engine.workers.ppo_workers import CriticWorker, PolicyWorker
from tripod.engine.workers.reward_model import build_reward_model
from tripod.engine.workers.row_shards import RowShards, StepRows, step_advantages, step_batch
from tripod.parallel.hybrid_engine.engine import HybridEngine
from tripod.parallel.precision import rollout_dtype
from tripod.parallel.response_span import response_span
from tripod.parallel.router_replay import routed, stage_metrics
from tripod.runtime.device import DeviceGuard, check_devices_enabled, current_device, freeze_long_lived_objects
from tripod.runtime.offload import flags_of, manager_for


def sequence_rewards_at_last_token(batch: PPOBatch, rewards: list[float]) -> torch.Tensor:
    """[rows, response] token rewards: each row's sequence reward on its last model token (a multi-turn row's last
    model token may sit before tool or user tokens), 0 elsewhere."""
    mask = batch["response_mask"]
    out = torch.zeros_like(mask)
    last = (response_span(mask) - 1).clamp(min=0)
    out[torch.arange(batch.size, device=mask.device), last] = torch.tensor(rewards, dtype=torch.float32,
                                                                          device=mask.device)
    return out


class PPOTrainer(TrainerState):
    def __init__(self, cfg: TripodConfig, placement=None):
        """`placement` (engine/async_rollout/bridge.py): this trainer rank's side of a world split with the rollout's
        own ranks; None: the rollout is colocated."""
        self.cfg, self.rank, self.world = cfg, dist.get_rank(), dist.get_world_size()
        if cfg.trainer.threads_per_rank > 0:  # resolved before the ranks started (preflight.resolve_threads)
            torch.set_num_threads(cfg.trainer.threads_per_rank)
        self.device = current_device()  # chosen once per rank by runtime/device.py (trainer.device, LOCAL_RANK)
        arc, actor_cfg, algo = cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor, cfg.algorithm
        path = arc.model.path

        # data and rewards first: bad data stops the run before any model is built (engine/components.py)
        self.parts = parts = build_components(cfg, "trainer")
        self.arch, self.tokenizer, self.pad_id = parts.arch, parts.tokenizer, parts.pad_id
        self.train_set, self.val_set, self.loader = parts.train_set, parts.val_set, parts.loader
        self.rewards, self.sampler = parts.pool, parts.sampler
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
        # distillation: the frozen teacher on its own layout; the actor's loss reads its scores
        self.teacher = None
        if cfg.distillation.enabled:
            from tripod.engine.workers.teacher import build_teacher

            self.teacher = build_teacher(cfg)
            self.actor.distillation = cfg.distillation

        # host offload between phases (runtime/offload.py): moves on CUDA, recorded only on CPU
        self.offload = manager_for({"actor": self.actor, "critic": self.critic, "reference": self.ref}, {
            "actor": flags_of(actor_cfg.megatron, True), "critic": flags_of(cfg.critic.megatron, True),
            "reference": flags_of(arc.ref.megatron, False, arc.ref.offload)}, self.device)
        rollout = arc.rollout
        # rollout TP groups ordered for locality (parallel/hybrid_engine/regroup.py) only where the engine takes an
        # explicit slice order (embedded); vLLM / SGLang put slice j on the group's j-th rank
        self.hybrid = HybridEngine(self.arch, actor_layout, rollout.tensor_model_parallel_size,
                                   dtype=rollout_dtype(rollout.dtype, self.device),
                                   vpp=actor_cfg.megatron.virtual_pipeline_model_parallel_size,
                                   local_order=rollout.name == "embedded")
        replicas = RolloutReplicas(self.hybrid.plan.rollout_tp_groups, self.hybrid.rollout_dp_rank,
                                   self.hybrid.rollout_tp_group, self.hybrid.rollout_tp_order)

        def weights_of(engine):  # the engine generates with the actor's current weights, resharded in each time
            self.weight_sync = WeightSync(self.hybrid, engine, self.actor.model)
            return self.weight_sync.loaded
        # with the rollout on its own ranks this generator only validates
        parts.build_rollout(replicas, self.device, weights_of, self.reward_model)
        self.generator, self.scorer = parts.generator, parts.scorer
        if self.rank == 0:
            print(describe_stops(self.arch, rollout), flush=True)
        # where each step's scored batch comes from: this engine now, or the rollout ranks' queue
        self.source = ColocatedRollout(self) if placement is None else \
            QueuedRollout(self, placement, StalenessSchedule(cfg.async_training.staleness_threshold,
                                                             cfg.async_training.trigger_parameter_sync_step,
                                                             self.total_steps))
        self.plan = StepPlan.of(cfg, has_critic=self.critic is not None, has_reference_model=self.ref is not None,
                                moe=self.arch.moe is not None,  # the teacher's DP split is its own: whole batch
                                source_shards_rows=self.source.shards_rows and self.teacher is None,
                                dynamic_sampling=self.sampler.enable, reward_model=self.reward_model is not None)
        self.rows = StepRows(self.plan.shard_rows, rollout.n, algo=algo, bypass=self.plan.old_log_probs == "rollout",
                             actor=self.actor, actor_cfg=actor_cfg, critic=self.critic, critic_cfg=cfg.critic,
                             ref=self.ref)
        if self.rank == 0:
            print(self.plan.describe(), flush=True)
            if self.teacher is not None:
                from tripod.engine.workers.teacher import describe_teacher

                print(describe_teacher(self.teacher, cfg.distillation), flush=True)
            if placement is not None:  # the bound in trainer and optimizer steps
                print(self.source.schedule.describe(updates(actor_cfg)), flush=True)

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

    # ---- one PPO step ----------------------------------------------------------------------------
    def phase(self, timer: Timer):
        """`with phase(name):` one stage of the step: its models placed for it (runtime/offload.py), timed, and a
        profiler range (the timer's)."""
        @contextlib.contextmanager
        def stage(name: str):
            with timer(name):
                self.offload.enter(name)
                yield
        return stage

    def train_step(self, prompts: PromptBatch | None = None) -> dict[str, float]:
        """One PPO step on the next scored batch of `self.source` (`prompts`: the colocated rollout's prompts instead
        of the loader's next batch). What the step does is `self.plan`'s, decided once for the run."""
        arc, plan, timer = self.cfg.actor_rollout_ref, self.plan, Timer(self.profiler.range)
        n, temperature, stage = arc.rollout.n, arc.rollout.temperature, self.phase(timer)
        with timer("step"):
            rollout, metrics = self.source.next_batch(self.step, self.rows, timer, prompts)
            shards, rewards = rollout.shards, rollout.rewards  # model outputs stay on the DP rank of their rows
            (batch, held_rewards), rollout = self.batch_of(rollout, metrics), None  # its rows live on in the batch only
            with timer("reward"):
                token_rewards = sequence_rewards_at_last_token(batch, held_rewards)
            if plan.old_log_probs == "rollout":  # verl's bypass mode: nothing is recomputed
                batch["old_log_probs"] = batch["rollout_log_probs"]
            elif plan.recomputes_old(self.step):  # else the update takes them from its own forward
                with stage("old_log_prob"), routed(self.actor, batch, "old", plan.replay):  # R2 records, R3 replays
                    batch["old_log_probs"], _ = self.actor.compute_log_probs(
                        batch, plan.old_pass.micro_of(batch), temperature, token_budget=plan.old_pass.token_budget)
            if plan.reference != "none":  # with LoRA: the actor with its adapters off (no reference model)
                ref_model = self.ref or self.actor
                with stage("ref"), routed(ref_model, batch, "ref", plan.replay), reference_pass(self.actor, self.ref):
                    batch["ref_log_probs"], _ = ref_model.compute_log_probs(
                        batch, plan.ref_pass.micro_of(batch), temperature, token_budget=plan.ref_pass.token_budget)
            if self.teacher is not None:  # distillation: the teacher scores the student's rows
                from tripod.engine.workers.teacher import teacher_pass

                with timer("teacher"):
                    teacher_pass(self.teacher, batch, self.cfg, temperature)
            if plan.values:
                with stage("values"):
                    batch["values"] = self.critic.compute_values(batch, plan.value_pass.micro_of(batch),
                                                                 token_budget=plan.value_pass.token_budget)
            metrics.update(stage_metrics(self.actor))  # moe/routing_mismatch_frac (rollout vs the old-log-prob pass)
            with timer("adv"):
                updates = self.advantages(batch, token_rewards, rewards, shards, metrics)
            if plan.values and updates:
                with stage("update_critic"):
                    metrics.update(self.critic.update(batch, self.cfg.critic, n))
            if plan.updates_actor(self.step) and updates:
                # without a recompute, the rollout / train gap is measured on the update's first forward
                gap = "rollout_log_probs" in batch.tensors and (plan.old_log_probs == "rollout"
                                                                or not batch.recomputed_old_log_probs)
                with stage("update_actor"), routed(self.actor, batch, "update", plan.replay):
                    metrics.update(self.actor.update(batch, arc.actor, temperature, n, rollout_gap=gap))
                metrics.update(stage_metrics(self.actor))  # the mismatch where no old-log-prob pass ran
        return {**metrics, **self.step_metrics(batch, rewards, shards, timer.metrics())}

    def batch_of(self, rollout: Rollout, metrics: dict[str, float]) -> tuple[PPOBatch, list[float]]:
        """The step's `PPOBatch` on this rank's device (this DP rank's rows where `rollout.shards` says so), with the
        rollout's routing record where the plan attaches it (its bytes into `metrics`), and the sequence reward of
        each row it holds. Dumps the rows first (trainer.rollout_data_dir)."""
        cfg, shards = self.cfg, rollout.shards
        if cfg.trainer.rollout_data_dir and self.rank == 0:
            dump_rollout(cfg.trainer.rollout_data_dir, self.step + 1, rollout,
                         self.source.versions_of(self.step, len(rollout.responses)), self.tokenizer)
        batch, held_rewards = step_batch(rollout.prompts.input_ids, rollout.prompts.indices, cfg.actor_rollout_ref.rollout.n,
                              rollout.responses, rollout.rollout_log_probs, rollout.finish_reasons, rollout.rewards,
                              cfg.actor_rollout_ref.rollout.response_length, self.pad_id, shards, rollout.token_codes)
        batch = batch.to(self.device)
        if self.plan.attach_rollout_routing:  # the rollout's experts per token, laid out as the rows
            metrics["moe/routed_experts_bytes"] = float(attach_rollout_routing(  # this rank's rows
                batch, rollout.routed_experts, shards.rows if shards is not None else range(batch.size), self.arch.moe))
        return batch, held_rewards

    def advantages(self, batch: PPOBatch, token_rewards: torch.Tensor, rewards: list[float],
                   shards: RowShards | None, metrics: dict[str, float]) -> bool:
        """KL in the reward, rollout correction and the estimator, as the plan says; `batch` gets its token rewards,
        advantages and returns. False when rollout correction rejected every row: the step then updates nothing."""
        algo, mask = self.cfg.algorithm, batch["response_mask"]
        if self.plan.kl_in_reward:
            token_rewards, kl = apply_kl_penalty(token_rewards, batch["old_log_probs"], batch["ref_log_probs"], mask,
                                                 self.kl_ctrl.value, algo.kl_penalty,
                                                 **({} if shards is None else {"mean": shards.masked_mean}))
            metrics.update({"actor/reward_kl_penalty": float(kl), "actor/reward_kl_penalty_coeff": self.kl_ctrl.value})
            self.kl_ctrl.update(float(kl), n_steps=self.cfg.data.train_batch_size)
        batch["token_rewards"] = token_rewards
        scored, updates = mask, True  # rejected rows keep their scores in their groups' statistics, as verl's
        # the rollout / trainer gap (rollout_corr/*) wherever the old log-probs were recomputed; the plan's correction
        # (IS weights, rejection) with it when on
        if self.plan.old_log_probs != "rollout" and batch.recomputed_old_log_probs \
                and "rollout_log_probs" in batch.tensors:
            corr, kept = correct_batch(batch, algo.rollout_correction, shards)  # may reject sequences
            metrics.update(corr)
            mask, updates = batch["response_mask"], kept > 0
        adv, ret = step_advantages(algo, token_rewards, mask, batch, rewards, shards, scored) if updates \
            else (torch.zeros_like(token_rewards),) * 2
        batch["advantages"], batch["returns"] = adv, ret
        return updates

    def step_metrics(self, batch: PPOBatch, rewards: list[float], shards: RowShards | None,
                     timings: dict[str, float]) -> dict[str, float]:
        """The batch's statistics, the stage timings and throughput (perf/*), after the step."""
        out = batch_metrics(batch, rewards, shards)
        out.update(timings)
        out.update(self.perf.metrics(batch.lengths, timings, self.cfg.actor_rollout_ref.actor.ppo_epochs,
                                     recomputed_old_log_probs=batch.recomputed_old_log_probs
                                     and self.plan.old_log_probs != "rollout",
                                     shared_prompts=self.actor.share_prompt_prefix and self.actor.can_pack))
        return out

    def checked_train_step(self) -> dict[str, float]:
        """`train_step`, under runtime.device.DeviceGuard when TRIPOD_CHECK_DEVICES=1 (fails on a stray tensor)."""
        if not check_devices_enabled():
            return self.train_step()
        with DeviceGuard(self.device) as guard:
            metrics = self.train_step()
        if guard.violations:
            raise RuntimeError(f"step {self.step}: tensors off the chosen device {self.device}: {guard.report()}")
        if self.rank == 0:
            print(f"DEVICE_CHECK step={self.step} device={self.device} ops_off_device=0", flush=True)
        return metrics

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
