"""`FamilySpec`: everything tripod knows about one model family, and the geometry of every split rule.

A family is one table of `Weight` rows (megatron name, the HF names fused into it, canonical shape, how it
splits over TP, whether it is per expert) plus the hooks that build the megatron layer spec, read
family-specific HF config fields and name the rollout decoder. The converter (parallel/convert/), the
hybrid-engine plan and transport (parallel/hybrid_engine/) and the embedded decoder (engine/rollout/) read
split rules only from here: `shard`/`merge`/`local_shape`/`subshard_segments` are the one implementation of
each `Split` kind.

Canonical tensors use megatron GPTModel names with the GLOBAL layer index and are TP-independent (vocab
tensors unpadded). `Split.VOCAB` tensors are zero-padded to megatron's padded vocab before they split.

Expert parallelism (MoE) plugs in per row: `Weight.per_expert=True` marks a row repeated for every expert,
whose megatron and HF names carry an `{e}` placeholder (global expert index). Under EP each rank holds
num_experts / ep consecutive experts (megatron's local expert i on EP rank r is global expert r * n_local + i),
and within one expert the row's `tp` split applies over the expert-tensor-parallel group. The dense
machinery skips nothing for such rows today because no registered family has one.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from tripod.parallel.arch import ModelArch


class Split(str, enum.Enum):
    """How one megatron parameter is cut over a TP group of size t (rank r holds piece r)."""

    REPLICATED = "replicated"  # every rank holds it whole (norm weights)
    ROW = "row"                # chunk r along dim 0 (column-parallel outputs: linear_qkv rows, grouped per KV head)
    COL = "col"                # chunk r along dim 1 (row-parallel inputs: linear_proj, linear_fc2)
    GATED_ROW = "gated_row"    # [gate; up] halves, each chunked along dim 0 (SwiGLU linear_fc1)
    VOCAB = "vocab"            # zero-padded to megatron's padded vocab, then chunk r along dim 0

    @property
    def megatron_partition_dim(self) -> int | None:
        """megatron's own `partition_dim` attribute for this split (None: not tensor-parallel)."""
        return {Split.REPLICATED: None, Split.COL: 1}.get(self, 0)


class Fuse(str, enum.Enum):
    """How the HF tensors of one row combine into the megatron tensor."""

    NONE = "none"                # one HF tensor, as is
    CONCAT = "concat"            # cat along dim 0 in HF-name order ([gate; up])
    QKV_GROUPED = "qkv_grouped"  # q, k, v regrouped per KV group: [q heads of g, k_g, v_g] for each g


@dataclass(frozen=True)
class Weight:
    """One row of a family's table.

    `megatron`: per-layer suffix (`per_layer=True`, e.g. `mlp.linear_fc1.weight`) or global name.
    `hf`: the HF names (per-layer suffixes after `FamilySpec.hf_layer_prefix{i}.` when per_layer) fused into
    it, in fusion order. `shape(arch)`: canonical full shape (unpadded vocab). `tp`: the TP split.
    `per_expert`: the row repeats per expert (names carry `{e}`; see the module docstring for EP).
    """

    megatron: str
    hf: tuple[str, ...]
    shape: Callable[["ModelArch"], tuple[int, ...]]
    tp: Split
    fuse: Fuse = Fuse.NONE
    per_layer: bool = True
    per_expert: bool = False


