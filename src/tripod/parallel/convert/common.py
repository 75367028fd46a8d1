"""Pure-tensor HF <-> Megatron conversion shared by every model family (no process groups here).

Owns tripod's Megatron layout contract for canonical ("full") tensors:
- keyed by Megatron GPTModel parameter names with the GLOBAL layer index, e.g.
  `decoder.layers.7.self_attention.linear_qkv.weight`; TP-independent, so the vocab tensors
  (`embedding.word_embeddings.weight`, `output_layer.weight`) are UNPADDED [V, H];
- fusion of HF tensors (`Fuse`): linear_qkv rows grouped per KV group g: [q heads of g, k head g, v head g]
  (same for the bias); linear_fc1 = cat([gate_proj, up_proj], dim 0).
Which HF names fuse into which tensor, its shape and its TP split come from the family's table
(parallel/families/); how each split cuts a tensor is `tripod.parallel.families.spec` (the only copy).

Routed experts: canonical tensors are per expert (global expert index, `local_experts.{e}`); on the HF side
both layouts are read -- per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` (what save_pretrained writes,
and what export writes) and transformers-5's fused `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) /
`mlp.experts.down_proj` [E, H, I] (a model's in-memory state dict): `HFExpertViews` presents the fused tensors
under the per-expert names. HF layers past num_hidden_layers (DeepSeek-V3's MTP layers) are skipped on read
when the family says so (`FamilySpec.extra_hf_layers`), with one logged line.
"""
from __future__ import annotations

import logging
import re
from typing import Callable, Iterable, Mapping

import torch

from tripod.parallel.arch import ModelArch
from tripod.parallel.families.spec import (
    EMBEDDING,
    FINAL_NORM,
    LAYER_PREFIX,
    OUTPUT_LAYER,
    FamilySpec,
    Fuse,
    Split,
    check_tp_size,
    pad_rows,
    padded_vocab_size,
    unpad_rows,
)

_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# HF buffers some older checkpoints carry; they are recomputed, never loaded.
_IGNORED_HF = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
log = logging.getLogger(__name__)


class HFExpertViews:
    """HF tensor names with transformers-5 fused expert tensors shown as the per-expert tensors they hold.

    `names`: the per-expert view of `present`; `get(name)` reads through `read` (a fused tensor is read once
    per call and sliced; callers reading many experts should cache `read`).
    """

    def __init__(self, present: Iterable[str], read: Callable[[str], torch.Tensor],
                 num_experts: Callable[[str], int]) -> None:
        self._read = read
        self._view: dict[str, tuple[str, int, str]] = {}
        self.names: list[str] = []
        for name in present:
            m = _FUSED_EXPERTS.match(name)
            if m is None:
                self.names.append(name)
                continue
            prefix, kind = m.groups()
            parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
            for e in range(num_experts(name)):
                for part in parts:
                    virtual = f"{prefix}.{e}.{part}.weight"
                    self._view[virtual] = (name, e, part)
                    self.names.append(virtual)

    @property
    def fused(self) -> bool:
        return bool(self._view)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._view:
            return self._read(name)
        fused, e, part = self._view[name]
        t = self._read(fused)[e]
        if part == "down_proj":
            return t
        gate, up = t.chunk(2, dim=0)
        return gate if part == "gate_proj" else up


def extra_layer_names(arch: ModelArch, family: FamilySpec, present: Iterable[str]) -> set[str]:
    """HF tensors of layers >= num_hidden_layers that the family leaves out of the model (DeepSeek / GLM MTP)."""
    if not family.extra_hf_layers:
        return set()
    prefix = family.hf_layer_prefix
    extra = set()
    for name in present:
        if name.startswith(prefix):
            layer = name[len(prefix):].split(".", 1)[0]
            if layer.isdigit() and int(layer) >= arch.num_layers:
                extra.add(name)
    return extra


