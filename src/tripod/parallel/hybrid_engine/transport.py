"""Moving the actor's weights: tripod's micro-DP bucketed gather, and the naive full gather it is measured against.

`MicroDPGather` executes a `ReshardPlan`: every rank copies its own pieces into a freshly allocated generation shard,
then each member of its micro-DP group in turn broadcasts its buckets (flattened, one collective per bucket) and every
receiver unpacks them straight into place. One reusable bucket buffer per rank; nothing else is allocated. (When the
layouts and dtypes coincide the hybrid engine skips this and hands out the parameters: engine.py.)

When training TP is not a multiple of rollout TP (regroup.py) there are no micro-DP broadcasts: the dense tensors
travel point to point like the experts (`exchange_dense`), in chunks of at most half a bucket, so one send chunk and
one receive chunk are alive at a time.

Routed experts (MoE) travel point to point instead (`exchange_experts`, the rule is in parallel/hybrid_engine/
experts.py): in round s of a ring schedule every rank sends one flat buffer to rank + s and receives one from
rank - s, each only when the plan has segments for that pair; both sides enumerate the same segments.

`naive_full_gather` is the baseline (dense models): every rank gathers the whole model (all TP slices, all PP
stages), then takes its rollout TP slice from it (what "all-gather full tensors on every rank" costs).

Both take the training shard as `{global megatron name: this rank's TP slice}` and return the generation shard as
`{global megatron name: rollout TP slice}` (see parallel/hybrid_engine/plan.py for the layout). `MicroDPGather` reads
the training shard only through `read_into`, slice by slice, so a value may also be a weight merged on read (LoRA:
parallel/lora/merge.py's `MergedWeight`, merged a bucket at a time as the transport packs it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tripod.parallel.families.spec import Split, merge, shard
from tripod.parallel.hybrid_engine.plan import Bucket, ParamSpec, ReshardPlan, local_shape, segments_of


@dataclass
class TransferStats:
    """What the collectives moved, counted from the tensors each call actually sent or received."""
    bytes_received: int = 0
    bytes_sent: int = 0
    collectives: int = 0
    peak_buffer_bytes: int = 0  # point to point: the send + receive chunk buffers it allocated

    def count(self, *tensors: torch.Tensor, received: bool = True) -> None:
        """One collective that moved `tensors` into (received) or out of this rank."""
        n = sum(t.numel() * t.element_size() for t in tensors)
        if received:
            self.bytes_received += n
        else:
            self.bytes_sent += n
        self.collectives += 1


class MicroDPGather:
    """Owns the micro-DP process groups of a plan (created collectively, once) and runs the gather."""

    def __init__(self, plan: ReshardPlan):
        self.plan = plan
        self.rank = dist.get_rank()
        if dist.get_world_size() != plan.world_size:
            raise ValueError(f"reshard plan is for world size {plan.world_size}, but this world has "
                             f"{dist.get_world_size()} ranks")
        self.group, self.members = None, [self.rank]
        for ranks in plan.micro_dp_groups:  # every rank must create every group, in the same order
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if self.rank in ranks:
                self.group, self.members = g, ranks
        self.rollout_tp_group = None
        for ranks in plan.rollout_tp_groups:
            g = dist.new_group(ranks)
            if self.rank in ranks:
                self.rollout_tp_group, self.rollout_tp_ranks = g, ranks
        self.stats = TransferStats()

    def allocate_generation_shard(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        dtypes = self.plan.generation_dtypes()
        return {n: torch.empty(s, dtype=dtypes[n], device=device) for n, s in self.plan.generation_shapes().items()}

    def gather(self, train_shard: dict[str, torch.Tensor],
               out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Build this rank's generation shard. `out` may be a reusable shard from a previous step."""
        plan, me = self.plan, self.rank
        _check_train_shard(plan, me, train_shard)
        device = next(iter(train_shard.values())).device
        gen = out if out is not None else self.allocate_generation_shard(device)
        if plan.p2p:
            exchange_dense(plan, me, train_shard, gen, self.stats)
            exchange_experts(plan, me, train_shard, gen, self.stats)
            return gen
        k = plan.tp // plan.rollout_tp
        q = plan.train_coords(me)[0] % k
        for spec in plan.owned_specs(me):  # own pieces: local copies, no traffic
            _copy_own(spec, q, k, plan.tp, train_shard[spec.name], gen[spec.name])
        if self.group is not None:  # a micro-DP group of one has nothing to send: its own copies were everything
            self._broadcast_buckets(train_shard, gen, device)
        exchange_experts(plan, me, train_shard, gen, self.stats)
        return gen

    def _broadcast_buckets(self, train_shard: dict[str, torch.Tensor], gen: dict[str, torch.Tensor],
                           device: torch.device) -> None:
        """Each member of the micro-DP group in turn packs its buckets (a merged LoRA weight is merged here, a bucket
        at a time) and broadcasts them; the others unpack them into place."""
        plan, me = self.plan, self.rank
        bufs: dict[torch.dtype, torch.Tensor] = {}  # one reusable buffer per dtype (fp32 rows: a small one)
        for owner in self.members:
            for bucket in plan.buckets[owner]:
                if bucket.dtype not in bufs:
                    bufs[bucket.dtype] = torch.empty(plan.max_bucket_numel(bucket.dtype), dtype=bucket.dtype,
                                                     device=device)
                flat = bufs[bucket.dtype][: bucket.numel]
                if owner == me:
                    _pack(bucket, train_shard, flat)
                dist.broadcast(flat, src=owner, group=self.group)
                self.stats.count(flat, received=owner != me)
                if owner != me:
                    _unpack(bucket, flat, gen)