@dataclass(frozen=True)
class FamilySpec:
    """One model family. Register it with `tripod.parallel.families.register_family`.

    name: tripod family name (`ModelArch.family`). hf_model_types: the HF `model_type`s it serves.
    hf_layer_prefix: HF prefix of per-layer names (`model.layers.`). weights(arch): the table (global rows
    and per-layer rows; the only place TP/EP split rules are written). check_supported(arch): refuse
    configs the family cannot represent (one clear line). qkv_bias(hf_config): whether q/k/v carry biases.
    layer_spec(arch, use_te): the megatron transformer layer spec. rollout_decoder: "module:Class" of the
    decoder the embedded rollout engine runs on a generation shard of this family.
    """

    name: str
    hf_model_types: tuple[str, ...]
    hf_layer_prefix: str
    weights: Callable[["ModelArch"], tuple[Weight, ...]]
    check_supported: Callable[["ModelArch"], None]
    qkv_bias: Callable[[dict[str, Any]], bool]
    layer_spec: Callable[["ModelArch", bool], Any]
    rollout_decoder: str = "tripod.engine.rollout.tp_decoder:TPDecoder"
    notes: str = field(default="", compare=False)

    # ---- the table, by canonical name ------------------------------------------------------------
    def rows(self, arch: "ModelArch") -> dict[str, Weight]:
        """Every canonical megatron name (global layer index) -> its row, in checkpoint order."""
        table = self.weights(arch)
        out: dict[str, Weight] = {}
        head = [w for w in table if not w.per_layer and w.megatron == EMBEDDING]
        tail = [w for w in table if not w.per_layer and w.megatron != EMBEDDING]
        for w in head:
            out[w.megatron] = w
        for i in range(arch.num_layers):
            for w in table:
                if w.per_layer:
                    out[f"{LAYER_PREFIX}{i}.{w.megatron}"] = w
        for w in tail:
            if w.megatron == OUTPUT_LAYER and arch.tie_word_embeddings:
                continue
            out[w.megatron] = w
        return out

    def row(self, arch: "ModelArch", name: str) -> Weight:
        rows = self.rows(arch)
        if name not in rows:
            raise KeyError(f"{name!r} is not a parameter of this {arch.family} model ({arch.num_layers} layers, "
                           f"tie_word_embeddings={arch.tie_word_embeddings})")
        return rows[name]

    def hf_names(self, arch: "ModelArch", name: str) -> tuple[str, ...]:
        """The HF tensor names canonical tensor `name` is fused from, in order."""
        w = self.row(arch, name)
        if not w.per_layer:
            return w.hf
        layer = name[len(LAYER_PREFIX):].split(".", 1)[0]
        return tuple(f"{self.hf_layer_prefix}{layer}.{h}" for h in w.hf)

    def shape(self, arch: "ModelArch", name: str) -> tuple[int, ...]:
        """Canonical (TP-independent, vocab unpadded) shape of `name`."""
        return tuple(self.row(arch, name).shape(arch))

    def padded_shape(self, arch: "ModelArch", name: str, vocab_rows: int) -> tuple[int, ...]:
        """Megatron's global shape of `name` when the vocab is padded to `vocab_rows`."""
        w = self.row(arch, name)
        shape = tuple(w.shape(arch))
        return (vocab_rows, *shape[1:]) if w.tp is Split.VOCAB else shape

    # ---- canonical <-> TP shards -----------------------------------------------------------------
    def shard(self, arch: "ModelArch", name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        """The piece of canonical tensor `name` that TP rank `rank` of `tp` holds in megatron."""
        check_tp_size(arch, tp)
        if not 0 <= rank < tp:
            raise ValueError(f"tp_rank={rank} is outside [0, {tp})")
        split = self.row(arch, name).tp
        if split is Split.VOCAB:
            full = pad_rows(full, arch.vocab_size, padded_vocab_size(arch.vocab_size, tp))
        return shard(split, full, tp, rank).contiguous()

    def merge(self, arch: "ModelArch", name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `shard`: TP-rank-ordered pieces -> the canonical tensor (vocab unpadded)."""
        check_tp_size(arch, len(shards))
        split = self.row(arch, name).tp
        full = merge(split, shards)
        return unpad_rows(full, arch.vocab_size) if split is Split.VOCAB else full

    def local_shapes(self, arch: "ModelArch", tp: int, vocab_rows: int) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter on one TP rank of `tp`, vocab padded to `vocab_rows` (global)."""
        return {n: local_shape(w.tp, self.padded_shape(arch, n, vocab_rows), tp) for n, w in self.rows(arch).items()}


# ----------------------------------------------------------------------------- megatron names

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT_LAYER = "output_layer.weight"
LAYER_PREFIX = "decoder.layers."
VOCAB_DIVISIBLE_BY = 128  # megatron's make_vocab_size_divisible_by default; times TP size


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Megatron's padded vocab: `vocab_size` rounded up to a multiple of 128 * tp_size."""
    multiple = VOCAB_DIVISIBLE_BY * tp_size
    return -(-vocab_size // multiple) * multiple


def pad_rows(weight: torch.Tensor, vocab_size: int, rows: int) -> torch.Tensor:
    """[V or V_pad', ...] -> [rows, ...] with zero rows past `vocab_size`."""
    real = unpad_rows(weight, vocab_size)
    out = real.new_zeros((rows, *real.shape[1:]))
    out[:vocab_size] = real
    return out


def unpad_rows(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Strip megatron's vocab padding rows (a no-op on an unpadded tensor)."""
    if weight.shape[0] < vocab_size:
        raise ValueError(f"vocab tensor has {weight.shape[0]} rows < vocab_size={vocab_size} from config.json; "
                         "the weights do not belong to this config")
    return weight[:vocab_size]


def check_tp_size(arch: "ModelArch", tp_size: int) -> None:
    if tp_size < 1 or arch.num_kv_heads % tp_size or arch.num_heads % tp_size:
        raise ValueError(f"tensor_model_parallel_size={tp_size} must divide num_attention_heads="
                         f"{arch.num_heads} and num_key_value_heads={arch.num_kv_heads}; use one of "
                         f"{[t for t in range(1, arch.num_kv_heads + 1) if arch.num_kv_heads % t == 0]}")


# ----------------------------------------------------------------------------- split geometry (the only copy)

def shard(split: Split, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """Piece `rank` of `size` of a megatron-global tensor (vocab already padded) under `split`."""
    if split is Split.REPLICATED:
        return full
    if split in (Split.ROW, Split.VOCAB):
        return full.chunk(size, dim=0)[rank]
    if split is Split.COL:
        return full.chunk(size, dim=1)[rank]
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])


def merge(split: Split, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard`: rank-ordered pieces -> the megatron-global tensor (vocab still padded)."""
    if split is Split.REPLICATED:
        return shards[0]
    if split in (Split.ROW, Split.VOCAB):
        return torch.cat(shards, dim=0)
    if split is Split.COL:
        return torch.cat(shards, dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def local_shape(split: Split, shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Shape of one piece of a megatron-global tensor of `shape` split `size` ways."""
    out = list(shape)
    if split in (Split.ROW, Split.VOCAB, Split.GATED_ROW):
        out[0] //= size
    elif split is Split.COL:
        out[1] //= size
    return tuple(out)


def subshard_segments(split: Split, piece_shape: tuple[int, ...], q: int, k: int
                      ) -> list[tuple[tuple[slice, ...], tuple[slice, ...], tuple[int, ...]]]:
    """Where a TP=t piece lands inside a TP=t/k piece: piece q of the k consecutive TP=t ranks that make up
    one coarser rank. Returns (source slices in the fine piece, destination slices in the coarse piece,
    shape) per contiguous segment (two for GATED_ROW: the gate and the up half)."""
    full = tuple(slice(0, n) for n in piece_shape)
    if split is Split.REPLICATED:
        return [(full, full, piece_shape)]
    if split in (Split.ROW, Split.VOCAB):
        r = piece_shape[0]
        return [(full, (slice(q * r, (q + 1) * r),) + full[1:], piece_shape)]
    if split is Split.COL:
        c = piece_shape[1]
        return [(full, (full[0], slice(q * c, (q + 1) * c)) + full[2:], piece_shape)]
    half = piece_shape[0] // 2
    half_shape = (half,) + piece_shape[1:]
    coarse_half = half * k
    return [((slice(0, half),) + full[1:], (slice(q * half, (q + 1) * half),) + full[1:], half_shape),
            ((slice(half, 2 * half),) + full[1:],
             (slice(coarse_half + q * half, coarse_half + (q + 1) * half),) + full[1:], half_shape)]
