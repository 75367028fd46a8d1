"""Which weights generate which batch: verl's staleness keys turned into one deterministic schedule.

Units: a *batch* is one trainer step's prompts (data.train_batch_size groups of rollout.n samples; a group is always
trained together); *version w* is the actor's weights after w optimizer steps of the trainer (trainer steps, as
tripod counts them). The trainer syncs its weights to the rollout every K = trigger_parameter_sync_step steps, so
the rollout only ever holds versions 0, K, 2K, ...

verl's rule: between two syncs the rollout may produce at most (1 + s) x K x require_batches x ppo_mini_batch_size
prompts, s = staleness_threshold. With B = require_batches x ppo_mini_batch_size = data.train_batch_size prompts a
step, that is `capacity` = floor((1 + s) x K) batches ahead of the last synced version: batch i may be generated with
version w only when i < w + capacity (admission control: nothing generated is ever dropped). tripod's rollout takes
the *oldest* admissible version, w(i) = the smallest multiple of K >= i - capacity + 1, so the schedule is a
function of (i, s, K) alone and a run is reproducible whatever the timing. Batch i is trained in step i (0-based),
against version i, so its age is i - w(i) <= capacity - 1 = `max_age`:

    s = 0, K = 1  -> capacity 1, w(i) = i      age 0: synchronous streaming (the colocated run, bit for bit)
    s = 1, K = 1  -> capacity 2, w(i) = i - 1  age 1: one step off policy
    s = 0, K = 2  -> capacity 2, w(i) = 2*floor(i/2)   ages 0, 1, 0, 1, ...

w(i) <= i always (capacity >= K), so the trainer can always produce the version a batch waits for: no deadlock.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessSchedule:
    """The schedule of a run (see the module docstring): `threshold` s, `sync_every` K, `total_batches` steps."""
    threshold: float
    sync_every: int
    total_batches: int

    def __post_init__(self) -> None:
        if not self.threshold >= 0 or self.sync_every < 1:
            raise ValueError(f"staleness_threshold={self.threshold} must be >= 0 and trigger_parameter_sync_step="
                             f"{self.sync_every} >= 1")

    @property
    def capacity(self) -> int:
        """Batches the rollout may generate past its weights' version: floor((1 + s) K), with a small tolerance so
        that a threshold like 0.1 x 10 counts as the whole 1 it stands for."""
        return int(math.floor((1.0 + self.threshold) * self.sync_every + 1e-9))

    @property
    def max_age(self) -> int:
        """The largest age (trainer version - generating version, in optimizer steps) of any sample."""
        return self.capacity - 1

    def version_for(self, batch: int) -> int:
        """w(i): the version batch `batch` is generated with."""
        k = self.sync_every
        return k * max(0, -(-(batch - self.capacity + 1) // k))

    def age(self, batch: int) -> int:
        return batch - self.version_for(batch)

    def syncs(self, step: int) -> bool:
        """Whether the trainer pushes its weights after `step` optimizer steps: a multiple of K that some batch of
        the run still waits for."""
        last = self.version_for(self.total_batches - 1) if self.total_batches else 0
        return step % self.sync_every == 0 and 0 < step <= last

    def first_to_generate(self, step: int) -> int:
        """After a resume at `step`: the first batch generated with a version >= step (the earlier ones, generated
        with older weights, travel in the checkpoint's queue)."""
        i = step
        while i < self.total_batches and self.version_for(i) < step:
            i += 1
        return i

    def describe(self, optimizer_steps_per_step: int = 1) -> str:
        """The bound in both units: trainer steps (a version is the actor after that many trainer steps) and
        optimizer steps (`optimizer_steps_per_step`: ppo_epochs x mini-batches a step, each one optimizer step)."""
        u = max(1, int(optimizer_steps_per_step))
        return (f"async: staleness_threshold={self.threshold:g}, trigger_parameter_sync_step={self.sync_every} -> "
                f"the rollout runs at most {self.capacity} batch(es) past its weights; a sample is at most "
                f"{self.max_age} trainer step(s) old ({self.max_age * u} optimizer step(s), {u} a trainer step)")