def exchange_experts(plan: ReshardPlan, me: int, train_shard: dict[str, torch.Tensor], gen: dict[str, torch.Tensor],
                     stats: TransferStats) -> None:
    """Fill the expert tensors of this rank's generation shard (no-op for a dense model)."""
    if not plan.expert_specs:
        return
    recv, send = plan.expert_recv(me), plan.expert_send(me)
    for seg in recv.pop(me, []):  # pieces this rank holds itself
        read_into(train_shard[seg.name], seg.src_slices, gen[seg.name][seg.dst_slices])
    device = next(iter(gen.values())).device
    world = plan.world_size
    for shift in range(1, world):
        to, frm = (me + shift) % world, (me - shift) % world
        reqs, inbox = [], None
        if to in send:
            segs = send[to]
            out = torch.empty(sum(seg.numel for seg in segs), dtype=plan.dtype, device=device)
            _pack(Bucket(me, plan.dtype, segs), train_shard, out)
            reqs.append(dist.isend(out, dst=to))
            stats.count(out, received=False)
        if frm in recv:
            inbox = torch.empty(sum(seg.numel for seg in recv[frm]), dtype=plan.dtype, device=device)
            reqs.append(dist.irecv(inbox, src=frm))
        for req in reqs:
            req.wait()
        if inbox is not None:
            stats.count(inbox)
            _unpack(Bucket(frm, plan.dtype, recv[frm]), inbox, gen)


def exchange_dense(plan: ReshardPlan, me: int, train_shard: dict[str, torch.Tensor], gen: dict[str, torch.Tensor],
                   stats: TransferStats) -> None:
    """Fill the dense tensors of this rank's generation shard point to point (`plan.p2p`, regroup.py): local
    copies, then a ring schedule; in round s this rank sends to rank + s and receives from rank - s, chunk by chunk."""
    from tripod.parallel.hybrid_engine.regroup import buffer_numels, rounds_of

    for seg in plan.dense_recv(me).get(me, []):
        read_into(train_shard[seg.name], seg.src_slices, gen[seg.name][seg.dst_slices])
    rounds = rounds_of(plan, me)
    # one send and one receive buffer per dtype, reused by every round (like the micro-DP gather's bucket buffer)
    device = next(iter(gen.values())).device
    bufs = {key: torch.empty(n, dtype=key[1], device=device) for key, n in buffer_numels(rounds).items()}
    stats.peak_buffer_bytes = max(stats.peak_buffer_bytes, sum(b.numel() * b.element_size() for b in bufs.values()))
    for to, frm, outs, ins in rounds:
        for i in range(max(len(outs), len(ins))):
            reqs, inbox = [], None
            if i < len(outs):
                flat = bufs["send", outs[i].dtype][: outs[i].numel]
                _pack(outs[i], train_shard, flat)
                reqs.append(dist.isend(flat, dst=to))
                stats.count(flat, received=False)
            if i < len(ins):
                inbox = bufs["recv", ins[i].dtype][: ins[i].numel]
                reqs.append(dist.irecv(inbox, src=frm))
            for req in reqs:
                req.wait()
            if inbox is not None:
                stats.count(inbox)
                _unpack(ins[i], inbox, gen)
    del bufs


