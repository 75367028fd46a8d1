"""`LoraAdapter`: low-rank adapters on one megatron parallel linear, sharded like the linear.

out = base(x) + scale * B @ A @ dropout(x), scale = alpha / rank (peft's), one (A, B) per HF part of a fused linear.

Column-parallel (linear_qkv, linear_fc1, MLA's projections): A [r, in] is replicated; B [out_part / tp, r] holds the
rows of this rank's output shard. h = A x is identical on every TP rank, but each rank's B sees only its rows, so
h's gradient is all-reduced over TP (megatron's copy_to_tensor_model_parallel_region): A then gets the full
gradient on every rank, like any replicated parameter, and x's gradient is complete (under sequence parallelism the
gathered input's gradient is split back, not summed). The parts' outputs are laid out as the base weight's rows:
q/k/v regrouped per local KV group, [gate; up] per rank.

Row-parallel (linear_proj, linear_fc2): A [r, in / tp] holds the input columns of the shard, B [out, r] is
replicated; the partial A x is all-reduced (as the base output is), and under sequence parallelism B's output is
split over the sequence like the base output's reduce-scatter.

MLA (megatron's local spec) makes every projection but linear_proj column-parallel, the down projections included
(their outputs all-gathered over TP, then scattered over the sequence under SP; nothing is duplicated over TP): their
adapters are the column-parallel ones above. The adapter's share must be in kv_down's output before cpu_compat's
mla_rope_key_grad hook tags it (apply.py registers the adapter's hook first), or the RoPE key's gradient misses its
TP sum for the adapted output.

Experts (megatron's explicit expert communication: the dispatcher all-gathers the tokens over the expert TP x EP ranks
and reduce-scatters the expert outputs, summing the partial products of a row-parallel fc2) take no TP communication
of their own. Under expert tensor parallelism (ETP > 1) the adapters shard as the expert's linears do (fc1: B split
by rows; fc2: A split by columns) and their products stay partial like the expert's: the column-parallel h = A x is
the same on every ETP rank and each rank's B sees only its rows, the row-parallel h = A x is partial and B's output
is summed by the dispatcher with the base's. Only the replicated factor's gradient is then partial on each ETP rank
(fc1's A: a rank's h gradient comes from its rows only; fc2's B: from its h share), so that factor enters the
product through copy_to_tensor_model_parallel_region (identity forward, gradient all-reduced over expert TP). The
input's gradient stays partial, as the base linear's is: the dispatcher's reduce-scatter sums it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tripod.parallel.families.spec import Fuse, Split
from tripod.parallel.lora.targets import LinearTarget


@dataclass(frozen=True)
class AdapterSpec:
    """Where one adapter sits: its linear kind, the adapted parts, the global layer and expert, the HF names."""

    target: LinearTarget
    parts: tuple[str, ...]
    layer: int
    expert: int | None

    @property
    def part_rows(self) -> tuple[int, ...]:
        """Each adapted part's full output rows (HF's out_features)."""
        rows = dict(zip(self.target.parts, self.target.rows()))
        return tuple(rows[p] for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.target.shape[1]

    def hf_module(self, part: str, layer_prefix: str) -> str:
        """`model.layers.3.self_attn.q_proj` (experts: `.mlp.experts.5.gate_proj`)."""
        name = part.format(e=self.expert) if self.expert is not None else part
        return f"{layer_prefix}{self.layer}.{name}"


def check_module(module: torch.nn.Module, target: LinearTarget, where: str) -> None:
    """Refuse (one line) a linear whose layout the adapter does not implement."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    cls = RowParallelLinear if target.row_parallel else ColumnParallelLinear
    if type(module) is not cls:
        raise ValueError(f"LoRA on {where}: {type(module).__name__} is not supported (megatron's local "
                         f"{cls.__name__} only; Transformer Engine layers fold norms into linears); drop it from "
                         "target_modules or build without Transformer Engine (megatron.use_te=false)")
    if target.fuse == Fuse.CONCAT and target.split != Split.GATED_ROW or \
            target.split not in (Split.ROW, Split.COL, Split.GATED_ROW):
        raise ValueError(f"LoRA on {where}: a {target.fuse.value}/{target.split.value} weight is not supported")


