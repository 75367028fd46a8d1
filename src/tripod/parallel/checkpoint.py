"""Tripod model checkpoints: megatron dist-checkpointing of a sharded GPTModel, loadable at any layout.

A checkpoint directory holds
    model/                  megatron.core.dist_checkpointing files (global, layout-free tensors)
    hf/config.json          the HF config (+ tokenizer files when known), so export needs nothing else
    tripod_checkpoint.json  tripod metadata; written LAST, so its absence marks a half-written save
Saved at one (TP, PP) it loads at any other: dist-checkpointing stores global tensors and reads the
overlap each rank needs (uneven pipeline stages included: megatron keys layers by their global index). The vocab tensors are padded to a multiple of 128*tp, so their global
shape changes with TP; megatron marks them `allow_shape_mismatch` (zero-fill, then read the
overlap), which is exact because tripod's padding rows are zero.

Also the two conversions behind `tripod convert` / `tripod export` (one call per rank of a world
whose size is tp*pp): `convert_hf_to_checkpoint` and `export_checkpoint_to_hf`. A model with a scalar head exports
as an HF `*ForSequenceClassification` with one label (`exported_arch`): a reward model as it came, a critic with its
value head as HF's `score` (HF's has no bias: a nonzero critic bias goes to config.json's `tripod_value_bias`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from tripod.parallel.arch import ModelArch, arch_from_hf, with_score_head
from tripod.parallel.convert import (
    TOKENIZER_FILES,
    extra_layers_of,
    family_of,
    load_hf_weights,
    model_chunks,
    padded_vocab_size,
    save_hf_checkpoint,
    write_hf_config,
)

METADATA_FILE = "tripod_checkpoint.json"
MODEL_SUBDIR = "model"
HF_SUBDIR = "hf"
# metadata key: the HF checkpoint a model was converted from, whose layers past num_hidden_layers (MTP) export copies
EXTRA_LAYERS_KEY = "hf_extra_layers_from"
FORMAT_VERSION = 1
# a save gathers the distributed optimizer's state this many fp32 elements at a time (64 MiB; a larger parameter is a
# chunk of its own): engine/checkpoints/optimizer_state.py streams by it, parallel/memory_plan.py counts it
OPTIMIZER_CHUNK_ELEMENTS = 16 * 2 ** 20


def sharded_model_state(model) -> dict[str, Any]:
    """megatron sharded state dict of a model or of its virtual-pipeline chunks (`model0`, `model1`, ... as
    Megatron-LM nests them). Tensor keys are global, so a checkpoint loads at any TP/PP/VPP."""
    chunks = model_chunks(model)
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _check_world_layout(layout, what: str) -> None:
    # megatron's dist_checkpointing runs collectives over the default (world) group
    if len(layout.ranks) != dist.get_world_size():
        raise ValueError(f"{what}: layout {layout.name} spans ranks {layout.ranks} but dist-checkpointing "
                         f"needs every rank of the world ({dist.get_world_size()}); use a layout over all ranks")


def read_checkpoint_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The tripod metadata of checkpoint `path`, with clear errors for missing / foreign / partial dirs."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist; pass a directory written by "
                                "`tripod convert` or save_model_checkpoint")
    meta_file = os.path.join(path, METADATA_FILE)
    model_dir = os.path.join(path, MODEL_SUBDIR)
    if not os.path.isfile(meta_file):
        if os.path.isdir(model_dir):
            raise ValueError(f"{path}: {METADATA_FILE} is missing, so the save did not finish (half-written "
                             "checkpoint); save it again")
        raise ValueError(f"{path} is not a tripod checkpoint (no {METADATA_FILE}); pass a directory written "
                         "by `tripod convert` or save_model_checkpoint (for an HF model use `tripod convert`)")
    with open(meta_file) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_file}: format_version={meta.get('format_version')!r}; this tripod reads "
                         f"{FORMAT_VERSION}")
    for needed in (os.path.join(model_dir, "metadata.json"), os.path.join(path, HF_SUBDIR, "config.json")):
        if not os.path.isfile(needed):
            raise ValueError(f"{path}: {os.path.relpath(needed, path)} is missing (damaged checkpoint); save it again")
    return meta


def checkpoint_arch(path: str | os.PathLike) -> ModelArch:
    """The ModelArch stored in checkpoint `path` (from its hf/config.json)."""
    read_checkpoint_metadata(path)
    return arch_from_hf(os.path.join(os.fspath(path), HF_SUBDIR))


def check_checkpoint_destination(path: str | os.PathLike) -> None:
    """Refuse to write a checkpoint into a non-empty directory that is not a tripod checkpoint."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"checkpoint destination {path} is a file; pass a directory")
    if os.path.isdir(path) and os.listdir(path) and not (
            os.path.isfile(os.path.join(path, METADATA_FILE)) or os.path.isdir(os.path.join(path, MODEL_SUBDIR))):
        raise ValueError(f"checkpoint destination {path} is a non-empty directory that is not a tripod "
                         "checkpoint; pass a new or empty directory (an old checkpoint there is replaced)")


