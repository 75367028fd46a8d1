"""Resharding the routed experts: from the training EP x expert-TP layout into the rollout TP layout.

Training (megatron's expert view of the tp*dp ranks of each pipeline stage, parallel/layout.py `rank_groups`): stage-
local index l = tp_rank + tp * dp_rank is read as etp-rank a = l % etp, EP rank b = (l // etp) % ep and expert-DP
rank c = l // (etp * ep). EP rank b holds the experts [b * n_local, (b + 1) * n_local) of its stage's MoE layers,
each cut etp ways by its row's split (linear_fc1 GATED_ROW, linear_fc2 COL), and there are edp copies (c).

Rollout: every rollout TP rank j (of tg) needs TP slice j of EVERY expert (engine/rollout/moe_decoder.py). The
zero-redundancy rule of the dense plan holds: a rank receives exactly the elements of its generation shard it does
not already hold, each once. Source choice: receiver R (stage-local index l_R, hence expert-DP rank c_R) takes every
piece from the expert-DP replica c_R of the expert's EP rank, which spreads the senders over all replicas; the
overlap of etp slice a with tg slice j is cut by `overlap_segments` (etp and tg need not divide each other).

The exchange is point-to-point (`ExpertExchange` in transport.py): pairs of ranks swap one flat buffer per round of a
ring schedule, both sides reading the same plan. `expert_bytes_received` counts what the plan moves by enumerating its
segments; `expert_bytes_received_fast` gives the same number in closed form (used by `tripod plan` on 512 ranks).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from tripod.parallel.families.spec import Split

_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def expert_index(name: str) -> int | None:
    """Global expert index of a canonical megatron name, None for non-expert tensors."""
    m = _EXPERT.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ExpertLayout:
    """The expert view of a training layout over the world (megatron's tp-ep-dp-pp rank order)."""
    tp: int
    dp: int
    pp: int
    ep: int
    etp: int
    num_experts: int

    @property
    def stage_size(self) -> int:
        return self.tp * self.dp

    @property
    def edp(self) -> int:
        return self.stage_size // (self.etp * self.ep)

    @property
    def n_local(self) -> int:
        return self.num_experts // self.ep

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(etp rank a, EP rank b, expert-DP rank c, stage) of a global rank."""
        local, stage = rank % self.stage_size, rank // self.stage_size
        return local % self.etp, (local // self.etp) % self.ep, local // (self.etp * self.ep), stage

    def rank(self, a: int, b: int, c: int, stage: int) -> int:
        return a + self.etp * (b + self.ep * c) + self.stage_size * stage

    def owns(self, rank: int, expert: int, stage: int) -> bool:
        _, b, _, s = self.coords(rank)
        return s == stage and expert // self.n_local == b


def _ranges(n: int, size: int, rank: int) -> tuple[int, int]:
    step = n // size
    return rank * step, (rank + 1) * step


@lru_cache(maxsize=4096)
def overlap_segments(rule: Split, shape: tuple[int, ...], a: int, etp: int, j: int, tg: int
                     ) -> tuple[tuple[tuple[slice, ...], tuple[slice, ...], tuple[int, ...]], ...]:
    """Where the part of training piece a (of etp) that lies in rollout piece j (of tg) sits in each of them:
    (slices in the etp piece, slices in the tg piece, shape) per contiguous segment; () when they are disjoint."""
    full = tuple(slice(0, n) for n in shape)
    if rule is Split.REPLICATED:
        return ((full, full, shape),) if a == 0 else ()  # one etp rank sends a replicated tensor
    if rule in (Split.ROW, Split.COL):
        dim = 0 if rule is Split.ROW else 1
        n = shape[dim]
        halves = [(0, 0, 0)]
    elif rule is Split.GATED_ROW:
        dim, n = 0, shape[0] // 2
        halves = [(0, 0, 0), (n, n // etp, n // tg)]  # (global offset, offset in the etp piece, in the tg piece)
    else:
        raise ValueError(f"expert tensors cannot be split {rule}")
    s0, s1 = _ranges(n, etp, a)
    d0, d1 = _ranges(n, tg, j)
    lo, hi = max(s0, d0), min(s1, d1)
    if lo >= hi:
        return ()
    out = []
    for _, src_off, dst_off in halves:
        src = list(full)
        dst = list(full)
        src[dim] = slice(src_off + lo - s0, src_off + hi - s0)
        dst[dim] = slice(dst_off + lo - d0, dst_off + hi - d0)
        seg_shape = list(shape)
        seg_shape[dim] = hi - lo
        out.append((tuple(src), tuple(dst), tuple(seg_shape)))
    return tuple(out)


def check_expert_sizes(shape_rule: list[tuple[tuple[int, ...], Split]], etp: int, tg: int) -> list[str]:
    """Problems with cutting expert tensors etp ways (training) and tg ways (rollout)."""
    problems = []
    for shape, rule in shape_rule:
        n = shape[1] if rule is Split.COL else shape[0] // (2 if rule is Split.GATED_ROW else 1)
        for key, size in (("actor's expert_tensor_parallel_size", etp),
                          ("actor_rollout_ref.rollout.tensor_model_parallel_size", tg)):
            if rule is not Split.REPLICATED and n % size:
                problems.append(f"{key}={size} must divide the expert intermediate size {n}")
    return sorted(set(problems))
