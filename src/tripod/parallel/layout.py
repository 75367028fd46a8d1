"""Per-model parallel layouts: TP x CP x PP x DP (x EP) process groups owned by one model.

Actor, critic and reference each get their OWN `ParallelLayout` in one torch.distributed world
(e.g. actor TP2xPP2 and critic TP1xPP2xDP2 on the same 4 ranks, or layouts over subsets of the
world). Ranks are laid out the megatron way, "tp-cp-ep-dp-pp": tp varies fastest, then cp (context parallel),
then dp, then pp, over the layout's `ranks` list. Expert layers (MoE) see the same ranks through a second decomposition, as
megatron's expert rank generator does: expert-tp fastest, then ep, then expert-dp, then the same pp.

Group creation is collective over the WHOLE world (torch.distributed.new_group must be called by
every rank, in the same order), so every rank constructs every layout, even one it is not part
of (`layout.is_member` is then False and the rank-dependent properties raise).

megatron-core 0.16.1 reads process groups in two ways:
  * explicitly, from a `ProcessGroupCollection`: GPTModel and its TP layers / attention / embeddings
    (`pg_collection=`), the pipeline schedules (`pg_collection=` + `p2p_communicator=`);
  * from the global `megatron.core.parallel_state`: DistributedDataParallel (dp / dp_cp / expert
    groups when no pg_collection is given), finalize_model_grads (embedding-group tied-grad
    all-reduce, layernorm SP all-reduce, num-tokens all-reduce over pp), get_megatron_optimizer and
    grad clipping (model-parallel group for the grad norm), the RNG tracker seeding
    (model_parallel_cuda_manual_seed reads the tp/ep rank), dist_checkpointing sharded_state_dict
    (replica ids from dp/tp/pp ranks) and some helpers inside the forward (e.g. vocab-parallel
    cross entropy, `is_pipeline_last_stage` in older paths).
Tripod is correct on both: it passes `pg_collection` wherever megatron accepts one, and it runs
every piece of megatron work for a model inside `with layout.activate():`, which points the
parallel_state globals at this layout's groups and restores the previous ones on exit (which globals, and which it
leaves alone: parallel/megatron_patches/parallel_state_groups.py, with its canary). The training loop therefore never
has to remember which megatron path reads what.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch.distributed as dist

from tripod.parallel.megatron_patches.parallel_state_groups import parallel_state_values, pointed_at
from tripod.parallel.stages import StageSplit

GLOO_TWINS = ("dp", "dp_cp", "expt_dp")  # the group kinds megatron also wants as gloo groups (`_build_gloo_groups`)


def _parallel_error(name: str, key: str, size: int, what: str, value: int) -> ValueError:
    divisors = [d for d in range(1, value + 1) if value % d == 0]
    return ValueError(f"{name} {key}={size} does not divide {what}={value}; use one of {divisors}")


class _MissingIsNone(dict):
    def __missing__(self, key):
        return None


@dataclass
class ParallelLayout:
    """The process groups of one model. `ranks` defaults to the whole world.

    Sizes: tp (tensor_model_parallel_size), pp (pipeline_model_parallel_size), cp (context_parallel_size: the
    ranks that split each sequence, parallel/context_parallel.py), dp (data parallel; None = len(ranks) // (tp*cp*pp)), ep (expert_model_parallel_size) and etp (expert_tensor_parallel_size;
    None = tp, megatron's default). first_stage_layers / last_stage_layers: megatron's
    num_layers_in_first/last_pipeline_stage (None = an even split; parallel/stages.py). Expert data parallel is edp = tp*dp // (etp*ep). `name` (actor / critic
    / reference) prefixes every error message. `arch` (a ModelArch), when given, is validated
    (`validate_for`) before anything else, so a bad layout fails before any process group exists.
    """

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    ep: int = 1
    cp: int = 1
    etp: int | None = None
    ranks: Sequence[int] | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    name: str = "model"
    arch: Any = field(default=None, repr=False)
    _groups: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _group_ranks: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for key, value in (("tensor_model_parallel_size", self.tp), ("pipeline_model_parallel_size", self.pp),
                           ("context_parallel_size", self.cp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name} {key}={value!r} must be a positive integer")
        self.etp = self.tp if self.etp is None else self.etp
        for key, value in (("expert_model_parallel_size", self.ep), ("expert_tensor_parallel_size", self.etp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name} {key}={value!r} must be a positive integer")
        if self.arch is not None:
            self.validate_for(self.arch)
        if not dist.is_initialized():
            raise RuntimeError(f"{self.name} ParallelLayout needs torch.distributed initialised first "
                               "(dist.init_process_group('gloo' or 'nccl'), e.g. under torchrun)")
        world = dist.get_world_size()
        self.ranks = list(range(world)) if self.ranks is None else [int(r) for r in self.ranks]
        n = len(self.ranks)
        if len(set(self.ranks)) != n or any(r < 0 or r >= world for r in self.ranks):
            raise ValueError(f"{self.name} ranks={self.ranks} must be distinct ranks of the world 0..{world - 1}")
        # the messages name context parallelism only where it is on
        cp_key, cp_size, cp_name = ("*context_parallel_size", f"*{self.cp}", "cp*") if self.cp > 1 else ("", "", "")
        if self.dp is None:
            if n % (self.tp * self.cp * self.pp):
                raise ValueError(f"{self.name} world size {n} is not a multiple of tensor_model_parallel_size{cp_key}"
                                 f"*pipeline_model_parallel_size={self.tp}{cp_size}*{self.pp}; change tp/"
                                 f"{cp_name.replace('*', '/')}pp or the number of processes")
            self.dp = n // (self.tp * self.cp * self.pp)
        size = self.tp * self.cp * self.pp * self.dp
        if size != n:
            raise ValueError(f"{self.name} world size {n} != tp*{cp_name}pp*dp = {self.tp}{cp_size}*{self.pp}*{self.dp}="
                             f"{size}; launch {size} processes or change tensor/{'context/' if cp_name else ''}pipeline/"
                             "data_parallel_size")
        if (self.tp * self.cp * self.dp) % (self.etp * self.ep):
            raise ValueError(f"{self.name} expert_tensor_parallel_size*expert_model_parallel_size={self.etp}*{self.ep}"
                             f" does not divide tensor_model_parallel_size*data_parallel_size={self.tp}*{self.dp} "
                             "(the ranks of one pipeline stage); choose ep and etp whose product divides it")
        self._build_groups()

    # ---- rank arithmetic -------------------------------------------------------------------------
    def _coords(self, index: int) -> tuple[int, int, int, int]:
        """(tp, dp, pp, cp) coordinates of the layout's `index`-th rank."""
        tp, cp, dp = self.tp, self.cp, self.dp
        return index % tp, (index // (tp * cp)) % dp, index // (tp * cp * dp), (index // tp) % cp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: the replicas of each expert shard within one pipeline stage."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    def _enumerate(self) -> dict[str, list[list[int]]]:
        return rank_groups(self.ranks, self.tp, self.pp, self.dp, self.ep, self.etp, cp=self.cp)

    def _build_groups(self) -> None:
        me = dist.get_rank()
        made: dict[tuple[int, ...], Any] = {}  # one group per distinct rank list, shared by the kinds that match
        for kind, lists in self._enumerate().items():
            for ranks in [list(x) for x in dict.fromkeys(tuple(g) for g in lists)]:
                # every rank of the world calls new_group for every group, in the same order
                if tuple(ranks) not in made:
                    made[tuple(ranks)] = dist.new_group(ranks=ranks)
                group = made[tuple(ranks)]
                if me in ranks:
                    self._groups[kind] = group
                    self._group_ranks[kind] = ranks
        self._build_gloo_groups()
        self._pg_collection = None

    def _build_gloo_groups(self) -> None:
        """Host-side twins of the data-parallel groups, kinds `<kind>_gloo`: megatron's *_GLOO groups (the distributed
        optimizer gathers its CPU state over them for a checkpoint). In a world whose default backend is gloo they
        are the groups themselves; otherwise (NCCL, or a device-mapped backend such as "cpu:gloo,cuda:nccl") they
        are gloo groups of their own over the same ranks, which an NCCL group cannot stand in for (no CPU tensors)."""
        own = dist.get_backend() != "gloo"
        made: dict[tuple[int, ...], Any] = {}
        for kind, lists in self._enumerate().items():
            if kind not in GLOO_TWINS:
                continue
            for ranks in [list(x) for x in dict.fromkeys(tuple(g) for g in lists)]:
                if own and tuple(ranks) not in made:  # collective: every rank, every group, the same order
                    made[tuple(ranks)] = dist.new_group(ranks=ranks, backend="gloo")
                if dist.get_rank() in ranks:
                    self._groups[f"{kind}_gloo"] = made[tuple(ranks)] if own else self._groups[kind]

    # ---- membership and ranks -----------------------------------------------------------------
    @property
    def is_member(self) -> bool:
        return dist.get_rank() in self.ranks

    def _check_member(self) -> None:
        if not self.is_member:
            raise RuntimeError(f"{self.name} layout over ranks {self.ranks} does not include rank {dist.get_rank()}")

    def _index(self) -> int:
        self._check_member()
        return self.ranks.index(dist.get_rank())

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def tp_rank(self) -> int:
        return self._coords(self._index())[0]

    @property
    def dp_rank(self) -> int:
        return self._coords(self._index())[1]

    @property
    def pp_rank(self) -> int:
        return self._coords(self._index())[2]

    @property
    def cp_rank(self) -> int:
        return self._coords(self._index())[3]

    @property
    def cp_group(self):
        self._check_member()
        return self._groups["cp"]

    @property
    def tp_group(self):
        self._check_member()
        return self._groups["tp"]

    @property
    def pp_group(self):
        self._check_member()
        return self._groups["pp"]

    @property
    def dp_group(self):
        self._check_member()
        return self._groups["dp"]

    @property
    def mp_group(self):
        self._check_member()
        return self._groups["mp"]

    @property
    def ep_rank(self) -> int:
        return self.group_ranks("ep").index(dist.get_rank())

    @property
    def etp_rank(self) -> int:
        return self.group_ranks("expt_tp").index(dist.get_rank())

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def group_ranks(self, kind: str) -> list[int]:
        """Global ranks of this rank's group of `kind` (tp, cp, dp, dp_cp, pp, mp, tp_dp, embd, pos_embd; ep, expt_tp,
        tp_ep, tp_ep_pp, expt_dp for expert layers)."""
        self._check_member()
        return list(self._group_ranks[kind])

    def stage_split(self, num_layers: int, vpp: int | None = None) -> StageSplit:
        """Which stage holds which of `num_layers` decoder layers (even, or megatron's uneven first/last stage)."""
        return StageSplit(num_layers, self.pp, vpp or 1, self.first_stage_layers, self.last_stage_layers)

    def stage_layers(self, num_layers: int, vpp: int | None = None) -> list[int]:
        """Global layer ids held by this rank's pipeline stage (megatron's split: parallel/stages.py)."""
        split = self.stage_split(num_layers, vpp)
        split.check(self.name)
        return split.stage_layers(self.pp_rank)

    def validate_for(self, arch) -> None:
        """Refuse a layout that cannot shard `arch` (a parallel.arch.ModelArch), naming key and fix."""
        if arch.num_heads % self.tp:
            raise _parallel_error(self.name, "tensor_model_parallel_size", self.tp, "num_attention_heads",
                                  arch.num_heads)
        if arch.num_kv_heads % self.tp:
            raise _parallel_error(self.name, "tensor_model_parallel_size", self.tp, "num_key_value_heads",
                                  arch.num_kv_heads)
        self.stage_split(arch.num_layers).check(self.name)
        num_experts = getattr(arch, "num_experts", 0) or 0
        if self.ep > 1 and not num_experts:
            raise ValueError(f"{self.name} expert_model_parallel_size={self.ep} but the model has no experts "
                             "(a dense model); use 1")
        if self.cp > 1 and (num_experts or getattr(arch, "mla", None) is not None):
            raise ValueError(f"{self.name} context_parallel_size={self.cp}: {arch.family} is an MoE / MLA model; "
                             "context parallelism runs dense models only; set it to 1")
        if num_experts and num_experts % self.ep:
            raise _parallel_error(self.name, "expert_model_parallel_size", self.ep, "num_experts", num_experts)

    def describe(self) -> str:
        cp = f", cp {self.cp_rank}" if self.is_member and self.cp > 1 else ""
        where = (f"rank {dist.get_rank()} = (tp {self.tp_rank}{cp}, dp {self.dp_rank}, pp {self.pp_rank})"
                 if self.is_member else f"rank {dist.get_rank()} not a member")
        experts = f", experts ETP{self.etp} x EP{self.ep} x EDP{self.edp}" if self.ep > 1 or self.etp != self.tp else ""
        cps = f" x CP{self.cp}" if self.cp > 1 else ""
        return (f"{self.name}: TP{self.tp}{cps} x PP{self.pp} x DP{self.dp}{experts} over ranks {self.ranks} "
                f"(order tp-cp-ep-dp-pp); {where}")

    # ---- megatron views -------------------------------------------------------------------------
    @property
    def pg_collection(self):
        """megatron ProcessGroupCollection of this rank's groups. With cp > 1 megatron's schedules see the CP group
        (they split the activation shape by it and scale the loss by its size), DDP and the optimizer reduce over
        dp x cp; the TransformerConfig keeps context_parallel_size=1 (parallel/context_parallel.py says why)."""
        self._check_member()
        if self._pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            g = _MissingIsNone(self._groups)  # embd / pos_embd are None off the first/last stages
            self._pg_collection = ProcessGroupCollection(
                tp=g["tp"], pp=g["pp"], mp=g["mp"], embd=g["embd"], pos_embd=g["pos_embd"],
                cp=g["cp"], tp_cp=g["tp_cp"], hcp=None, ep=g["ep"], expt_tp=g["expt_tp"], tp_ep=g["tp_ep"],
                tp_ep_pp=g["tp_ep_pp"], tp_dp_cp=g["tp_dp_cp"], dp=g["dp"], dp_cp=g["dp_cp"], expt_dp=g["expt_dp"],
                intra_dp_cp=g["dp_cp"], intra_expt_dp=g["expt_dp"], intra_dist_opt=g["intra_dist_opt"],
            )
        return self._pg_collection

    def p2p_communicator(self, config):
        """megatron P2PCommunicator over this layout's pipeline group (for the PP schedules)."""
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        return P2PCommunicator(pp_group=self.pp_group, config=config)

    @contextlib.contextmanager
    def activate(self) -> Iterator["ParallelLayout"]:
        """Point megatron's global parallel_state at this layout for the duration of the block.

        Nests (restores whatever was active before). Run model building, forward/backward,
        finalize_model_grads, DDP/optimizer construction and steps, and checkpointing inside it. Which globals it
        writes, and which it leaves alone, is parallel/megatron_patches/parallel_state_groups.py's list.
        """
        self._check_member()
        with pointed_at(parallel_state_values(self._groups, self._group_ranks)):
            yield self


def rank_groups(ranks: Sequence[int], tp: int, pp: int, dp: int, ep: int = 1,
                etp: int | None = None, *, cp: int = 1) -> dict[str, list[list[int]]]:
    """Every process group of a layout over `ranks`, as lists of global ranks (pure arithmetic, no world).

    Dense groups index ranks as tp + tp*(cp_i + cp*(dp_i + dp*pp_i)) (megatron's "tp-cp-ep-dp-pp" with ep = 1):
    dp is the pure data-parallel group, dp_cp the ranks that hold the same weights (DDP's gradient reduction and the
    distributed optimizer run over it), mp is tp x pp. Expert groups re-read the tp*cp*dp ranks of each pipeline
    stage as etp (fastest) x ep x edp, which is what megatron's expert RankGenerator(order="tp-ep-dp-pp") builds
    (it has no cp: expert data parallel absorbs it); the pipeline groups of both views coincide.
    """
    etp = tp if etp is None else etp
    stage = tp * cp * dp
    edp = stage // (etp * ep)
    at = lambda i, c, j, k: ranks[i + tp * (c + cp * (j + dp * k))]  # noqa: E731  (tp, cp, dp, pp) coordinates
    ex = lambda a, b, c, k: ranks[a + etp * (b + ep * c) + stage * k]  # noqa: E731  (etp, ep, edp, pp)
    T, C, D, P = range(tp), range(cp), range(dp), range(pp)
    pp_lists = [[at(i, c, j, k) for k in P] for j in D for c in C for i in T]
    return {
        "tp": [[at(i, c, j, k) for i in T] for k in P for j in D for c in C],
        "cp": [[at(i, c, j, k) for c in C] for k in P for j in D for i in T],
        "dp": [[at(i, c, j, k) for j in D] for k in P for c in C for i in T],
        "dp_cp": [[at(i, c, j, k) for j in D for c in C] for k in P for i in T],
        "tp_cp": [[at(i, c, j, k) for c in C for i in T] for k in P for j in D],
        "pp": pp_lists,
        "mp": [[at(i, c, j, k) for k in P for i in T] for j in D for c in C],
        "tp_dp": [[at(i, c, j, k) for j in D for i in T] for k in P for c in C],
        "tp_dp_cp": [[at(i, c, j, k) for j in D for c in C for i in T] for k in P],
        "embd": [sorted({g[0], g[-1]}) for g in pp_lists],
        "pos_embd": [[g[0]] for g in pp_lists],
        "self": [[r] for r in ranks],
        "expt_tp": [[ex(a, b, c, k) for a in range(etp)] for k in P for c in range(edp) for b in range(ep)],
        "ep": [[ex(a, b, c, k) for b in range(ep)] for k in P for c in range(edp) for a in range(etp)],
        "tp_ep": [[ex(a, b, c, k) for b in range(ep) for a in range(etp)] for k in P for c in range(edp)],
        "tp_ep_pp": [[ex(a, b, c, k) for k in P for b in range(ep) for a in range(etp)]
                     for c in range(edp)],
        "expt_dp": [[ex(a, b, c, k) for c in range(edp)] for k in P for b in range(ep) for a in range(etp)],
        # one distributed-optimizer instance spans every rank of the layout: its grad norm (and zero count) sums
        # the shards of all TP x CP x PP x DP ranks (megatron's intra_dist_opt group with one instance)
        "intra_dist_opt": [[ex(a, b, c, k) for c in range(edp) for k in P for b in range(ep)
                            for a in range(etp)]],
    }
