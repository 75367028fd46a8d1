"""`FamilySpec`: everything tripod knows about one model family, and the geometry of every split rule.

A family is one table of `Weight` rows (megatron name, the HF names fused into it, canonical shape, how it
splits over TP, whether it is per expert) plus the hooks that build the megatron layer spec, read
family-specific HF config fields and name the rollout decoder. The converter (parallel/convert/), the
hybrid-engine plan and transport (parallel/hybrid_engine/) and the embedded decoder (engine/rollout/) read
split rules only from here: `shard`/`merge`/`local_shape`/`subshard_segments` are the one implementation of
each `Split` kind.

Canonical tensors use megatron GPTModel names with the GLOBAL layer index and are TP-independent (vocab
tensors unpadded). `Split.VOCAB` tensors are zero-padded to megatron's padded vocab before they split.

Mixture-of-Experts rows (one mechanism, two row fields):
- `Weight.layers` says which decoder layers carry the row: every layer, only the dense-MLP layers or only the
  MoE layers (`arch.moe.layer_is_moe`, HF's dense/MoE pattern). Attention rows are `Layers.ALL`.
- `Weight.per_expert=True` repeats the row for every routed expert: its megatron and HF names carry `{e}`, the
  GLOBAL expert index (`decoder.layers.3.mlp.experts.local_experts.{e}.linear_fc1.weight`). Canonical tensors
  are megatron's names at ep=1. Under expert parallelism EP rank r holds the n_local = num_experts / ep
  consecutive experts [r * n_local, (r + 1) * n_local) as `local_experts.0..n_local-1` (`ep_local_name` /
  `ep_global_name`), and within one expert the row's `tp` split applies over the EXPERT-tensor-parallel group
  (size etp, not tp): callers pass (etp, etp_rank) to `shard`/`merge` for such rows (`split_size`).
Buffers that belong to the model (the router's `expert_bias`) are rows like parameters.
"""
from __future__ import annotations

import enum
import re
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


class Layers(str, enum.Enum):
    """Which decoder layers carry a per-layer row."""

    ALL = "all"      # every layer (attention, norms)
    DENSE = "dense"  # layers with a dense MLP (all layers of a dense model; DeepSeek's first_k_dense_replace)
    MOE = "moe"      # layers with a routed-expert MLP (arch.moe.layer_is_moe)


@dataclass(frozen=True)
class Weight:
    """One row of a family's table.

    `megatron`: per-layer suffix (`per_layer=True`, e.g. `mlp.linear_fc1.weight`) or global name.
    `hf`: the HF names (per-layer suffixes after `FamilySpec.hf_layer_prefix{i}.` when per_layer) fused into
    it, in fusion order. `shape(arch)`: canonical full shape (unpadded vocab). `tp`: the TP split.
    `per_expert`: the row repeats per expert (names carry `{e}`; see the module docstring for EP).
    `layers`: which decoder layers carry a per-layer row (`Layers`).
    `fp32`: held in fp32 whatever the parameter dtype, by megatron and HF (the router's expert bias): export
    never casts it, and the hybrid engine moves it in fp32 whatever the rollout dtype.
    `te`: the suffix this tensor has when megatron builds the layer with Transformer Engine's spec, where it differs
    from the local spec's (`megatron`): TE folds a norm into the linear after it (TELayerNormColumnParallelLinear),
    so `input_layernorm.weight` becomes `self_attention.linear_qkv.layer_norm_weight`. None: the same in both specs.
    """

    megatron: str
    hf: tuple[str, ...]
    shape: Callable[["ModelArch"], tuple[int, ...]]
    tp: Split
    fuse: Fuse = Fuse.NONE
    per_layer: bool = True
    per_expert: bool = False
    layers: Layers = Layers.ALL
    fp32: bool = False
    te: str | None = None