def skipped_extra_layers(arch: ModelArch, family: FamilySpec, present: Iterable[str], source: str) -> set[str]:
    """`extra_layer_names`, logged once (one line naming the layers and the family's reason); else empty."""
    skipped = extra_layer_names(arch, family, present)
    if skipped:
        layers = sorted({int(n[len(family.hf_layer_prefix):].split(".", 1)[0]) for n in skipped})
        log.warning("%s: skipping %d tensor(s) of layer(s) %s >= num_hidden_layers=%d (%s)", source, len(skipped),
                    layers, arch.num_layers, family.extra_hf_layers)
    return skipped


# ----------------------------------------------------------------------------- vocab padding

def pad_vocab(arch: ModelArch, weight: torch.Tensor, tp_size: int) -> torch.Tensor:
    """[V or V_pad', H] -> [V_pad(tp_size), H] with zero rows past `arch.vocab_size`."""
    return pad_rows(weight, arch.vocab_size, padded_vocab_size(arch.vocab_size, tp_size))


def unpad_vocab(arch: ModelArch, weight: torch.Tensor) -> torch.Tensor:
    """Strip Megatron's padding rows: [V_pad, H] -> [V, H] (a no-op on an unpadded tensor)."""
    return unpad_rows(weight, arch.vocab_size)


# ----------------------------------------------------------------------------- names

def split_layer_name(name: str) -> tuple[int | None, str]:
    """`decoder.layers.3.mlp.linear_fc1.weight` -> (3, 'mlp.linear_fc1.weight'); others -> (None, name)."""
    m = _LAYER_NAME.match(name)
    return (int(m.group(1)), m.group(2)) if m else (None, name)


def layer_name(layer: int, suffix: str) -> str:
    return f"{LAYER_PREFIX}{layer}.{suffix}"


def megatron_names(arch: ModelArch, family: FamilySpec) -> list[str]:
    """Every canonical Megatron name of the model, in checkpoint order (global layer index)."""
    return list(family.rows(arch))


def hf_names_for(arch: ModelArch, family: FamilySpec, name: str) -> tuple[str, ...]:
    """The HF tensor names one canonical Megatron tensor is made of, in fusion order."""
    return family.hf_names(arch, name)


def _preview(items: Iterable[str], limit: int = 12) -> str:
    items = sorted(items)
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_hf_names(arch: ModelArch, family: FamilySpec, present: Iterable[str], source: str) -> None:
    """Raise ValueError listing missing / unexpected HF tensors of a checkpoint (`source` names it)."""
    expected = {h for m in megatron_names(arch, family) for h in family.hf_names(arch, m)}
    present = {n for n in present if not _IGNORED_HF.search(n)}
    present -= skipped_extra_layers(arch, family, present, source)
    scales = sorted(n for n in present if n.endswith("_scale_inv"))
    if scales:
        raise ValueError(f"{source}: {len(scales)} FP8 block-scale tensor(s) ({scales[0]}, ...): an FP8-quantized "
                         "checkpoint (e.g. DeepSeek-V3 as published); dequantize it to bf16 first (DeepSeek's "
                         "fp8_cast_bf16.py) and drop quantization_config from config.json")
    if arch.tie_word_embeddings:  # a tied checkpoint may still carry the duplicate LM head
        present -= {h for w in family.weights(arch) if w.megatron == OUTPUT_LAYER for h in w.hf}
    missing, extra = expected - present, present - expected
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {_preview(missing)}")
        if extra:
            parts.append(f"unexpected {len(extra)} tensor(s): {_preview(extra)}")
        raise ValueError(
            f"{source}: weights do not match config.json ({arch.family}, num_hidden_layers="
            f"{arch.num_layers}, tie_word_embeddings={arch.tie_word_embeddings}, qkv_bias={arch.qkv_bias}"
            + (f", {arch.moe.num_experts} experts" if arch.moe is not None else "") + "); "
            + "; ".join(parts)
            + ". Fix: use the config.json that was saved with these weights (or re-save the model "
              "with save_pretrained).")