def _check_train_shard(plan: ReshardPlan, rank: int, shard: dict[str, torch.Tensor]) -> None:
    want = {s.name: local_shape(s, plan.tp) for s in plan.owned_specs(rank)}
    want.update({s.name: local_shape(s, plan.etp or plan.tp) for s in plan.owned_expert_specs(rank)})
    missing = sorted(set(want) - set(shard))
    if missing:
        raise ValueError(f"rank {rank}: training shard lacks {missing[:5]}{'...' if len(missing) > 5 else ''}")
    for n, shape in want.items():
        # any floating dtype: pieces are cast to the plan's (rollout) dtype as they are copied / packed
        if tuple(shard[n].shape) != shape or not shard[n].dtype.is_floating_point:
            raise ValueError(f"rank {rank}: training shard {n} is {tuple(shard[n].shape)} {shard[n].dtype}, "
                             f"plan expects {shape} (floating point)")


def read_into(src, slices: tuple[slice, ...], dst: torch.Tensor) -> None:
    """dst <- src[slices]: a tensor's slice, or a lazily merged weight's (`copy_into`: merged just that slice)."""
    if isinstance(src, torch.Tensor):
        dst.copy_(src[slices])
    else:
        src.copy_into(slices, dst)


def _copy_own(spec: ParamSpec, q: int, k: int, tp: int, src, dst: torch.Tensor) -> None:
    for seg in segments_of(spec, q, k, tp):
        read_into(src, seg.src_slices, dst[seg.dst_slices])


def _pack(bucket: Bucket, shard: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
    off = 0
    for seg in bucket.segments:
        read_into(shard[seg.name], seg.src_slices, flat[off: off + seg.numel].view(seg.shape))
        off += seg.numel


def _unpack(bucket: Bucket, flat: torch.Tensor, gen: dict[str, torch.Tensor]) -> None:
    off = 0
    for seg in bucket.segments:
        gen[seg.name][seg.dst_slices].copy_(flat[off: off + seg.numel].view(seg.shape))
        off += seg.numel


def naive_full_gather(plan: ReshardPlan, train_shard: dict[str, torch.Tensor], tp_group, pp_group,
                      pp_ranks: list[int], stats: TransferStats | None = None) -> dict[str, torch.Tensor]:
    """Baseline: gather every full parameter on every rank, then slice the rollout TP shard out of it.

    `tp_group` is the training TP group, `pp_group` the training PP group (global ranks `pp_ranks`, stage order).
    Holds the full model (M bytes) plus the generation shard at its peak.
    """
    if plan.expert_specs:
        raise ValueError("naive_full_gather is the dense baseline; an MoE actor reshards with MicroDPGather")
    stats = stats if stats is not None else TransferStats()
    me, t = dist.get_rank(), plan.tp
    tp_rank, _, stage = plan.train_coords(me)
    full: dict[str, torch.Tensor] = {}
    for spec in plan.specs:
        if spec.stage == stage:
            local = train_shard[spec.name].contiguous()
            if spec.rule is Split.REPLICATED or t == 1:
                whole = local.clone()
            else:
                parts = [torch.empty_like(local) for _ in range(t)]
                dist.all_gather(parts, local, group=tp_group)
                stats.count(*(p for i, p in enumerate(parts) if i != tp_rank))
                whole = merge(spec.rule, parts)
                del parts
        else:
            whole = torch.empty(spec.global_shape, dtype=plan.spec_dtype(spec),
                                device=next(iter(train_shard.values())).device)
        if plan.pp > 1:
            dist.broadcast(whole, src=pp_ranks[spec.stage], group=pp_group)
            if spec.stage != stage:
                stats.count(whole)
            else:
                stats.count(whole, received=False)
        full[spec.name] = whole
    j, tg = plan.rollout_tp_rank(me), plan.rollout_tp
    gen = {spec.name: shard(spec.rule, full[spec.name], tg, j).clone() for spec in plan.specs}
    del full
    return gen

