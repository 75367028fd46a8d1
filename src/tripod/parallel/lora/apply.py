"""Put LoRA adapters on a built megatron model, freeze its base weights, and switch the adapters off.

    adapters = apply_lora(chunks, arch, LoraSettings(rank=16, alpha=32, target_modules=["all-linear"]))
    with adapters_disabled(chunks):   # the base model: the reference policy with no second model built
        ...

`apply_lora` runs after the base weights are loaded and before the model is wrapped for training: the base
parameters get requires_grad False, so megatron's DDP gives them no gradient buffer and its optimizer no state (both
take only parameters that require grad); the value head of a critic (`keep_trainable`) stays trained. Adapters
start as peft's do (A kaiming-uniform, B zero: the model is unchanged), drawn from a generator seeded by the layer,
expert and part, so every layout starts from the same adapters.
"""
from __future__ import annotations

import contextlib
import re
import zlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from tripod.parallel.lora.adapter import AdapterSpec, LoraAdapter, check_module, kaiming_a, part_key
from tripod.parallel.lora.targets import VERL_DEFAULT_TARGETS, family_linears, resolve_targets


@dataclass
class LoraSettings:
    """The parallel side of `model.lora` (engine/config/models.py's LoraConfig)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(VERL_DEFAULT_TARGETS))
    exclude_modules: list[str] = field(default_factory=list)
    seed: int = 0
    key: str = "model.lora"
    adapter_path: str | None = None  # a peft adapter directory to start from


_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def _local_experts_start(layer: torch.nn.Module) -> int:
    indices = getattr(getattr(layer, "mlp", None), "local_expert_indices", None)
    return int(indices[0]) if indices else 0


def _output_requires_grad(module, args, output):
    """The frozen embedding's output marked as needing a gradient: without it megatron's recomputed (checkpointed)
    blocks get no input that requires grad and the adapters inside them none (peft's enable_input_require_grads)."""
    return output.requires_grad_(True) if not output.requires_grad else output


def apply_lora(chunks: list[torch.nn.Module], arch, settings: LoraSettings,
               keep_trainable: tuple[str, ...] = ("output_layer",)) -> list[LoraAdapter]:
    """Attach adapters to this rank's chunks (`linear.lora`, added to the output by a forward hook); freeze every
    base parameter but those whose name starts with a `keep_trainable` prefix on a value-head model."""
    if settings.rank < 1:
        raise ValueError(f"{settings.key}.rank={settings.rank}: LoRA needs rank >= 1 (0 turns it off)")
    chosen = resolve_targets(arch, settings.target_modules, settings.exclude_modules, settings.key)
    linears = family_linears(arch)
    adapters: list[LoraAdapter] = []
    for chunk in chunks:
        model = _unwrap(chunk)
        for name, p in model.named_parameters():
            p.requires_grad_(getattr(model, "tripod_value_head", False) and name.startswith(keep_trainable))
        if getattr(model, "embedding", None) is not None:
            model.embedding.register_forward_hook(_output_requires_grad)
        for layer in model.decoder.layers:
            global_layer = layer.layer_number - 1
            first_expert = _local_experts_start(layer)
            for name, module in list(layer.named_modules()):
                m = _EXPERT.search(name + ".")
                path = _EXPERT.sub("local_experts.{e}.", name + ".")[:-1]
                if path not in chosen:
                    continue
                target = linears[path]
                where = f"decoder layer {global_layer} {name}"
                check_module(module, target, where)
                expert = first_expert + int(m.group(1)) if m else None
                spec = AdapterSpec(target, chosen[path], global_layer, expert)
                adapter = LoraAdapter(module, spec, settings.rank, settings.alpha, settings.dropout)
                _init(adapter, settings.seed)
                module.lora = adapter
                adapter.base_weight = [module.weight]  # a list: not registered as the adapter's parameter
                _shard_in_checkpoints(module, adapter)
                # first among the linear's hooks: a later one (cpu_compat's MLA RoPE-key gradient fix tags this output)
                # must see the output with the adapter's share, whenever it was registered
                module.register_forward_hook(_add_adapter_output, with_kwargs=True, prepend=True)
                adapters.append(adapter)
    if settings.adapter_path:
        from safetensors.torch import load_file

        from tripod.parallel.families import get_family
        from tripod.parallel.lora.state import load_peft_state

        state = load_file(f"{settings.adapter_path}/adapter_model.safetensors")
        load_peft_state(adapters, state, get_family(arch.family).hf_layer_prefix, f"{settings.key}.adapter_path")
    return adapters


def _shard_in_checkpoints(module, adapter: LoraAdapter) -> None:
    """megatron's linear builds its checkpoint entries from its own state dict with only `weight` / `bias` split over
    TP: every other key (the adapter's) would be saved as replicated, keeping TP rank 0's piece only. The split
    factor of the adapter (a column-parallel B on dim 0, a row-parallel A on dim 1) is added here."""
    original = module.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = original(prefix, sharded_offsets, metadata)
        state = {f"lora.{k}": v for k, v in adapter.state_dict(keep_vars=True).items()}
        split = "lora.lora_A." if adapter.row else "lora.lora_B."
        axis = {k: 1 if adapter.row else 0 for k in state if k.startswith(split)}
        out.update(make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets, tp_group=module.tp_group,
                                                       dp_cp_group=(metadata or {}).get("dp_cp_group")))
        return out

    module.sharded_state_dict = sharded_state_dict


def _add_adapter_output(module, args, kwargs, output):
    adapter = module.lora
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter(x), bias


def _init(adapter: LoraAdapter, seed: int) -> None:
    """peft's init from a generator keyed by (seed, layer, expert, part): the same adapters at every layout."""
    spec = adapter.spec
    with torch.no_grad():
        for part in spec.parts:
            tag = f"{seed}/{spec.layer}/{spec.expert}/{part}".encode()
            a = kaiming_a(adapter.rank, spec.in_features, torch.Generator().manual_seed(zlib.crc32(tag)))
            set_adapter_part(adapter, part, a, None)


def local_piece(adapter: LoraAdapter, which: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a full (canonical, peft-shaped) `which`="A" [r, in] or "B" [rows, r] tensor."""
    if which == "A":
        return full.chunk(adapter.tp, 1)[adapter.tp_rank] if adapter.row else full
    return full if adapter.row else full.chunk(adapter.tp, 0)[adapter.tp_rank]


def set_adapter_part(adapter: LoraAdapter, part: str, a_full: torch.Tensor | None,
                     b_full: torch.Tensor | None) -> None:
    """Copy full A [r, in] and B [rows, r] of `part` into this rank's shard (None: leave it)."""
    key = part_key(part)
    with torch.no_grad():
        if a_full is not None:
            adapter.lora_A[key].copy_(local_piece(adapter, "A", a_full))
        if b_full is not None:
            adapter.lora_B[key].copy_(local_piece(adapter, "B", b_full))


def lora_adapters(chunks) -> Iterator[LoraAdapter]:
    """Every adapter of this rank's chunks."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, LoraAdapter):
                yield module


@contextlib.contextmanager
def adapters_disabled(chunks):
    """The base model inside the block: every adapter's hook returns the base output untouched."""
    adapters = list(lora_adapters(chunks))
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a in adapters:
            a.enabled = True