@dataclass(frozen=True)
class FamilySpec:
    """One model family. Register it with `tripod.parallel.families.register_family`.

    name: tripod family name (`ModelArch.family`). hf_model_types: the HF `model_type`s it serves.
    hf_layer_prefix: HF prefix of per-layer names (`model.layers.`). weights(arch): the table (global rows
    and per-layer rows; the only place TP/EP split rules are written). check_supported(arch): refuse
    configs the family cannot represent (one clear line). qkv_bias(hf_config): whether q/k/v carry biases.
    layer_spec(arch, use_te): the megatron transformer layer spec (one spec for every layer), or, for models whose
    layers differ (MoE / MLA), block_spec(arch, use_te, config, vp_stage): megatron's decoder block spec of this
    rank's layers. megatron_fields(arch): extra TransformerConfig fields (MoE routing, MLA dims, qk norm).
    extra_hf_layers: a reason to skip HF tensors of layers >= num_hidden_layers on read (DeepSeek MTP).
    rollout_decoder: "module:Class" of the decoder the embedded rollout engine runs on a generation shard.
    """

    name: str
    hf_model_types: tuple[str, ...]
    hf_layer_prefix: str
    weights: Callable[["ModelArch"], tuple[Weight, ...]]
    check_supported: Callable[["ModelArch"], None]
    qkv_bias: Callable[[dict[str, Any]], bool]
    layer_spec: Callable[["ModelArch", bool], Any] | None = None
    block_spec: Callable[["ModelArch", bool, Any, "int | None"], Any] | None = None
    megatron_fields: Callable[["ModelArch"], dict[str, Any]] | None = None
    rollout_decoder: str = "tripod.engine.rollout.tp_decoder:TPDecoder"
    notes: str = field(default="", compare=False)
    extra_hf_layers: str | None = None

    def __post_init__(self) -> None:
        if (self.layer_spec is None) == (self.block_spec is None):
            raise ValueError(f"family {self.name!r}: give exactly one of layer_spec and block_spec")

    # ---- the table, by canonical name ------------------------------------------------------------
    def rows(self, arch: "ModelArch") -> dict[str, Weight]:
        """Every canonical megatron name (global layer and expert index) -> its row, in checkpoint order."""
        table = self.weights(arch)
        out: dict[str, Weight] = {}
        head = [w for w in table if not w.per_layer and w.megatron == EMBEDDING]
        tail = [w for w in table if not w.per_layer and w.megatron != EMBEDDING]
        for w in head:
            out[w.megatron] = w
        for i in range(arch.num_layers):
            for w in table:
                if w.per_layer and _layer_has(arch, w, i):
                    for e in range(num_experts(arch) if w.per_expert else 1):
                        out[f"{LAYER_PREFIX}{i}.{w.megatron.format(e=e)}"] = w
        for w in tail:
            if w.megatron == OUTPUT_LAYER and arch.tie_word_embeddings:
                continue
            out[w.megatron] = w
        return out

    def row(self, arch: "ModelArch", name: str) -> Weight:
        """The row of canonical name `name` (found without expanding the whole table)."""
        table = self.weights(arch)
        layer, suffix = _split_layer(name)
        if layer is None:
            found = [w for w in table if not w.per_layer and w.megatron == name
                     and not (name == OUTPUT_LAYER and arch.tie_word_embeddings)]
        else:
            expert, pattern = _split_expert(suffix)
            found = [w for w in table if w.per_layer and w.megatron == pattern and w.per_expert == (expert is not None)
                     and layer < arch.num_layers and _layer_has(arch, w, layer)
                     and (expert is None or expert < num_experts(arch))]
        if not found:
            raise KeyError(f"{name!r} is not a parameter of this {arch.family} model ({arch.num_layers} layers, "
                           f"tie_word_embeddings={arch.tie_word_embeddings}"
                           f"{', ' + str(num_experts(arch)) + ' experts' if arch_moe(arch) else ''})")
        return found[0]

    def canonical_suffix(self, arch: "ModelArch", suffix: str) -> str:
        """A layer's tensor name (after `decoder.layers.<i>.`) as megatron built it, with the local or the Transformer
        Engine spec -> the table's (local-spec) name. TE's names come from the rows' `te` field, so one table serves
        both specs (tests/unit/test_te_names.py checks them against megatron's TE spec)."""
        for w in self.weights(arch):
            if w.te is not None and w.te == suffix:
                return w.megatron
        return suffix

    def is_expert(self, arch: "ModelArch", name: str) -> bool:
        """True for a routed expert's tensor (split over the expert groups, not TP)."""
        return self.row(arch, name).per_expert

    def split_size(self, arch: "ModelArch", name: str, tp: int, etp: int | None = None) -> int:
        """The size of the group `name` is cut over: expert-TP for routed-expert rows, TP otherwise."""
        return (tp if etp is None else etp) if self.row(arch, name).per_expert else tp

    def hf_names(self, arch: "ModelArch", name: str) -> tuple[str, ...]:
        """The HF tensor names canonical tensor `name` is fused from, in order."""
        w = self.row(arch, name)
        if not w.per_layer:
            return w.hf
        layer, suffix = _split_layer(name)
        expert, _ = _split_expert(suffix)
        return tuple(f"{self.hf_layer_prefix}{layer}.{h.format(e=expert) if w.per_expert else h}" for h in w.hf)

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
        """The piece of canonical tensor `name` that rank `rank` of its split group (size `tp`) holds in megatron:
        the TP group, or the expert-TP group for a routed expert's row (pass etp, etp_rank then)."""
        w = self.row(arch, name)
        _check_split_size(arch, w, tp)
        if not 0 <= rank < tp:
            raise ValueError(f"tp_rank={rank} is outside [0, {tp})")
        if w.tp is Split.VOCAB:
            full = pad_rows(full, arch.vocab_size, padded_vocab_size(arch.vocab_size, tp))
        return shard(w.tp, full, tp, rank).contiguous()

    def merge(self, arch: "ModelArch", name: str, shards: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of `shard`: rank-ordered pieces -> the canonical tensor (vocab unpadded)."""
        w = self.row(arch, name)
        _check_split_size(arch, w, len(shards))
        full = merge(w.tp, shards)
        return unpad_rows(full, arch.vocab_size) if w.tp is Split.VOCAB else full

    def local_shapes(self, arch: "ModelArch", tp: int, vocab_rows: int, etp: int | None = None
                     ) -> dict[str, tuple[int, ...]]:
        """Shape of every parameter on one TP rank of `tp` (expert rows: one expert-TP rank of `etp`, default tp),
        vocab padded to `vocab_rows` (global). Keys are canonical (global expert index)."""
        return {n: local_shape(w.tp, self.padded_shape(arch, n, vocab_rows), (etp or tp) if w.per_expert else tp)
                for n, w in self.rows(arch).items()}

    # ---- expert parallelism: canonical (global expert) <-> EP-local names ---------------------------
    def ep_owner(self, arch: "ModelArch", name: str, ep: int) -> int | None:
        """The EP rank (of `ep`) that holds routed-expert tensor `name`; None for tensors every EP rank holds."""
        if not self.row(arch, name).per_expert:
            return None
        return expert_index(name) // _experts_per_rank(arch, ep)

    def ep_local_name(self, arch: "ModelArch", name: str, ep: int) -> str:
        """Canonical name -> the name megatron's GPTModel uses on the owning EP rank (local expert index)."""
        if not self.row(arch, name).per_expert:
            return name
        return _with_expert(name, expert_index(name) % _experts_per_rank(arch, ep))

    def ep_global_name(self, arch: "ModelArch", local_name: str, ep: int, ep_rank: int) -> str:
        """Inverse of `ep_local_name` on EP rank `ep_rank`: megatron's local expert index -> the global one."""
        e = expert_index(local_name)
        if e is None:
            return local_name
        n_local = _experts_per_rank(arch, ep)
        if e >= n_local:
            raise ValueError(f"{local_name}: local expert {e} >= num_experts/ep = {n_local}; the model was not "
                             f"built with expert_model_parallel_size={ep}")
        return _with_expert(local_name, ep_rank * n_local + e)


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


_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _split_layer(name: str) -> tuple[int | None, str]:
    m = _LAYER.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def _split_expert(suffix: str) -> tuple[int | None, str]:
    """`mlp.experts.local_experts.5.linear_fc1.weight` -> (5, `mlp.experts.local_experts.{e}.linear_fc1.weight`)."""
    m = _EXPERT.search(suffix)
    if m is None:
        return None, suffix
    return int(m.group(2)), suffix[:m.start()] + m.group(1) + "{e}" + m.group(3) + suffix[m.end():]


def expert_index(name: str) -> int | None:
    """The expert index in a megatron name (`...local_experts.{e}...`), None for other tensors."""
    m = _EXPERT.search(name)
    return int(m.group(2)) if m else None


def _with_expert(name: str, e: int) -> str:
    return _EXPERT.sub(lambda m: f"{m.group(1)}{e}{m.group(3)}", name, count=1)


def arch_moe(arch: "ModelArch"):
    return getattr(arch, "moe", None)


def num_experts(arch: "ModelArch") -> int:
    moe = arch_moe(arch)
    return moe.num_experts if moe is not None else 0


def _experts_per_rank(arch: "ModelArch", ep: int) -> int:
    n = num_experts(arch)
    if ep < 1 or not n or n % ep:
        raise ValueError(f"expert_model_parallel_size={ep} must divide num_experts={n}")
    return n // ep


def _layer_has(arch: "ModelArch", w: Weight, layer: int) -> bool:
    if w.layers is Layers.ALL:
        return True
    moe = arch_moe(arch)
    is_moe = bool(moe is not None and moe.layer_is_moe[layer])
    return is_moe == (w.layers is Layers.MOE)


def _check_split_size(arch: "ModelArch", w: Weight, size: int) -> None:
    if not w.per_expert:
        check_tp_size(arch, size)
        return
    ffn = arch.moe.expert_ffn_hidden_size
    if size < 1 or ffn % size:
        raise ValueError(f"expert_tensor_parallel_size={size} must divide moe_intermediate_size={ffn}; use one of "
                         f"{[t for t in range(1, ffn + 1) if ffn % t == 0]}")


def check_tp_size(arch: "ModelArch", tp_size: int) -> None:
    if tp_size < 1 or arch.num_kv_heads % tp_size or arch.num_heads % tp_size:
        raise ValueError(f"tensor_model_parallel_size={tp_size} must divide num_attention_heads="
                         f"{arch.num_heads} and num_key_value_heads={arch.num_kv_heads}; use one of "
                         f"{[t for t in range(1, arch.num_kv_heads + 1) if arch.num_kv_heads % t == 0]}")
    mla = getattr(arch, "mla", None)
    if mla is not None:  # megatron's local MLA splits the down projections' outputs over TP too
        for key, rows in (("q_lora_rank", mla.q_lora_rank or 0), ("kv_lora_rank+qk_rope_head_dim",
                                                                  mla.kv_lora_rank + mla.qk_rope_head_dim)):
            if rows % tp_size:
                raise ValueError(f"tensor_model_parallel_size={tp_size} must divide {key}={rows} (MLA)")


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
