"""Adapters by peft's names: `<hf module>.lora_A.weight` [r, in] and `.lora_B.weight` [rows, r], full (unsharded).

`<hf module>` is the HF model's module path (`model.layers.3.self_attn.q_proj`, an expert's
`model.layers.1.mlp.experts.5.gate_proj`); peft's own keys carry a `base_model.model.` prefix, accepted on read.
Loading takes each rank's shard of the full tensors (apply.py's `local_piece`); the split rules are the adapter's.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch

from tripod.parallel.lora.adapter import LoraAdapter, part_key
from tripod.parallel.lora.apply import set_adapter_part

PEFT_PREFIX = "base_model.model."


def adapter_names(adapter: LoraAdapter, layer_prefix: str) -> dict[str, tuple[str, str]]:
    """{peft name without prefix: (part key, "A" | "B")} of one adapter."""
    out = {}
    for part in adapter.spec.parts:
        module = adapter.spec.hf_module(part, layer_prefix)
        out[f"{module}.lora_A.weight"] = (part_key(part), "A")
        out[f"{module}.lora_B.weight"] = (part_key(part), "B")
    return out


def load_peft_state(adapters: Iterable[LoraAdapter], state: Mapping[str, torch.Tensor], layer_prefix: str,
                    source: str = "adapter") -> None:
    """Copy this rank's shards of a peft-named state into `adapters`; one line naming what is missing or misshaped."""
    plain = {k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k: v for k, v in state.items()}
    plain = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
             for k, v in plain.items()}
    for adapter in adapters:
        by_part: dict[str, dict[str, torch.Tensor]] = {}
        for name, (key, which) in adapter_names(adapter, layer_prefix).items():
            if name not in plain:
                raise ValueError(f"{source}: no tensor {name!r} (the model's target_modules adapt it); "
                                 "use target_modules matching the adapter's")
            by_part.setdefault(key, {})[which] = plain[name]
        for part in adapter.spec.parts:
            got = by_part[part_key(part)]
            rows = dict(zip(adapter.spec.parts, adapter.spec.part_rows))[part]
            want = {"A": (adapter.rank, adapter.spec.in_features), "B": (rows, adapter.rank)}
            for which, shape in want.items():
                if tuple(got[which].shape) != shape:
                    raise ValueError(f"{source}: {adapter.spec.hf_module(part, layer_prefix)}.lora_{which} has "
                                     f"shape {tuple(got[which].shape)}, the model's is {shape} (rank "
                                     f"{adapter.rank}); set lora.rank to the adapter's")
            set_adapter_part(adapter, part, got["A"], got["B"])
