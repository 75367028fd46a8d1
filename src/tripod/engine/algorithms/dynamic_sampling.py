"""DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2; verl's `algorithm.filter_groups` and `data.gen_batch_size`).

A group (the rollout.n responses of one prompt) whose rewards are all equal has zero advantage under GRPO: it adds
no gradient, only dilutes the batch. With `algorithm.filter_groups.enable`, every PPO step

    1. generates a batch of data.gen_batch_size prompts x n responses and scores it (overlong shaping included),
    2. drops every group whose `metric` values have standard deviation 0,
    3. draws the next batch of prompts from the data loader and repeats until data.train_batch_size groups are kept
       (or stops the run after algorithm.filter_groups.max_num_gen_batches batches; <= 0: no limit),
    4. keeps the first data.train_batch_size kept groups, in generation order; the surplus is discarded.

Metrics: train/num_gen_batches (verl's name) and dynamic_sampling/{extra_gen_batches, groups_generated,
groups_dropped, groups_kept, groups_surplus, kept_frac}. Every batch comes from the trainer's one data loader, so its
position in a checkpoint counts every generation batch and a resumed run draws what the interrupted one would have.

The same `DynamicSampler.collect` does the plain rollout (one batch, nothing dropped) when filtering is off. The
group decisions depend only on the scores, which every rank holds (each rollout replica scores its rows, one all_reduce
shares them: engine/rewards/replica_scoring.py), so all ranks draw
the same batches and keep the same groups.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from tripod.engine.data.dataset import PromptBatch
from tripod.engine.launch import TrainingStopped  # one line, no traceback (engine/launch.py USER_ERRORS)
from tripod.engine.rollout.rows import Rollout, concat

# What a group's responses are compared by. acc and score: the rule reward (verl's `acc` is the score when the reward
# function returns a number, as tripod's do); seq_reward: the sequence reward after overlong shaping; seq_final_reward:
# the reward after the KL penalty, which equals seq_reward when algorithm.use_kl_in_reward is off (with it on, tripod
# computes the KL penalty after filtering and refuses this metric: engine/config_validation.py).
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


def metric_values(rollout: Rollout, metric: str) -> list[float]:
    """The per-response values that `algorithm.filter_groups.metric` compares (see FILTER_METRICS)."""
    if metric in ("acc", "score"):
        return rollout.scores
    if metric in ("seq_reward", "seq_final_reward"):
        return rollout.rewards
    raise ValueError(f"algorithm.filter_groups.metric={metric!r} is not one of {list(FILTER_METRICS)}")


def kept_groups(values: Sequence[float], n: int) -> list[int]:
    """Positions of the groups (n consecutive values each) whose values have a standard deviation > 0, i.e. are not
    all equal (a group holding a NaN has a NaN std and is dropped, as in verl)."""
    if n < 1 or len(values) % n:
        raise ValueError(f"{len(values)} values do not split into groups of n={n}")
    stds = np.asarray(values, dtype=np.float64).reshape(-1, n).std(axis=1)
    return [g for g, std in enumerate(stds) if std > 0]


class DynamicSampler:
    """Collects the rollout of one PPO step: one generation batch, or with `cfg.enable` as many as it takes to keep
    `train_batch_size` groups (see the module docstring). `cfg` is algorithm.filter_groups, `shaper` an
    engine.rewards.overlong.OverlongShaper, `draw()` the next batch of prompts from the data loader."""

    def __init__(self, cfg: Any, train_batch_size: int, n: int, draw: Callable[[], PromptBatch], shaper: Any) -> None:
        self.enable, self.train_batch_size, self.n = bool(cfg.enable), int(train_batch_size), int(n)
        self.metric, self.max_gen_batches = (str(cfg.metric), int(cfg.max_num_gen_batches)) if self.enable else ("", 0)
        self.draw, self.shaper = draw, shaper

    def rollout(self, prompts: PromptBatch, gen_batch: int, generate: Callable[[PromptBatch, int], Any],
                score: Callable[[PromptBatch, Any], tuple[list[float], dict]], timer: Any) -> Rollout:
        """Generate (`generate(prompts, gen_batch)`: n responses per prompt, as a list of token lists or as the
        generator's Rollout, engine/rollout/rows.py), score
        (`score(prompts, generated)`) and shape one batch."""
        generated = generate(prompts, gen_batch)
        with timer("reward"):
            scores, counts = score(prompts, generated)
            return self.scored(prompts, generated, scores, counts)

    def scored(self, prompts: PromptBatch, generated: Any, scores: list[float], counts: dict) -> Rollout:
        """A generated batch (token lists, or the generator's Rollout) with its rule scores, overlong shaping
        applied."""
        responses = generated if isinstance(generated, list) else generated.responses
        lengths = getattr(generated, "response_lens", None) or [len(r) for r in responses]  # every row's, held or not
        penalties = self.shaper.penalties(lengths)
        # a row without a score yet (None: the reward model scores it on the trainer, engine/rewards/scorer.py) gets
        # its reward there
        rewards = [s if s is None else s + p for s, p in zip(scores, penalties)] if self.shaper.enable \
            else list(scores)
        if isinstance(generated, list):
            return Rollout(prompts, responses, list(scores), rewards, penalties, dict(counts))
        return dataclasses.replace(generated, scores=list(scores), rewards=rewards, penalties=penalties,
                                   reward_metrics=dict(counts))

    def metrics_of(self, out: Rollout) -> tuple[Rollout, dict[str, float]]:
        """(a one-batch rollout, its metrics: the scorer's counts, overlong shaping)."""
        return out, {**out.reward_metrics, **self.shaper.metrics(out.penalties)}

    def collect(self, prompts: PromptBatch, generate: Callable[[PromptBatch, int], Any],
                score: Callable[[PromptBatch, Any], tuple[list[float], dict]],
                timer: Any) -> tuple[Rollout, dict[str, float]]:
        """(the step's rollout, its metrics: the scorer's counts, overlong shaping and dynamic sampling)."""
        if not self.enable:
            return self.metrics_of(self.rollout(prompts, 0, generate, score, timer))
        kept: list[Rollout] = []
        gen_batches = generated = have = 0
        while True:
            batch = self.rollout(prompts, gen_batches, generate, score, timer)
            gen_batches += 1
            keep = kept_groups(metric_values(batch, self.metric), self.n)
            generated += len(batch.prompts)
            have += len(keep)
            kept.append(batch.groups(keep, self.n))
            if have >= self.train_batch_size:
                break
            if 0 < self.max_gen_batches <= gen_batches:
                raise TrainingStopped(
                    f"dynamic sampling kept {have} of the data.train_batch_size={self.train_batch_size} groups after "
                    f"{gen_batches} generation batches ({generated} prompts; algorithm.filter_groups."
                    f"max_num_gen_batches={self.max_gen_batches}): the {self.metric} of most groups is all equal. "
                    "Raise algorithm.filter_groups.max_num_gen_batches (0: no limit) or data.gen_batch_size, or "
                    "train on data the policy sometimes solves")
            prompts = self.draw()
        out = concat(kept).groups(range(self.train_batch_size), self.n)
        metrics = {"train/num_gen_batches": float(gen_batches),
                   "dynamic_sampling/extra_gen_batches": float(gen_batches - 1),
                   "dynamic_sampling/groups_generated": float(generated),
                   "dynamic_sampling/groups_dropped": float(generated - have),
                   "dynamic_sampling/groups_kept": float(have),
                   "dynamic_sampling/groups_surplus": float(have - self.train_batch_size),
                   "dynamic_sampling/kept_frac": have / generated}
        return out, {**out.reward_metrics, **self.shaper.metrics(out.penalties), **metrics}
