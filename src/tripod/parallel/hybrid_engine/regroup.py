"""Rollout TP independent of training TP: the point-to-point regrouping used when rollout TP `tg` does not divide
training TP `t` (tg > t, e.g. TP1 -> TP2 or TP2 -> TP4, or neither divides the other, e.g. TP2 -> TP3).

Then a rollout TP group spans several training DP replicas (or PP stages): no micro-DP group holds a generation slice
between its members. The rule:

- Groups: rollout TP group g is the tg consecutive global ranks [g*tg, (g+1)*tg) (rollout DP = world / tg), so its
  members are whole training TP groups of consecutive DP replicas (spilling into the next PP stage when a stage has
  fewer than tg ranks).
- Order ("local"): inside a group, rollout TP slice j goes to the member whose training TP slice overlaps slice j
  most (greedy over (overlap desc, j, rank)), so that, where possible, each rank's generation slice lies inside the
  training slice it already holds. t=2, tg=4, DP=2: group [r(tp0,dp0), r(tp0,dp1), r(tp1,dp0), r(tp1,dp1)] and every
  slice is local. With t=1 this order is the ranks' own order. ("sorted": slice j goes to the group's j-th rank in rank
  order, as vLLM's / SGLang's launchers assign it; correct, but fewer slices are local when t > 1.)
- Sources: receiver R (training coords tp a_R, DP b_R, stage s_R; rollout slice j) takes the overlap of training
  slice a with its slice j (`overlap_segments`, slices that do not divide each other) from itself when it holds it
  (a == a_R on its own stage), else from rank (tp a, DP b_R, that stage): the training TP group of its own DP
  replica, which spreads the senders over all replicas. Replicated tensors (norms) of another stage come from the
  rank (a_R, b_R, that stage).
- Transport: point to point in a ring schedule (transport.py `exchange_dense`); each (sender, receiver) message is
  cut into chunks of at most half a bucket per dtype, so a round holds one send and one receive chunk: one bucket.

Bytes received by R, in closed form (`received_closed_form`): G - (Rep_s + Sh_s * |I_a ∩ J_j|), G the generation
shard's bytes, Rep_s / Sh_s the replicated / sharded (TP-unsplit) bytes of R's stage s, I_a = [a/t, (a+1)/t) and
J_j = [j/tg, (j+1)/tg). With t | tg and the local order, |I_a ∩ J_j| = 1/tg: R receives exactly the generation slices
of the other stages' layers (0 at PP=1), never more than its generation shard.
"""
from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

import torch

from tripod.parallel.families.spec import Split
from tripod.parallel.hybrid_engine.experts import overlap_segments

if TYPE_CHECKING:
    from tripod.parallel.hybrid_engine.plan import Bucket, ParamSpec, ReshardPlan, Segment


def slice_overlap(a: int, t: int, j: int, tg: int) -> Fraction:
    """|[a/t, (a+1)/t) ∩ [j/tg, (j+1)/tg)|: the share of a split dimension training slice a and rollout slice j
    have in common."""
    lo, hi = max(Fraction(a, t), Fraction(j, tg)), min(Fraction(a + 1, t), Fraction(j + 1, tg))
    return max(hi - lo, Fraction(0))