def is_critic_checkpoint(path: str | os.PathLike) -> bool:
    """Whether checkpoint `path` holds a critic: a value head on a causal LM's config (a reward model's config is
    already a *ForSequenceClassification)."""
    return bool(read_checkpoint_metadata(path).get("value_head")) and not checkpoint_arch(path).score_head


def exported_arch(path: str | os.PathLike) -> ModelArch:
    """The arch `tripod export` writes for checkpoint `path`: its own (a causal LM, or a reward model's
    *ForSequenceClassification), or for a critic its config as a one-label *ForSequenceClassification whose `score`
    is the value head (pad_token_id: config.json's, else the tokenizer's next to it)."""
    arch = checkpoint_arch(path)
    if not is_critic_checkpoint(path):
        return arch
    pad = None
    tokenizer_config = os.path.join(os.fspath(path), HF_SUBDIR, "tokenizer_config.json")
    if os.path.isfile(tokenizer_config):
        from transformers import AutoTokenizer

        pad = AutoTokenizer.from_pretrained(os.path.join(os.fspath(path), HF_SUBDIR)).pad_token_id
    return with_score_head(arch, pad)


class ModelCheckpointSave:
    """A model checkpoint being written: planned (collective) when made, then `write()` (this rank's file, any thread)
    and `finish()` (collective: megatron's metadata, then tripod's metadata file, written last)."""

    def __init__(self, model: torch.nn.Module, path: str | os.PathLike, arch: ModelArch, layout, *,
                 tokenizer_dir: str | os.PathLike | None = None, extra_metadata: dict[str, Any] | None = None,
                 stage: bool = False):
        from tripod.parallel.megatron_patches.checkpoint_save import plan_save

        _check_world_layout(layout, "save_model_checkpoint")
        check_checkpoint_destination(path)  # every rank, on the same untouched directory
        self.path, self.arch, self.layout = os.fspath(path), arch, layout
        self.tokenizer_dir, self.extra_metadata = tokenizer_dir, extra_metadata or {}
        self.gpt = model_chunks(model)[-1]
        model_dir = os.path.join(self.path, MODEL_SUBDIR)
        dist.barrier()
        if dist.get_rank() == 0:
            os.makedirs(self.path, exist_ok=True)
            if os.path.exists(os.path.join(self.path, METADATA_FILE)):
                os.remove(os.path.join(self.path, METADATA_FILE))  # invalid until this save completes
            shutil.rmtree(model_dir, ignore_errors=True)
            os.makedirs(model_dir)
        dist.barrier()
        with layout.activate():
            self.pending = plan_save(sharded_model_state(model), model_dir, stage=stage)
        self.dtype = next(self.gpt.parameters()).dtype
        self.value_head = bool(getattr(self.gpt, "tripod_value_head", False))

    @property
    def nbytes(self) -> int:
        return self.pending.nbytes

    def write(self) -> None:
        self.pending.write()

    def finish(self) -> None:
        self.pending.finish()
        dist.barrier()
        if dist.get_rank() == 0:
            arch, layout = self.arch, self.layout
            write_hf_config(arch, os.path.join(self.path, HF_SUBDIR), self.dtype, self.tokenizer_dir)
            meta = {
                "format_version": FORMAT_VERSION, "family": arch.family, "num_layers": arch.num_layers,
                "vocab_size": arch.vocab_size,
                "saved_layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp,
                                 **({"ep": layout.ep, "etp": layout.etp} if arch.moe else {}),
                                 **layout.stage_split(arch.num_layers).config_fields()},
                "saved_padded_vocab_size": padded_vocab_size(arch.vocab_size, layout.tp),
                "value_head": self.value_head,
                "dtype": str(self.dtype).removeprefix("torch."), **self.extra_metadata,
            }
            if extra_layers_of(arch, self.tokenizer_dir):  # MTP layers the model leaves out: export copies them
                meta[EXTRA_LAYERS_KEY] = os.path.abspath(os.fspath(self.tokenizer_dir))
            tmp = os.path.join(self.path, METADATA_FILE + ".tmp")
            with open(tmp, "w") as f:
                json.dump(meta, f, indent=2, sort_keys=True)
            os.replace(tmp, os.path.join(self.path, METADATA_FILE))
        dist.barrier()