class LoraAdapter(torch.nn.Module):
    """The adapters of one linear (attached to it as `.lora`; its forward hook adds `self(x)` to the output)."""

    def __init__(self, module: torch.nn.Module, spec: AdapterSpec, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.spec = spec
        self.rank, self.scale = rank, alpha / rank
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None
        self.tp_group = module.tp_group
        self.tp = torch.distributed.get_world_size(self.tp_group) if self.tp_group is not None else 1
        self.tp_rank = torch.distributed.get_rank(self.tp_group) if self.tp > 1 else 0
        self.expert = getattr(module, "explicit_expert_comm", False)
        self.sequence_parallel = bool(getattr(module, "sequence_parallel", False)) and not self.expert
        self.gather_output = bool(getattr(module, "gather_output", False))
        self.row = spec.target.row_parallel
        self.enabled = True
        weight = module.weight
        in_local = spec.in_features // self.tp if self.row else spec.in_features
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        for part, rows in zip(spec.parts, spec.part_rows):
            key = part_key(part)
            a = torch.zeros(rank, in_local, dtype=weight.dtype, device=weight.device)
            b = torch.zeros(rows if self.row else rows // self.tp, rank, dtype=weight.dtype, device=weight.device)
            self.lora_A[key], self.lora_B[key] = torch.nn.Parameter(a), torch.nn.Parameter(b)
            if self.tp > 1:
                from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

                set_tensor_model_parallel_attributes(self.lora_A[key] if self.row else self.lora_B[key],
                                                     True, 1 if self.row else 0, 1)
            if self.expert:  # reduced over the expert-data-parallel group only, like the expert's weight
                self.lora_A[key].allreduce = False
                self.lora_B[key].allreduce = False
        if self.expert:
            self._count_once_in_grad_norm()

    def _count_once_in_grad_norm(self) -> None:
        """megatron's optimizer counts a parameter in the gradient norm where it is `tensor_model_parallel` or on
        dense-TP rank 0, never where it is `shared`, then sums over its ranks. An expert's adapters live on one expert
        rank whatever its dense-TP rank, so both factors are marked tensor-parallel (as megatron marks the expert's
        own weights, split or not); the replicated factor (fc1's A, fc2's B) has a copy on every expert-TP rank and is
        counted on expert-TP rank 0 only. Without this the norm (clipping, actor/grad_norm) missed the experts of
        dense-TP ranks > 0 at ETP1, and counted the replicated factor ETP times where the dense TP was 1."""
        for key in self.lora_A:
            for factor in (self.lora_A[key], self.lora_B[key]):
                factor.tensor_model_parallel = True
            if self.tp_rank > 0:
                (self.lora_B[key] if self.row else self.lora_A[key]).shared = True

    def local_delta_weight(self) -> torch.Tensor:
        """scale * B @ A laid out as this rank's shard of the base weight (rows and columns), in the adapter dtype."""
        deltas = [self.lora_B[part_key(p)] @ self.lora_A[part_key(p)] for p in self.spec.parts]
        return self._combine([d.unsqueeze(0) for d in deltas], transpose=True).squeeze(0) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.dropout is not None:
            x = self.dropout(x)
        keys = [part_key(p) for p in self.spec.parts]
        if self.row:
            h, b = x @ self.lora_A[keys[0]].t(), self.lora_B[keys[0]]
            if self.tp > 1 and self.expert:
                b = self._sum_grad_over_expert_tp(b)
            elif self.tp > 1:
                h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
            y = (h @ b.t()) * self.scale
            if self.sequence_parallel and self.tp > 1:
                y = mappings.scatter_to_sequence_parallel_region(y, group=self.tp_group)
            return y
        if self.sequence_parallel and self.tp > 1:
            x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                              group=self.tp_group)
        a = torch.cat([self.lora_A[k] for k in keys], 0) if len(keys) > 1 else self.lora_A[keys[0]]
        if self.tp > 1 and self.expert:
            a = self._sum_grad_over_expert_tp(a)
        h = x @ a.t()
        if self.tp > 1 and not self.expert:
            h = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        outs = [h[..., i * self.rank:(i + 1) * self.rank] @ self.lora_B[k].t() for i, k in enumerate(keys)]
        y = self._combine(outs) * self.scale
        if self.gather_output and self.tp > 1:
            y = mappings.gather_from_tensor_model_parallel_region(y, group=self.tp_group)
        return y

    def _sum_grad_over_expert_tp(self, factor: torch.Tensor) -> torch.Tensor:
        """An expert's replicated factor, its gradient (partial on each expert-TP rank) all-reduced over expert TP."""
        from megatron.core.tensor_parallel import mappings

        return mappings.copy_to_tensor_model_parallel_region(factor, group=self.tp_group)

    def _combine(self, outs: list[torch.Tensor], transpose: bool = False) -> torch.Tensor:
        """The parts' local outputs [..., rows_p] -> the base linear's local output rows (`transpose`: the parts are
        weights [rows_p, in], combined along their rows). A part the adapter leaves out contributes zeros."""
        t = self.spec.target
        if transpose:
            outs = [o.transpose(-1, -2) for o in outs]
        by_part = dict(zip(self.spec.parts, outs))
        ref = outs[0]

        def part(p: str, rows: int) -> torch.Tensor:
            return by_part[p] if p in by_part else ref.new_zeros(*ref.shape[:-1], rows)

        full_rows = t.rows()
        if t.fuse == Fuse.QKV_GROUPED:
            g = t.groups // self.tp
            pieces = [part(p, r // self.tp).reshape(*ref.shape[:-1], g, -1) for p, r in zip(t.parts, full_rows)]
            y = torch.cat(pieces, -1).reshape(*ref.shape[:-1], -1)
        elif len(t.parts) > 1:
            y = torch.cat([part(p, r // self.tp) for p, r in zip(t.parts, full_rows)], -1)
        else:
            y = ref
        return y.transpose(-1, -2) if transpose else y


def part_key(part: str) -> str:
    """A ParameterDict key for an HF part name (`self_attn.q_proj` -> `q_proj`, experts' `{e}` dropped)."""
    return part.rsplit(".", 1)[-1]


def kaiming_a(rank: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """peft's default A init (kaiming-uniform, a=sqrt(5): bound 1 / sqrt(in)), drawn on the host."""
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound
