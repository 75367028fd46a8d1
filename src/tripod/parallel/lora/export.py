"""A peft adapter directory from the adapters of a model spread over TP / PP / EP ranks: `adapter_config.json` and
`adapter_model.safetensors` with peft's names, which `peft.PeftModel.from_pretrained(hf_model, dir)` loads.

Each rank rebuilds the full tensors of its own adapters (a column-parallel B and a row-parallel A all-gathered over
the linear's TP group, state.py's inverse), then rank 0 collects every rank's and writes them. Experts' adapters are
written per expert (`mlp.experts.{e}.gate_proj`), the HF names of the family table; transformers 5 keeps the experts
fused in memory, which peft adapts through target_parameters instead, so those load only onto per-expert HF models.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from tripod.parallel.lora.adapter import LoraAdapter
from tripod.parallel.lora.state import PEFT_PREFIX, adapter_names


def full_adapter_state(adapters: list[LoraAdapter], layer_prefix: str) -> dict[str, torch.Tensor]:
    """This rank's adapters as full peft-named tensors (collective over each adapter's TP group)."""
    out = {}
    for a in adapters:
        for name, (key, which) in adapter_names(a, layer_prefix).items():
            local = (a.lora_A if which == "A" else a.lora_B)[key].detach()
            split_dim = (1 if which == "A" else None) if a.row else (0 if which == "B" else None)
            if split_dim is not None and a.tp > 1:
                pieces = [torch.empty_like(local) for _ in range(a.tp)]
                dist.all_gather(pieces, local.contiguous(), group=a.tp_group)
                local = torch.cat(pieces, split_dim)
            out[PEFT_PREFIX + name] = local.cpu().contiguous()
    return out


def save_peft_adapter(adapters: list[LoraAdapter], arch, out_dir: str, base_model_path: str | None = None) -> None:
    """Write the peft directory on global rank 0 (collective over the world)."""
    from safetensors.torch import save_file

    from tripod.parallel.families import get_family

    mine = full_adapter_state(adapters, get_family(arch.family).hf_layer_prefix)
    gathered: list = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(gathered, mine)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    state: dict[str, torch.Tensor] = {}
    for part in gathered:
        state.update(part)  # DP replicas hold the same adapters
    first = adapters[0] if adapters else None
    targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in state})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.rank if first else 0,
              "lora_alpha": first.scale * first.rank if first else 0.0,
              "lora_dropout": first.dropout.p if first is not None and first.dropout is not None else 0.0,
              "target_modules": targets, "bias": "none", "base_model_name_or_path": base_model_path,
              "fan_in_fan_out": False, "inference_mode": True}
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
