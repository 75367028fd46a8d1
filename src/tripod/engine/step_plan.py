"""What every PPO step of a run does, decided once from the config at start (`StepPlan.of`) and printed once.

`PPOTrainer.train_step` reads the plan; nothing the plan holds is re-decided per step. What may still differ between
steps is data, not policy: the batch's size (micro-batches of `micro or batch.size` rows), the rows this rank holds
(row_shards.py), and the critic warm-up's first steps (`updates_actor(step)`), which the plan names up front.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OldLogProbs = Literal["rollout", "recompute", "update"]
Reference = Literal["none", "model", "actor_without_adapters"]


@dataclass(frozen=True)
class Pass:
    """One forward pass over the step's rows: `micro` rows a micro-batch (None: the whole batch in one) or, with
    `token_budget`, as many rows as fit that many tokens (the keys' use_dynamic_bsz)."""
    micro: int | None
    token_budget: int | None

    def micro_of(self, batch) -> int:
        return self.micro or batch.size


@dataclass(frozen=True)
class StepPlan:
    """Every per-run decision of the PPO step (see the module docstring)."""
    old_log_probs: OldLogProbs
    """rollout: algorithm.rollout_correction.bypass_mode (the rollout engine's log-probs are the old ones); update: the
    actor update is exactly on-policy (one epoch of one mini-batch, no KL-in-reward, no correction), so the update's
    own forward gives them (ratio exactly 1) and the old-log-prob pass is skipped; recompute: the actor's forward."""
    reference: Reference
    """Where the reference log-probs come from: no KL term needs them, the reference model, or (LoRA) the actor with
    its adapters off."""
    values: bool
    """A critic (GAE) computes values and is updated."""
    replay: str
    """actor.router_replay.mode: disabled | R2 | R3 (parallel/router_replay.py `routed`)."""
    attach_rollout_routing: bool
    """MoE with the rollout engine's routing record (R3, or the moe/routing_mismatch_frac metric): each row's experts
    go into the batch."""
    shard_rows: bool
    """Each DP rank may keep only the rows it updates (row_shards.py); off with dynamic sampling (the kept rows are
    known only after scoring) or a reward model (it scores every row). With the rollout on its own ranks each trainer
    rank then receives only those rows (async_rollout/rows.py)."""
    kl_in_reward: bool
    """algorithm.use_kl_in_reward: the KL penalty enters the token rewards (and its controller updates)."""
    correction: bool
    """algorithm.rollout_correction after the recompute: IS weights / rejection against the rollout's log-probs (the
    gap itself, rollout_corr/*, is measured after every recompute)."""
    critic_warmup: int
    """trainer.critic_warmup: the actor updates from this step on (0-based step count before the step)."""
    old_pass: Pass
    ref_pass: Pass
    value_pass: Pass

    @classmethod
    def of(cls, cfg, *, has_critic: bool, has_reference_model: bool, moe: bool, source_shards_rows: bool,
           dynamic_sampling: bool, reward_model: bool) -> "StepPlan":
        arc, algo = cfg.actor_rollout_ref, cfg.algorithm
        a, ro, ref, critic = arc.actor, arc.rollout, arc.ref, cfg.critic
        corr = algo.rollout_correction
        on_policy = (a.ppo_epochs == 1 and a.ppo_mini_batch_size >= cfg.data.train_batch_size
                     and not algo.use_kl_in_reward and not corr.active)
        old: OldLogProbs = "rollout" if corr.bypass_mode else "update" if on_policy else "recompute"
        reference: Reference = ("none" if not cfg.uses_reference else
                                "model" if has_reference_model else "actor_without_adapters")
        return cls(
            old_log_probs=old, reference=reference, values=has_critic, replay=a.router_replay.mode,
            attach_rollout_routing=bool(ro.enable_rollout_routing_replay and moe),
            shard_rows=source_shards_rows and not dynamic_sampling and not reward_model,
            kl_in_reward=bool(algo.use_kl_in_reward), correction=corr.active and not corr.bypass_mode,
            critic_warmup=int(cfg.trainer.critic_warmup),
            old_pass=Pass(ro.log_prob_micro_batch_size_per_gpu,
                          ro.log_prob_max_token_len_per_gpu if ro.log_prob_use_dynamic_bsz else None),
            ref_pass=Pass(ref.log_prob_micro_batch_size_per_gpu,
                          ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None),
            value_pass=Pass(critic.ppo_micro_batch_size_per_gpu,
                            critic.forward_max_token_len_per_gpu if critic.use_dynamic_bsz else None))

    def updates_actor(self, step: int) -> bool:
        return step >= self.critic_warmup

    def recomputes_old(self, step: int) -> bool:
        """Whether step `step` runs the old-log-prob pass: always under "recompute", and under "update" during the
        critic warm-up (the actor does not update then, so its own forward cannot stand in)."""
        return self.old_log_probs == "recompute" or (self.old_log_probs == "update" and not self.updates_actor(step))

    def describe(self) -> str:
        old = {"rollout": "the rollout's (bypass_mode)", "update": "the update's own forward (exactly on-policy: "
               "one epoch, one mini-batch)", "recompute": "recomputed by the actor"}[self.old_log_probs]
        ref = {"none": "none (no KL term)", "model": "the reference model",
               "actor_without_adapters": "the actor with its LoRA adapters off"}[self.reference]
        parts = [f"old log-probs {old}", f"reference {ref}", f"critic {'on' if self.values else 'off'}",
                 f"router replay {self.replay}" + (" (rollout routing in the batch)" if self.attach_rollout_routing
                                                   else ""),
                 f"rows {'sharded by DP rank' if self.shard_rows else 'whole on every rank'}",
                 f"KL in reward {'on' if self.kl_in_reward else 'off'}",
                 f"rollout correction {'on' if self.correction else 'off'}"]
        if self.critic_warmup:
            parts.append(f"actor updates from step {self.critic_warmup + 1} (critic warm-up)")
        return "step plan: " + "; ".join(parts)
