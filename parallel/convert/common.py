"""Pure-tensor HF <-> Megatron conversion shared by every model family (no process groups here).

Owns tripod's Megatron layout contract (docs: /work/notes/megatron_layout.md, summarised):
- canonical ("full") tensors are keyed by Megatron GPTModel parameter names with the GLOBAL layer
  index, e.g. `decoder.layers.7.self_attention.linear_qkv.weight`; they are TP-independent, so the
  vocab tensors (`embedding.word_embeddings.weight`, `output_layer.weight`) are UNPADDED [V, H];
- linear_qkv rows are grouped per KV group g: [q heads of g, k head g, v head g] (same for bias);
- linear_fc1 = cat([gate_proj, up_proj], dim 0);
- TP slice r of t: qkv chunk r along dim 0 (t | num_kv_heads); fc1 = cat([gate chunk r, up chunk r]);
  linear_proj / linear_fc2 chunk r along dim 1; vocab tensors padded with zero rows to a multiple of
  128*t, then chunk r along dim 0; layernorms replicated.

A family module (llama.py, qwen2.py) supplies only its HF name map; see `FamilyNames`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch

from parallel.arch import ModelArch

VOCAB_DIVISIBLE_BY = 128  # megatron's make_vocab_size_divisible_by default; times TP size

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT_LAYER = "output_layer.weight"
LAYER_PREFIX = "decoder.layers."
QKV_WEIGHT = "self_attention.linear_qkv.weight"
QKV_BIAS = "self_attention.linear_qkv.bias"
PROJ_WEIGHT = "self_attention.linear_proj.weight"
FC1_WEIGHT = "mlp.linear_fc1.weight"
FC2_WEIGHT = "mlp.linear_fc2.weight"
INPUT_NORM = "input_layernorm.weight"
PRE_MLP_NORM = "pre_mlp_layernorm.weight"

_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# HF buffers some older checkpoints carry; they are recomputed, never loaded.
_IGNORED_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class FamilyNames:
    """One model family's HF names: how each Megatron tensor maps to one or more HF tensors.

    `layer_map(arch)` maps a Megatron per-layer suffix (e.g. QKV_WEIGHT) to the ordered HF per-layer
    suffixes it is fused from (q, k, v for qkv; gate, up for fc1; one name otherwise).
    """
    family: str
    embedding: str
    final_norm: str
    output_layer: str
    hf_layer_prefix: str
    layer_map: Callable[[ModelArch], dict[str, tuple[str, ...]]]
    check_supported: Callable[[ModelArch], None]


# ----------------------------------------------------------------------------- vocab padding

def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Megatron's padded vocab: `vocab_size` rounded up to a multiple of 128 * tp_size."""
    multiple = VOCAB_DIVISIBLE_BY * tp_size
    return -(-vocab_size // multiple) * multiple


def pad_vocab(arch: ModelArch, weight: torch.Tensor, tp_size: int) -> torch.Tensor:
    """[V or V_pad', H] -> [V_pad(tp_size), H] with zero rows past `arch.vocab_size`."""
    rows = unpad_vocab(arch, weight)
    padded = padded_vocab_size(arch.vocab_size, tp_size)
    out = rows.new_zeros((padded, *rows.shape[1:]))
    out[: arch.vocab_size] = rows
    return out


def unpad_vocab(arch: ModelArch, weight: torch.Tensor) -> torch.Tensor:
    """Strip Megatron's padding rows: [V_pad, H] -> [V, H] (a no-op on an unpadded tensor)."""
    if weight.shape[0] < arch.vocab_size:
        raise ValueError(f"vocab tensor has {weight.shape[0]} rows < vocab_size={arch.vocab_size} "
                         "from config.json; the weights do not belong to this config")
    return weight[: arch.vocab_size]


# ----------------------------------------------------------------------------- names

def split_layer_name(name: str) -> tuple[int | None, str]:
    """`decoder.layers.3.mlp.linear_fc1.weight` -> (3, 'mlp.linear_fc1.weight'); others -> (None, name)."""
    m = _LAYER_NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def layer_name(layer: int, suffix: str) -> str:
    return f"{LAYER_PREFIX}{layer}.{suffix}"


def megatron_names(arch: ModelArch, names: FamilyNames) -> list[str]:
    """Every canonical Megatron name of the model, in checkpoint order (global layer index)."""
    out = [EMBEDDING]
    suffixes = list(names.layer_map(arch))
    out += [layer_name(i, s) for i in range(arch.num_layers) for s in suffixes]
    out.append(FINAL_NORM)
    if not arch.tie_word_embeddings:
        out.append(OUTPUT_LAYER)
    return out


def hf_names_for(arch: ModelArch, names: FamilyNames, name: str) -> tuple[str, ...]:
    """The HF tensor names one canonical Megatron tensor is made of, in fusion order."""
    layer, suffix = split_layer_name(name)
    if layer is not None:
        layer_map = names.layer_map(arch)
        if suffix not in layer_map or not 0 <= layer < arch.num_layers:
            raise KeyError(f"{name!r} is not a parameter of this {arch.family} model "
                           f"({arch.num_layers} layers, known per-layer names {sorted(layer_map)})")
        return tuple(f"{names.hf_layer_prefix}{layer}.{s}" for s in layer_map[suffix])
    fixed = {EMBEDDING: names.embedding, FINAL_NORM: names.final_norm}
    if not arch.tie_word_embeddings:
        fixed[OUTPUT_LAYER] = names.output_layer
    if name not in fixed:
        raise KeyError(f"{name!r} is not a parameter of this {arch.family} model "
                       f"(tie_word_embeddings={arch.tie_word_embeddings})")
    return (fixed[name],)


def _preview(items: Iterable[str], limit: int = 12) -> str:
    items = sorted(items)
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_hf_names(arch: ModelArch, names: FamilyNames, present: Iterable[str], source: str) -> None:
    """Raise ValueError listing missing / unexpected HF tensors of a checkpoint (`source` names it)."""
    expected = {h for m in megatron_names(arch, names) for h in hf_names_for(arch, names, m)}
    present = {n for n in present if not _IGNORED_HF.search(n)}
    if arch.tie_word_embeddings:
        present.discard(names.output_layer)  # a tied checkpoint may still carry the duplicate
    missing, extra = expected - present, present - expected
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {_preview(missing)}")
        if extra:
            parts.append(f"unexpected {len(extra)} tensor(s): {_preview(extra)}")
        raise ValueError(
            f"{source}: weights do not match config.json ({arch.family}, num_hidden_layers="
            f"{arch.num_layers}, tie_word_embeddings={arch.tie_word_embeddings}, qkv_bias={arch.qkv_bias}); "
            + "; ".join(parts)
            + ". Fix: use the config.json that was saved with these weights (or re-save the model "
              "with save_pretrained).")


# ----------------------------------------------------------------------------- fusion

def fuse_to_megatron(arch: ModelArch, name: str, hf_tensors: list[torch.Tensor]) -> torch.Tensor:
    """HF tensors (in `hf_names_for` order) -> the canonical full Megatron tensor `name`."""
    _, suffix = split_layer_name(name)
    if suffix in (QKV_WEIGHT, QKV_BIAS):
        q, k, v = hf_tensors
        nkv, hd = arch.num_kv_heads, arch.head_dim
        rest = q.shape[1:]
        grouped = torch.cat([q.reshape(nkv, arch.heads_per_group * hd, *rest),
                             k.reshape(nkv, hd, *rest), v.reshape(nkv, hd, *rest)], dim=1)
        return grouped.reshape(-1, *rest)
    if suffix == FC1_WEIGHT:
        gate, up = hf_tensors
        return torch.cat([gate, up], dim=0)
    (tensor,) = hf_tensors
    return tensor


def unfuse_to_hf(arch: ModelArch, name: str, full: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of `fuse_to_megatron` (vocab tensors are unpadded here)."""
    _, suffix = split_layer_name(name)
    if suffix in (QKV_WEIGHT, QKV_BIAS):
        nkv, hd, hpg = arch.num_kv_heads, arch.head_dim, arch.heads_per_group
        rest = full.shape[1:]
        grouped = full.reshape(nkv, (hpg + 2) * hd, *rest)
        q, k, v = grouped.split([hpg * hd, hd, hd], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]
    if suffix == FC1_WEIGHT:
        return [t.contiguous() for t in full.chunk(2, dim=0)]
    if name in (EMBEDDING, OUTPUT_LAYER):
        return [unpad_vocab(arch, full).contiguous()]
    return [full]


# ----------------------------------------------------------------------------- tensor parallelism

def check_tp_size(arch: ModelArch, tp_size: int) -> None:
    if tp_size < 1 or arch.num_kv_heads % tp_size or arch.num_heads % tp_size:
        raise ValueError(f"tensor_model_parallel_size={tp_size} must divide num_attention_heads="
                         f"{arch.num_heads} and num_key_value_heads={arch.num_kv_heads}; use one of "
                         f"{[t for t in range(1, arch.num_kv_heads + 1) if arch.num_kv_heads % t == 0]}")


def tp_slice(arch: ModelArch, name: str, full: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """The shard of canonical tensor `name` that Megatron holds on TP rank `tp_rank` of `tp_size`."""
    check_tp_size(arch, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is outside [0, {tp_size})")
    _, suffix = split_layer_name(name)
    if name in (EMBEDDING, OUTPUT_LAYER):
        return pad_vocab(arch, full, tp_size).chunk(tp_size, dim=0)[tp_rank].contiguous()
    if suffix in (QKV_WEIGHT, QKV_BIAS):
        return full.chunk(tp_size, dim=0)[tp_rank].contiguous()
    if suffix == FC1_WEIGHT:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
    if suffix in (PROJ_WEIGHT, FC2_WEIGHT):
        return full.chunk(tp_size, dim=1)[tp_rank].contiguous()
    if is_replicated(name):
        return full
    raise KeyError(f"tp_slice: no tensor-parallel rule for {name!r}")


def tp_merge(arch: ModelArch, name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `tp_slice`: the TP-rank-ordered shards -> the canonical full tensor (vocab unpadded)."""
    tp_size = len(shards)
    check_tp_size(arch, tp_size)
    _, suffix = split_layer_name(name)
    if name in (EMBEDDING, OUTPUT_LAYER):
        return unpad_vocab(arch, torch.cat(shards, dim=0))
    if suffix in (QKV_WEIGHT, QKV_BIAS):
        return torch.cat(shards, dim=0)
    if suffix == FC1_WEIGHT:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if suffix in (PROJ_WEIGHT, FC2_WEIGHT):
        return torch.cat(shards, dim=1)
    if is_replicated(name):
        return shards[0]
    raise KeyError(f"tp_merge: no tensor-parallel rule for {name!r}")


def is_replicated(name: str) -> bool:
    """True for tensors every TP rank holds whole (the RMSNorm weights)."""
    _, suffix = split_layer_name(name)
    return name == FINAL_NORM or suffix in (INPUT_NORM, PRE_MLP_NORM)


def full_shape(arch: ModelArch, name: str) -> tuple[int, ...]:
    """Shape of the canonical (unpadded, TP-independent) tensor `name`."""
    H, hd = arch.hidden_size, arch.head_dim
    _, suffix = split_layer_name(name)
    qkv_rows = (arch.num_heads + 2 * arch.num_kv_heads) * hd
    shapes = {QKV_WEIGHT: (qkv_rows, H), QKV_BIAS: (qkv_rows,), PROJ_WEIGHT: (H, arch.num_heads * hd),
              FC1_WEIGHT: (2 * arch.ffn_hidden_size, H), FC2_WEIGHT: (H, arch.ffn_hidden_size),
              INPUT_NORM: (H,), PRE_MLP_NORM: (H,)}
    if name in (EMBEDDING, OUTPUT_LAYER):
        return (arch.vocab_size, H)
    if name == FINAL_NORM:
        return (H,)
    return shapes[suffix]


# ----------------------------------------------------------------------------- whole state dicts

def hf_to_megatron_state(arch: ModelArch, names: FamilyNames,
                         hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole HF state dict -> canonical full Megatron tensors (strict: missing/extra names raise)."""
    names.check_supported(arch)
    check_hf_names(arch, names, hf_state.keys(), source="HF state dict")
    out = {}
    for name in megatron_names(arch, names):
        parts = [hf_state[h] for h in hf_names_for(arch, names, name)]
        full = fuse_to_megatron(arch, name, parts)
        if tuple(full.shape) != full_shape(arch, name):
            raise ValueError(f"{'/'.join(hf_names_for(arch, names, name))}: shape {tuple(full.shape)} "
                             f"for {name} != expected {full_shape(arch, name)} from config.json")
        out[name] = full
    return out


def megatron_to_hf_tensor(arch: ModelArch, names: FamilyNames, name: str,
                          full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One canonical Megatron tensor -> [(hf_name, tensor), ...]."""
    if name == OUTPUT_LAYER and arch.tie_word_embeddings:
        return []  # tied: HF's lm_head is the embedding, exported once as embed_tokens
    return list(zip(hf_names_for(arch, names, name), unfuse_to_hf(arch, name, full)))