def spanning_groups(world: int, t: int, tg: int, local: bool = True) -> list[list[int]]:
    """The rollout TP groups, each listed in rollout TP order (index j = the rank holding rollout slice j)."""
    groups = []
    for g in range(world // tg):
        members = list(range(g * tg, (g + 1) * tg))
        if not local:
            groups.append(members)
            continue
        order: list[int | None] = [None] * tg
        taken: set[int] = set()
        for _, j, r in sorted((-slice_overlap(r % t, t, j, tg), j, r) for j in range(tg) for r in members):
            if order[j] is None and r not in taken:
                order[j] = r
                taken.add(r)
        groups.append(order)  # type: ignore[arg-type]
    return groups


def _rule(spec: ParamSpec) -> Split:
    return Split.ROW if spec.rule is Split.VOCAB else spec.rule  # the padded vocab is cut like rows


def dense_recv(plan: ReshardPlan, rank: int) -> dict[int, list[Segment]]:
    """Source rank -> the dense segments `rank` takes from it (itself: local copies), in plan order."""
    from tripod.parallel.hybrid_engine.plan import Segment

    t, tg, d = plan.tp, plan.rollout_tp, plan.dp
    a_me, b_me, s_me = plan.train_coords(rank)
    j = plan.rollout_tp_rank(rank)
    out: dict[int, list[Segment]] = {}
    for spec in plan.specs:
        if spec.expert is not None:
            continue
        s = spec.stage
        if spec.rule is Split.REPLICATED:
            src = rank if s == s_me else a_me + t * (b_me + d * s)
            full = tuple(slice(0, n) for n in spec.global_shape)
            out.setdefault(src, []).append(Segment(spec.name, full, full, spec.global_shape))
            continue
        for a in range(t):
            src = rank if (s == s_me and a == a_me) else a + t * (b_me + d * s)
            for src_sl, dst_sl, shape in overlap_segments(_rule(spec), spec.global_shape, a, t, j, tg):
                out.setdefault(src, []).append(Segment(spec.name, src_sl, dst_sl, shape))
    return out


def dense_send(plan: ReshardPlan, rank: int) -> dict[int, list[Segment]]:
    """Destination rank -> the segments of its own training shard `rank` sends there (the receiver's order)."""
    out = {}
    for dst in range(plan.world_size):
        if dst != rank:
            segs = plan.dense_recv(dst).get(rank)
            if segs:
                out[dst] = segs
    return out


def chunks(plan: ReshardPlan, segments: list[Segment]) -> list[Bucket]:
    """One message's segments cut into chunks of at most half a bucket of their dtype (both ends compute the same)."""
    from tripod.parallel.hybrid_engine.plan import Bucket, _split_rows

    dtypes = plan.generation_dtypes()
    out: list[Bucket] = []
    open_chunk: dict[torch.dtype, Bucket] = {}
    for seg in segments:
        dtype = dtypes[seg.name]
        cap = max(1, plan.bucket_bytes // 2 // plan.elem_size(dtype))
        for part in _split_rows(seg, cap):
            c = open_chunk.get(dtype)
            if c is None or c.numel + part.numel > cap:
                c = open_chunk[dtype] = Bucket(-1, dtype)
                out.append(c)
            c.segments.append(part)
            c.numel += part.numel
    return out


def rounds_of(plan: ReshardPlan, rank: int) -> list[tuple[int, int, list[Bucket], list[Bucket]]]:
    """The ring schedule of `rank`: per round s, (to = rank + s, frm = rank - s, chunks sent to `to`, chunks received
    from `frm`)."""
    world, recv, send = plan.world_size, plan.dense_recv(rank), plan.dense_send(rank)
    return [(to, frm, chunks(plan, send[to]) if to in send else [], chunks(plan, recv[frm]) if frm in recv else [])
            for to, frm in (((rank + s) % world, (rank - s) % world) for s in range(1, world))]


def buffer_numels(rounds: list[tuple[int, int, list[Bucket], list[Bucket]]]) -> dict[tuple[str, torch.dtype], int]:
    """("send" / "recv", dtype) -> elements of the reusable buffer the transport allocates: the largest chunk."""
    need: dict[tuple[str, torch.dtype], int] = {}
    for _, _, outs, ins in rounds:
        for side, cs in (("send", outs), ("recv", ins)):
            for c in cs:
                need[side, c.dtype] = max(need.get((side, c.dtype), 0), c.numel)
    return need


def buffer_bytes(plan: ReshardPlan, rank: int) -> int:
    """What `rank`'s point-to-point buffers hold together (at most one bucket for a single dtype)."""
    return sum(n * plan.elem_size(key[1]) for key, n in buffer_numels(rounds_of(plan, rank)).items())


def received_closed_form(plan: ReshardPlan, rank: int) -> int:
    """Dense bytes `rank` receives: G - (Rep_s + Sh_s * |I_a ∩ J_j|) (module docstring), from per-stage totals."""
    a, _, s = plan.train_coords(rank)
    rep, sh = plan.stage_dense_bytes(s)
    held = rep + sh * slice_overlap(a, plan.tp, plan.rollout_tp_rank(rank), plan.rollout_tp)
    assert held.denominator == 1, (rank, held)
    return plan.dense_generation_bytes() - int(held)


def split_problems(arch, specs: list[ParamSpec], tg: int) -> list[str]:
    """Dense tensors whose TP-split dimension rollout TP `tg` cannot cut evenly (one line per distinct size)."""
    key = f"actor_rollout_ref.rollout.tensor_model_parallel_size={tg}"
    problems = set()
    for spec in specs:
        if spec.expert is not None or spec.rule is Split.REPLICATED:
            continue
        n = spec.global_shape[1] if spec.rule is Split.COL else spec.global_shape[0]
        n //= 2 if spec.rule is Split.GATED_ROW else 1
        if n % tg:
            what = (f"the padded vocabulary {n} (vocab_size={arch.vocab_size} rounded up to a multiple of 128 * "
                    f"the actor's TP)" if spec.rule is Split.VOCAB else f"the split size {n} of {spec.name.split('.')[-2]}")
            problems.add(f"{key} must divide {what}; pick a rollout TP that divides it")
    return sorted(problems)
