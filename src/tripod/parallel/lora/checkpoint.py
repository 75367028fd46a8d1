"""LoRA in tripod checkpoints and their export: the settings a checkpoint was saved with, and what `tripod export
--lora` / `--merge` build from them.

A checkpoint of a LoRA model holds the frozen base weights and the adapters (apply.py's `_shard_in_checkpoints`
splits them over TP like their linears); its metadata (`tripod_checkpoint.json`) records under `lora` the adapters'
rank, alpha, dropout, target_modules / exclude_modules and the base model's path. Export rebuilds the same adapters on
the model before loading, then either writes them as a peft directory (export.py) or merges them into the weights
(W + alpha / rank * B @ A, shard-locally as merge.py does) and drops them, so the HF export writes the merged model.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from tripod.parallel.lora.adapter import LoraAdapter
from tripod.parallel.lora.apply import LoraSettings, _add_adapter_output, apply_lora

METADATA_KEY = "lora"


def lora_metadata(settings: LoraSettings | None, base_model_path: str | os.PathLike | None) -> dict[str, Any]:
    """The checkpoint metadata of a model built with `settings` ({} where LoRA is off)."""
    if settings is None or settings.rank <= 0:
        return {}
    return {METADATA_KEY: {"rank": settings.rank, "alpha": settings.alpha, "dropout": settings.dropout,
                           "target_modules": list(settings.target_modules),
                           "exclude_modules": list(settings.exclude_modules),
                           "base_model_path": None if base_model_path is None else os.fspath(base_model_path)}}


def saved_lora(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The `lora` section of a checkpoint's metadata (parallel/checkpoint.py's read_checkpoint_metadata), or None."""
    return meta.get(METADATA_KEY) or None


def attach_saved_adapters(chunks: list[torch.nn.Module], arch, saved: dict[str, Any]) -> list[LoraAdapter]:
    """Adapters like the saved ones on a freshly built model, before its checkpoint is loaded (which fills them)."""
    return apply_lora(chunks, arch, LoraSettings(rank=int(saved["rank"]), alpha=float(saved["alpha"]),
                                                 dropout=float(saved["dropout"]),
                                                 target_modules=list(saved["target_modules"]),
                                                 exclude_modules=list(saved["exclude_modules"]),
                                                 key="checkpoint lora"))


def merge_adapters_into_weights(chunks: list[torch.nn.Module], adapters: list[LoraAdapter]) -> None:
    """W += alpha / rank * B @ A on this rank's shard of every adapted weight (in float32, rounded once to the weight's
    dtype), then remove the adapters from their linears: the model is the merged plain model."""
    with torch.no_grad():
        for adapter in adapters:
            weight = adapter.base_weight[0]
            weight.copy_((weight.float() + adapter.local_delta_weight().float()).to(weight.dtype))
    for chunk in chunks:
        for module in list(chunk.modules()):
            if isinstance(getattr(module, "lora", None), LoraAdapter):
                del module.lora
                for hook_id, hook in list(module._forward_hooks.items()):
                    if hook is _add_adapter_output:  # it would look for the adapter
                        del module._forward_hooks[hook_id]


def export_lora_adapter(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, tp: int = 1, pp: int = 1,
                        ep: int = 1, etp: int | None = None) -> None:
    """A LoRA checkpoint's adapters -> a peft directory (adapter_config.json + adapter_model.safetensors) for the base
    model whose path the checkpoint records, loaded at TP x PP (x EP x ETP). Collective over the world."""
    from tripod.parallel.checkpoint import _layout_for, checkpoint_arch, load_model_checkpoint, read_checkpoint_metadata
    from tripod.parallel.lora.export import save_peft_adapter
    from tripod.parallel.model import build_gpt_model

    saved = saved_lora(read_checkpoint_metadata(ckpt_dir))
    arch = checkpoint_arch(ckpt_dir)
    layout = _layout_for(tp, pp, "export", ep, etp)
    model = build_gpt_model(arch, layout)
    adapters = attach_saved_adapters([model], arch, saved)
    load_model_checkpoint(model, ckpt_dir, layout)
    save_peft_adapter(adapters, arch, os.fspath(out_dir), saved.get("base_model_path"))
    torch.distributed.barrier()