# ----------------------------------------------------------------------------- fusion

def fuse_to_megatron(arch: ModelArch, family: FamilySpec, name: str, hf_tensors: list[torch.Tensor]) -> torch.Tensor:
    """HF tensors (in `hf_names_for` order) -> the canonical full Megatron tensor `name`."""
    fuse = family.row(arch, name).fuse
    if fuse is Fuse.QKV_GROUPED:
        q, k, v = hf_tensors
        nkv, hd = arch.num_kv_heads, arch.head_dim
        rest = q.shape[1:]
        grouped = torch.cat([q.reshape(nkv, arch.heads_per_group * hd, *rest),
                             k.reshape(nkv, hd, *rest), v.reshape(nkv, hd, *rest)], dim=1)
        return grouped.reshape(-1, *rest)
    if fuse is Fuse.CONCAT:
        return torch.cat(hf_tensors, dim=0)
    (tensor,) = hf_tensors
    return tensor


def unfuse_to_hf(arch: ModelArch, family: FamilySpec, name: str, full: torch.Tensor) -> list[torch.Tensor]:
    """Inverse of `fuse_to_megatron` (vocab tensors are unpadded here)."""
    row = family.row(arch, name)
    if row.fuse is Fuse.QKV_GROUPED:
        nkv, hd, hpg = arch.num_kv_heads, arch.head_dim, arch.heads_per_group
        rest = full.shape[1:]
        grouped = full.reshape(nkv, (hpg + 2) * hd, *rest)
        q, k, v = grouped.split([hpg * hd, hd, hd], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]
    if row.fuse is Fuse.CONCAT:
        return [t.contiguous() for t in full.chunk(len(row.hf), dim=0)]
    if row.tp is Split.VOCAB:
        return [unpad_vocab(arch, full).contiguous()]
    return [full]


def is_replicated(arch: ModelArch, family: FamilySpec, name: str) -> bool:
    """True for tensors every TP rank holds whole (the RMSNorm weights)."""
    return family.row(arch, name).tp is Split.REPLICATED


# ----------------------------------------------------------------------------- whole state dicts

def hf_to_megatron_state(arch: ModelArch, family: FamilySpec,
                         hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole HF state dict -> canonical full Megatron tensors (strict: missing/extra names raise)."""
    family.check_supported(arch)
    views = HFExpertViews(hf_state.keys(), hf_state.__getitem__, lambda n: hf_state[n].shape[0])
    check_hf_names(arch, family, views.names, source="HF state dict")
    out = {}
    for name in megatron_names(arch, family):
        parts = [views.get(h) for h in family.hf_names(arch, name)]
        full = fuse_to_megatron(arch, family, name, parts)
        if tuple(full.shape) != family.shape(arch, name):
            raise ValueError(f"{'/'.join(family.hf_names(arch, name))}: shape {tuple(full.shape)} "
                             f"for {name} != expected {family.shape(arch, name)} from config.json")
        out[name] = full
    return out


def megatron_to_hf_tensor(arch: ModelArch, family: FamilySpec, name: str,
                          full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One canonical Megatron tensor -> [(hf_name, tensor), ...]."""
    if name == OUTPUT_LAYER and arch.tie_word_embeddings:
        return []  # tied: HF's lm_head is the embedding, exported once as embed_tokens
    return list(zip(family.hf_names(arch, name), unfuse_to_hf(arch, family, name, full)))


__all__ = ["EMBEDDING", "FINAL_NORM", "OUTPUT_LAYER", "LAYER_PREFIX", "check_tp_size", "padded_vocab_size",
           "pad_vocab", "unpad_vocab", "split_layer_name", "layer_name", "megatron_names", "hf_names_for",
           "check_hf_names", "HFExpertViews", "skipped_extra_layers", "extra_layer_names", "fuse_to_megatron",
           "unfuse_to_hf", "is_replicated", "hf_to_megatron_state",
           "megatron_to_hf_tensor"]
