"""The resharding plan of the 3D-HybridEngine: who gathers what from whom, computed before any weight moves.

Training layout: TP=t, PP=p, DP=d (world N = t*p*d, megatron rank order tp-fastest, then dp, then pp).
Rollout layout:  TP=tg, PP=1, DP=N/tg.

HybridFlow regrouping (tg divides t): inside one training model-parallel replica (its t*p ranks), the k = t/tg
consecutive training TP ranks r = j*k .. j*k+k-1 of every PP stage together hold generation TP slice j of every layer.
Those m = k*p ranks form a *micro-DP group*: they all-gather, inside that group only, the pieces of generation shard j,
so each ends with all layers of TP slice j and nothing more. The m ranks of a micro-DP group become m replicas of
generation TP rank j; the rollout TP groups are the ranks with the same micro index across j = 0..tg-1.

The gather is a sequence of broadcasts: each member broadcasts its own pieces to its group in buckets flattened per
dtype (one collective per bucket), and every receiver copies the bucket straight into its generation shard. Each
tensor travels in its own dtype: the rollout dtype, except rows the family holds in fp32 (`Weight.fp32`: the MoE
router's expert bias, which megatron and SGLang keep in fp32), which get fp32 buckets of their own. A rank
therefore holds at most its generation shard plus one bucket. Bytes received per rank (ideal, paper):
(t*p - tg)/(tg*t*p) * M, against (t*p - 1)/(t*p) * M for gathering the full model everywhere.

Rollout TP that training TP does not divide (tg > t, or neither divides the other): the rollout TP groups span DP
replicas / PP stages, and the dense tensors move point to point from ranks that hold them
(parallel/hybrid_engine/regroup.py has the groups, the sources and the bytes' closed form).

Routed experts (MoE) do not follow the TP x DP x PP grid: the micro-DP buckets carry only the dense tensors, and the
expert tensors move point to point from the training EP x expert-TP layout into every rollout TP slice
(parallel/hybrid_engine/experts.py has the rule; `bytes_received` counts both parts).

Everything here is pure arithmetic over `ModelArch` (no process groups), so the plan can be printed by
`tripod plan CONFIG` and validated before any weight moves.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from tripod.parallel.arch import ModelArch
from tripod.parallel.families import get_family
from tripod.parallel.families.spec import Split, padded_vocab_size, subshard_segments
from tripod.parallel.families.spec import local_shape as split_local_shape
from tripod.parallel.hybrid_engine import regroup
from tripod.parallel.hybrid_engine.experts import ExpertLayout, expert_index, overlap_segments
from tripod.parallel.stages import StageSplit


class ReshardPlanError(ValueError):
    """An unsupported or inconsistent training -> rollout layout pair (raised before any weight moves)."""


@dataclass(frozen=True)
class ParamSpec:
    name: str                   # global megatron name (global layer index)
    global_shape: tuple[int, ...]  # megatron's TP-unsplit shape, vocab padded for the training TP size
    stage: int                  # PP stage holding it in the training layout
    rule: Split                 # its TP split, from the family's table (over expert TP for an expert tensor)
    expert: int | None = None   # global expert index of a routed-expert tensor
    fp32: bool = False          # moved in fp32 whatever the rollout dtype (the router's expert bias: Weight.fp32)


def actor_param_specs(arch: ModelArch, tp: int, pp: int, vpp: int = 1, *, first: int | None = None,
                      last: int | None = None) -> list[ParamSpec]:
    """Every parameter the rollout needs, in megatron naming, with global (TP-unsplit, vocab-padded) shapes.

    The PP stage of layer i is megatron's (parallel/stages.py): even, interleaved over `vpp` virtual stages per PP
    rank, or uneven with `first` / `last` layers on the first / last stage (num_layers_in_first/last_pipeline_stage)."""
    family = get_family(arch.family)
    vocab_rows = padded_vocab_size(arch.vocab_size, tp)
    stage_of_layer = StageSplit(arch.num_layers, pp, vpp, first, last).stage_of_layer
    specs = []
    for name, row in family.rows(arch).items():
        if name.startswith("decoder.layers."):
            stage = stage_of_layer[int(name.split(".")[2])]
        else:
            stage = 0 if name == "embedding.word_embeddings.weight" else pp - 1
        expert = expert_index(name) if getattr(row, "per_expert", False) or ".local_experts." in name else None
        specs.append(ParamSpec(name, family.padded_shape(arch, name, vocab_rows), stage, row.tp, expert,
                               fp32=getattr(row, "fp32", False)))
    return specs


def local_shape(spec: ParamSpec, tp: int) -> tuple[int, ...]:
    return split_local_shape(spec.rule, spec.global_shape, tp)


@dataclass(frozen=True)
class Segment:
    """Copy `src[src_slices]` of the owner's training shard into `gen[dst_slices]` of the generation shard."""
    name: str
    src_slices: tuple[slice, ...]
    dst_slices: tuple[slice, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for x in self.shape:
            n *= x
        return n


@dataclass
class Bucket:
    owner: int
    dtype: torch.dtype
    segments: list[Segment] = field(default_factory=list)
    numel: int = 0


def segments_of(spec: ParamSpec, q: int, k: int, t: int) -> list[Segment]:
    """Where training TP-local index q (of the k training slices inside one generation slice) lands."""
    return [Segment(spec.name, src, dst, shape)
            for src, dst, shape in subshard_segments(spec.rule, local_shape(spec, t), q, k)]


def _split_rows(seg: Segment, max_numel: int) -> list[Segment]:
    """Split a segment along its first dim so that each part fits in a bucket."""
    row = seg.numel // seg.shape[0]
    if seg.numel <= max_numel:
        return [seg]
    rows = max(1, max_numel // row)
    out, s0, d0 = [], seg.src_slices[0].start, seg.dst_slices[0].start
    for a in range(0, seg.shape[0], rows):
        n = min(rows, seg.shape[0] - a)
        out.append(Segment(seg.name, (slice(s0 + a, s0 + a + n),) + seg.src_slices[1:],
                           (slice(d0 + a, d0 + a + n),) + seg.dst_slices[1:], (n,) + seg.shape[1:]))
    return out


@dataclass
class ReshardPlan:
    """The full plan for one world; every rank computes the same plan and reads its own part."""
    arch: ModelArch
    tp: int
    pp: int
    dp: int
    rollout_tp: int
    bucket_bytes: int
    dtype: torch.dtype
    specs: list[ParamSpec]
    micro_dp_groups: list[list[int]]
    rollout_tp_groups: list[list[int]]
    buckets: dict[int, list[Bucket]]   # owner rank -> its buckets of dense tensors, in send order
    ep: int = 1
    etp: int | None = None             # None: tp
    stages: StageSplit | None = None   # which PP stage holds which layer (None: even)
    local_order: bool = True           # point-to-point regrouping: rollout slices ordered for locality (regroup.py)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def p2p(self) -> bool:
        """True when training TP is not a multiple of rollout TP: dense tensors move point to point (regroup.py)."""
        return self.tp % self.rollout_tp != 0

    @property
    def micro_dp_size(self) -> int:
        return 1 if self.p2p else (self.tp * self.pp) // self.rollout_tp

    def train_coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank in megatron's tp-dp-pp order."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    @functools.cached_property
    def _rollout_tp_rank(self) -> dict[int, int]:
        return {r: j for g in self.rollout_tp_groups for j, r in enumerate(g)}

    def rollout_tp_rank(self, rank: int) -> int:
        """The rollout TP slice `rank` holds: its index in its rollout TP group (the groups are listed in slice order)."""
        return self._rollout_tp_rank[rank]

    # ---- point-to-point regrouping of the dense tensors (p2p; parallel/hybrid_engine/regroup.py) ------
    def dense_recv(self, rank: int) -> dict[int, list[Segment]]:
        """Source rank -> the dense segments `rank` takes from it (itself: local copies); {} unless `p2p`."""
        if not self.p2p:
            return {}
        cache = self.__dict__.setdefault("_dense_recv", {})
        if rank not in cache:
            cache[rank] = regroup.dense_recv(self, rank)
        return cache[rank]

    def dense_send(self, rank: int) -> dict[int, list[Segment]]:
        return regroup.dense_send(self, rank) if self.p2p else {}

    def stage_dense_bytes(self, stage: int) -> tuple[int, int]:
        """(replicated bytes, sharded TP-unsplit bytes) of the dense tensors of training PP stage `stage`."""
        rep = sh = 0
        for s in self.specs:
            if s.expert is None and s.stage == stage:
                n = _prod(s.global_shape) * self.elem_size(self.spec_dtype(s))
                rep, sh = (rep + n, sh) if s.rule is Split.REPLICATED else (rep, sh + n)
        return rep, sh

    def dense_generation_bytes(self) -> int:
        return sum(_prod(local_shape(s, self.rollout_tp)) * self.elem_size(self.spec_dtype(s))
                   for s in self.specs if s.expert is None)

    @functools.cached_property
    def _max_p2p_buffer_bytes(self) -> int:
        return max(regroup.buffer_bytes(self, r) for r in range(self.world_size))

    def micro_dp_group_of(self, rank: int) -> list[int]:
        return next(g for g in self.micro_dp_groups if rank in g)

    def rollout_tp_group_of(self, rank: int) -> list[int]:
        return next(g for g in self.rollout_tp_groups if rank in g)

    def owned_specs(self, rank: int) -> list[ParamSpec]:
        """The dense tensors `rank` holds (its TP slice of its stage's); experts: `owned_expert_specs`."""
        return [s for s in self.specs if s.expert is None and s.stage == self.train_coords(rank)[2]]

    # ---- routed experts (parallel/hybrid_engine/experts.py) ------------------------------------------
    @functools.cached_property
    def expert_specs(self) -> list[ParamSpec]:
        return [s for s in self.specs if s.expert is not None]

    @functools.cached_property
    def expert_layout(self) -> ExpertLayout:
        n = 1 + max((s.expert for s in self.expert_specs), default=0)
        return ExpertLayout(self.tp, self.dp, self.pp, self.ep, self.etp or self.tp, n)

    @functools.cached_property
    def _experts_by_stage(self) -> dict[int, list[ParamSpec]]:
        out: dict[int, list[ParamSpec]] = {}
        for s in self.expert_specs:
            out.setdefault(s.stage, []).append(s)
        return out

    def owned_expert_specs(self, rank: int) -> list[ParamSpec]:
        """The expert tensors `rank` holds in training (its EP rank's experts of its stage; its expert-TP slice), in
        plan order (the order both ends of the exchange enumerate segments in)."""
        lay = self.expert_layout
        _, b, _, stage = lay.coords(rank)
        first, last = b * lay.n_local, (b + 1) * lay.n_local
        return [s for s in self._experts_by_stage.get(stage, []) if first <= s.expert < last]

    def expert_recv(self, rank: int) -> dict[int, list[Segment]]:
        """Source rank -> the expert segments `rank` takes from it (itself: local copies), in plan order."""
        lay, j = self.expert_layout, self.rollout_tp_rank(rank)
        c = lay.coords(rank)[2]
        out: dict[int, list[Segment]] = {}
        for spec in self.expert_specs:
            b = spec.expert // lay.n_local
            for a in range(lay.etp):
                for src, dst, shape in overlap_segments(spec.rule, spec.global_shape, a, lay.etp, j, self.rollout_tp):
                    out.setdefault(lay.rank(a, b, c, spec.stage), []).append(Segment(spec.name, src, dst, shape))
        return out

    def expert_send(self, rank: int) -> dict[int, list[Segment]]:
        """Destination rank -> the segments of its own expert pieces `rank` sends there (same order as recv)."""
        lay = self.expert_layout
        a, _, c, _ = lay.coords(rank)
        mine = self.owned_expert_specs(rank)
        out: dict[int, list[Segment]] = {}
        for dst_rank in range(self.world_size):
            if dst_rank == rank or lay.coords(dst_rank)[2] != c:
                continue
            j = self.rollout_tp_rank(dst_rank)
            segs = [Segment(s.name, src, dst, shape) for s in mine
                    for src, dst, shape in overlap_segments(s.rule, s.global_shape, a, lay.etp, j, self.rollout_tp)]
            if segs:
                out[dst_rank] = segs
        return out

    def expert_bytes_received(self, rank: int) -> int:
        """What the expert exchange delivers to `rank` (enumerated from the plan's segments)."""
        return sum(seg.numel for src, segs in self.expert_recv(rank).items() if src != rank
                   for seg in segs) * self.elem_size()

    @functools.cached_property
    def _expert_generation_numel(self) -> int:
        return sum(_prod(local_shape(s, self.rollout_tp)) for s in self.expert_specs)

    def expert_bytes_received_fast(self, rank: int) -> int:
        """`expert_bytes_received` in closed form: this rank's rollout slice of every expert, less what it holds."""
        lay, j = self.expert_layout, self.rollout_tp_rank(rank)
        a = lay.coords(rank)[0]
        need = self._expert_generation_numel
        held = sum(_prod(seg[2]) for s in self.owned_expert_specs(rank)
                   for seg in overlap_segments(s.rule, s.global_shape, a, lay.etp, j, self.rollout_tp))
        return (need - held) * self.elem_size()

    def generation_shapes(self) -> dict[str, tuple[int, ...]]:
        return {s.name: local_shape(s, self.rollout_tp) for s in self.specs}

    def spec_dtype(self, spec: ParamSpec) -> torch.dtype:
        """The dtype `spec` travels and lives in on the rollout side."""
        return torch.float32 if spec.fp32 else self.dtype

    def generation_dtypes(self) -> dict[str, torch.dtype]:
        return {s.name: self.spec_dtype(s) for s in self.specs}

    def elem_size(self, dtype: torch.dtype | None = None) -> int:
        return torch.empty((), dtype=dtype or self.dtype).element_size()

    def model_bytes(self) -> int:
        return sum(_prod(s.global_shape) * self.elem_size(self.spec_dtype(s)) for s in self.specs)

    def generation_shard_bytes(self) -> int:
        return sum(_prod(local_shape(s, self.rollout_tp)) * self.elem_size(self.spec_dtype(s)) for s in self.specs)

    def bytes_received(self, rank: int, fast: bool = False) -> int:
        """Exactly what the transport receives on `rank`: every bucket of every other member of its micro-DP group,
        plus the expert pieces it takes from other ranks (`fast`: closed form for those, same number)."""
        if self.p2p:
            dense = regroup.received_closed_form(self, rank) if fast else sum(
                seg.numel * self.elem_size(self.spec_dtype_of(seg.name))
                for src, segs in self.dense_recv(rank).items() if src != rank for seg in segs)
        else:
            dense = sum(b.numel * self.elem_size(b.dtype) for o in self.micro_dp_group_of(rank) if o != rank
                        for b in self.buckets[o])
        if not self.expert_specs:
            return dense
        return dense + (self.expert_bytes_received_fast(rank) if fast else self.expert_bytes_received(rank))

    def spec_dtype_of(self, name: str) -> torch.dtype:
        return self._dtype_of[name]

    @functools.cached_property
    def _dtype_of(self) -> dict[str, torch.dtype]:
        return self.generation_dtypes()

    def bytes_received_ideal(self) -> float:
        """HybridFlow's (t*p - tg)/(tg*t*p) * M; for the point-to-point regrouping the mean of its closed form."""
        if self.p2p:
            if "_p2p_mean" not in self.__dict__:
                self.__dict__["_p2p_mean"] = sum(regroup.received_closed_form(self, r)
                                                 for r in range(self.world_size)) / self.world_size
            return self.__dict__["_p2p_mean"]
        t, p, tg = self.tp, self.pp, self.rollout_tp
        return (t * p - tg) / (tg * t * p) * self.model_bytes()

    def bytes_received_naive(self) -> float:
        t, p = self.tp, self.pp
        return (t * p - 1) / (t * p) * self.model_bytes()

    def max_bucket_bytes(self) -> int:
        """The largest bucket; point to point: the largest send + receive chunk buffers of a rank (each chunk at most
        half a bucket)."""
        if self.p2p:
            return self._max_p2p_buffer_bytes
        return max((b.numel * self.elem_size(b.dtype) for bs in self.buckets.values() for b in bs), default=0)

    def max_bucket_numel(self, dtype: torch.dtype) -> int:
        """Elements of the largest bucket of `dtype` (the transport's reusable buffer of that dtype)."""
        return max((b.numel for bs in self.buckets.values() for b in bs if b.dtype == dtype), default=0)

    def peak_extra_bytes(self) -> int:
        """Generation shard plus the largest bucket: the most a rank holds beyond its training shard."""
        return self.generation_shard_bytes() + self.max_bucket_bytes()

    def describe(self, per_rank: bool = True) -> str:
        """The plan as text (parallel/hybrid_engine/plan_report.py; `per_rank=False`: one row per rank role)."""
        from tripod.parallel.hybrid_engine.plan_report import describe_plan

        return describe_plan(self, per_rank)


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def build_reshard_plan(arch: ModelArch, tp: int, pp: int, dp: int, rollout_tp: int, *,
                       bucket_bytes: int = 64 << 20, dtype: torch.dtype = torch.float32,
                       world_size: int | None = None, vpp: int = 1, ep: int = 1,
                       etp: int | None = None, first: int | None = None, last: int | None = None,
                       local_order: bool = True) -> ReshardPlan:
    """The plan for actor layout TP x PP x DP (experts: EP x expert TP `etp`, None = tp; uneven stages: `first` /
    `last` layers on the first / last PP stage) -> rollout TP. When training TP is not a multiple of rollout TP the
    dense tensors move point to point (regroup.py); `local_order=False` then orders every rollout TP group as its
    ranks' order (what vLLM's / SGLang's launchers assume) instead of for locality."""
    from tripod.parallel.hybrid_engine.layout_checks import validate_layouts  # it needs ParamSpec: no cycle

    stages = StageSplit(arch.num_layers, pp, vpp, first, last)
    if stages.problems():  # the stage of each layer is undefined: refuse before enumerating the tensors
        validate_layouts(arch, tp, pp, dp, rollout_tp, world_size, (), ep, etp, first=first, last=last, vpp=vpp)
    specs = actor_param_specs(arch, tp, pp, vpp, first=first, last=last)
    expert_specs = [s for s in specs if s.expert is not None]
    validate_layouts(arch, tp, pp, dp, rollout_tp, world_size, expert_specs, ep, etp, first=first, last=last,
                     vpp=vpp)
    dense_specs = [s for s in specs if s.expert is None]
    if tp % rollout_tp:
        world = tp * pp * dp
        return ReshardPlan(arch, tp, pp, dp, rollout_tp, bucket_bytes, dtype, specs, [[r] for r in range(world)],
                           regroup.spanning_groups(world, tp, rollout_tp, local_order), {r: [] for r in range(world)},
                           ep, etp, stages, local_order)
    k = tp // rollout_tp

    def max_numel(seg_dtype: torch.dtype) -> int:
        return max(1, bucket_bytes // torch.empty((), dtype=seg_dtype).element_size())

    micro, rollout_groups = [], []
    for dp_rank in range(dp):
        def rank_of(tp_rank: int, pp_rank: int) -> int:
            return tp_rank + tp * (dp_rank + dp * pp_rank)
        groups = [[rank_of(j * k + q, s) for s in range(pp) for q in range(k)] for j in range(rollout_tp)]
        micro += groups
        m = k * pp
        rollout_groups += [[groups[j][i] for j in range(rollout_tp)] for i in range(m)]

    buckets: dict[int, list[Bucket]] = {}
    for rank in range(tp * pp * dp):
        tp_rank, _, stage = rank % tp, 0, rank // (tp * dp)
        q = tp_rank % k
        segs = []
        for spec in dense_specs:
            if spec.stage != stage or (spec.rule is Split.REPLICATED and q != 0):
                continue  # replicated params are sent once per stage, by its first TP rank in the group
            seg_dtype = torch.float32 if spec.fp32 else dtype
            for seg in segments_of(spec, q, k, tp):
                segs += [(seg_dtype, part) for part in _split_rows(seg, max_numel(seg_dtype))]
        out: list[Bucket] = []
        open_bucket: dict[torch.dtype, Bucket] = {}  # one bucket filling per dtype; send order = creation order
        for seg_dtype, seg in segs:
            bucket = open_bucket.get(seg_dtype)
            if bucket is None or bucket.numel + seg.numel > max_numel(seg_dtype):
                bucket = open_bucket[seg_dtype] = Bucket(rank, seg_dtype)
                out.append(bucket)
            bucket.segments.append(seg)
            bucket.numel += seg.numel
        buckets[rank] = out
    return ReshardPlan(arch, tp, pp, dp, rollout_tp, bucket_bytes, dtype, specs, micro, rollout_groups, buckets,
                       ep, etp, stages)


def reshard_plan_from_config(cfg, world_size: int, arch: ModelArch, *, bucket_bytes: int = 64 << 20) -> ReshardPlan:
    """The plan of a resolved `TripodConfig` on `world_size` ranks (`tripod plan`, the bench's prediction): the
    actor's TP / PP / virtual stages / EP / ETP, DP = world / (TP*PP), the rollout TP, the rollout dtype and the
    rollout groups' order (locality for the embedded engine, rank order for vLLM / SGLang)."""
    from tripod.parallel.precision import rollout_dtype

    m, r = cfg.actor_rollout_ref.actor.megatron, cfg.actor_rollout_ref.rollout
    return build_reshard_plan(arch, m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                              m.weight_replicas(world_size), r.tensor_model_parallel_size,
                              bucket_bytes=bucket_bytes, world_size=world_size,
                              vpp=m.virtual_pipeline_model_parallel_size or 1, ep=m.expert_model_parallel_size,
                              etp=m.expert_tensor_parallel_size, first=m.num_layers_in_first_pipeline_stage,
                              last=m.num_layers_in_last_pipeline_stage,
                              local_order=r.name == "embedded",  # vLLM / SGLang: slice j on the j-th rank
                              dtype=rollout_dtype(r.dtype, "cuda" if cfg.trainer.device == "cuda" else "cpu"))