def save_model_checkpoint(model: torch.nn.Module, path: str | os.PathLike, arch: ModelArch, layout, *,
                          tokenizer_dir: str | os.PathLike | None = None,
                          extra_metadata: dict[str, Any] | None = None) -> None:
    """Save `model` (sharded by `layout`) to `path` with megatron dist-checkpointing, written by each rank from the
    live tensors (parallel/megatron_patches/checkpoint_save.py).

    Collective: every rank of the world calls it (the layout must span the world). An existing
    checkpoint at `path` is replaced.
    """
    save = ModelCheckpointSave(model, path, arch, layout, tokenizer_dir=tokenizer_dir, extra_metadata=extra_metadata)
    save.write()
    save.finish()


def load_model_checkpoint(model: torch.nn.Module, path: str | os.PathLike, layout) -> dict[str, Any]:
    """Load checkpoint `path` (saved at any layout) into `model` sharded by `layout`; returns its metadata.

    Collective over the world, like `save_model_checkpoint`. Strict: every model tensor must be
    in the checkpoint.
    """
    from megatron.core import dist_checkpointing

    _check_world_layout(layout, "load_model_checkpoint")
    meta = read_checkpoint_metadata(path)
    chunks = model_chunks(model)
    gpt = chunks[0]
    value_head = bool(getattr(gpt, "tripod_value_head", False))
    if meta.get("value_head", False) != value_head:
        raise ValueError(f"{path}: checkpoint value_head={meta.get('value_head')} but the model has "
                         f"value_head={value_head}; build the model the way it was saved (critic vs actor)")
    arch = getattr(gpt, "tripod_arch", None)
    if arch is not None and (arch.num_layers, arch.vocab_size, arch.family) != (
            meta["num_layers"], meta["vocab_size"], meta["family"]):
        raise ValueError(f"{path}: checkpoint is {meta['family']} with {meta['num_layers']} layers / vocab "
                         f"{meta['vocab_size']} but the model is {arch.family} with {arch.num_layers} layers / "
                         f"vocab {arch.vocab_size}; build the model from {os.path.join(path, HF_SUBDIR)}")
    model_dir = os.path.join(os.fspath(path), MODEL_SUBDIR)
    with layout.activate():
        sharded = sharded_model_state(chunks)
        try:
            state = dist_checkpointing.load(sharded, model_dir)
        except Exception as e:  # megatron raises bare KeyError/CheckpointingException with long dumps
            raise ValueError(f"{path}: loading failed ({type(e).__name__}: {str(e)[:300]}); the checkpoint "
                             "does not match the model") from e
    states = [state] if len(chunks) == 1 else [state[f"model{i}"] for i in range(len(chunks))]
    missing = []
    for chunk, chunk_state in zip(chunks, states):
        result = chunk.load_state_dict(chunk_state, strict=False)
        missing += [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks model tensors {missing[:8]}; it was saved from another model")
    return meta


def min_world_size(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> int:
    """The smallest world that holds a TP x PP layout with EP x ETP expert groups: tp * pp * dp with the least dp
    such that ep * etp divides tp * dp (megatron's expert groups live inside one pipeline stage)."""
    experts = ep * (tp if etp is None else etp)
    return tp * pp * (experts // math.gcd(tp, experts))


def _layout_for(tp: int, pp: int, name: str, ep: int = 1, etp: int | None = None):
    from tripod.parallel.layout import ParallelLayout

    return ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, name=name)


def convert_hf_to_checkpoint(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, tp: int, pp: int,
                             ep: int = 1, etp: int | None = None) -> None:
    """HF model dir -> tripod checkpoint sharded TP x PP (x EP x ETP for experts; DP = world / (tp*pp)).
    Collective over the world (`min_world_size` ranks suffice)."""
    from tripod.parallel.model import build_gpt_model

    arch = arch_from_hf(hf_dir)
    family_of(arch)
    layout = _layout_for(tp, pp, "convert", ep, etp)
    model = build_gpt_model(arch, layout)
    load_hf_weights(model, hf_dir, arch, layout)
    save_model_checkpoint(model, out_dir, arch, layout, tokenizer_dir=hf_dir)


def export_checkpoint_to_hf(ckpt_dir: str | os.PathLike, hf_dir: str | os.PathLike, tp: int = 1, pp: int = 1,
                            dtype: torch.dtype | None = None, ep: int = 1, etp: int | None = None) -> None:
    """Tripod checkpoint -> HF model dir (safetensors + config.json + tokenizer files), loaded at TP x PP (x EP x
    ETP); routed experts are written under HF's per-expert names; a scalar head as `exported_arch` says; a LoRA
    checkpoint's adapters merged into the weights (lora/checkpoint.py)."""
    from tripod.parallel.lora.checkpoint import attach_saved_adapters, merge_adapters_into_weights, saved_lora
    from tripod.parallel.model import build_gpt_model

    arch, critic = checkpoint_arch(ckpt_dir), is_critic_checkpoint(ckpt_dir)
    out_arch = exported_arch(ckpt_dir)
    layout = _layout_for(tp, pp, "export", ep, etp)
    model = build_gpt_model(arch, layout, value_head=critic)
    lora = saved_lora(read_checkpoint_metadata(ckpt_dir))
    adapters = attach_saved_adapters([model], arch, lora) if lora else []
    load_model_checkpoint(model, ckpt_dir, layout)
    merge_adapters_into_weights([model], adapters)  # a LoRA checkpoint exports merged (`tripod export --merge`)
    if critic:
        bias = _value_head_bias(model, layout)
        if bias != 0.0:
            out_arch = dataclasses.replace(out_arch, hf_config={**out_arch.hf_config, "tripod_value_bias": bias})
    extra_from = read_checkpoint_metadata(ckpt_dir).get(EXTRA_LAYERS_KEY)
    save_hf_checkpoint(model, out_arch, layout, hf_dir, tokenizer_dir=os.path.join(os.fspath(ckpt_dir), HF_SUBDIR),
                       dtype=dtype, extra_layers_from=extra_from if extra_from and os.path.isdir(extra_from) else None)
    dist.barrier()


def _value_head_bias(model, layout) -> float:
    """A critic's value-head bias, on every rank: the mean of the last stage's replicas (identical copies, so the float64
    sum of a float32 value over a few ranks and its division are exact)."""
    held = torch.zeros(2, dtype=torch.float64)
    if layout.is_last_stage:
        held[0], held[1] = float(model_chunks(model)[-1].output_layer.bias.detach().double().cpu()), 1.0
    dist.all_reduce(held)
    return float(held[0] / held[1])


__all__ = ["save_model_checkpoint", "ModelCheckpointSave", "load_model_checkpoint", "read_checkpoint_metadata", "checkpoint_arch",
           "check_checkpoint_destination", "exported_arch", "is_critic_checkpoint",
           "convert_hf_to_checkpoint", "export_checkpoint_to_hf", "min_world_size", "METADATA_FILE", "TOKENIZER_FILES",
           "EXTRA_LAYERS_KEY"]
