"""Adapter-only weight sync to vLLM (`actor_rollout_ref.model.lora.merge=false`): vLLM serves the base weights,
pushed once, and each step gets only the actor's LoRA adapters, in memory, as a vLLM LoRA.

    payload = adapter_payload(actor_model, arch)     # peft-named full tensors of every adapter, on every rank
    engine.load_adapter(*payload)                     # vLLM: a new LoRA id, the old one removed; generate() uses it

The tensors are parallel/lora/export.py's (`full_adapter_state`: a column-parallel B and a row-parallel A all-gathered
over the linear's TP group, peft's names), so what vLLM receives is what `tripod export --lora` writes. vLLM's LoRA
layers cut their own TP slice out of full tensors, as its weight loaders do for base weights. Where the actor's
layers are spread over pipeline stages every rank takes every stage's adapters (one all_gather_object over the world:
adapters are small).

vLLM 0.32 loads LoRAs only from a directory (`WorkerLoRAManager._load_adapter`); verl's SPMD rollout builds the
`LoRAModel` from tensors instead (its TensorLoRARequest). The engine core runs in tripod's process, so the model
runner's LoRA manager is reachable and the same is done here: `LoRAModel.from_lora_tensors` +
`add_adapter` / `activate_adapter`, no file. vLLM folds the scale into B in place (`LoRALayerWeights.optimize`), so
it is handed tensors no one else reads (`load_adapter` copies).

Served on CPU: vLLM's CPU platform selects `PunicaWrapperCPU` (platforms/cpu.py; torch ops for the shrink / expand
products) and turns compilation off when LoRA is on. Dense families only: vLLM's LoRA on fused MoE experts runs
Triton kernels, and tripod's vLLM backend loads no MoE or MLA family (vllm_engine.VLLM_ARCHITECTURES).
"""
from __future__ import annotations

from typing import Any

import torch

# vLLM 0.32's LoRAConfig.max_lora_rank takes one of these (config/lora.py MaxLoRARanks)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
IN_MEMORY = "tripod://in-memory"  # LoRARequest needs a non-empty path; nothing reads it (the adapter is added first)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of rank `rank` (ValueError above 512)."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"actor_rollout_ref.model.lora.rank={rank}: vLLM serves LoRA ranks up to "
                     f"{VLLM_MAX_LORA_RANKS[-1]}; set lora.merge=true (merged weights) or a smaller rank")


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of a {name: tensor} dict (what a weight sync hands the rollout engine)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def adapter_payload(model, arch, dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """({peft name: full tensor} of every adapter of the model, in `dtype` (the rollout's; vLLM computes LoRA in the
    model's dtype), peft's adapter config), the same on every rank. Collective over the world (and over each
    adapter's TP group)."""
    import torch.distributed as dist

    from tripod.parallel.convert import model_chunks
    from tripod.parallel.families import get_family
    from tripod.parallel.lora import lora_adapters
    from tripod.parallel.lora.export import full_adapter_state

    adapters = list(lora_adapters(model_chunks(model)))
    tensors = full_adapter_state(adapters, get_family(arch.family).hf_layer_prefix)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {k: v for k, v in tensors.items()})
        for part in gathered:
            tensors.update({k: v for k, v in part.items() if k not in tensors})  # DP / TP replicas hold the same
    if not adapters:
        raise ValueError("lora.merge=false but the actor has no LoRA adapters on this rank")
    first = adapters[0]
    targets = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
    config = {"r": first.rank, "lora_alpha": first.scale * first.rank, "target_modules": targets, "bias": "none"}
    return tensors, config


class VLLMAdapterSlot:
    """The one LoRA a tripod vLLM engine serves: replaced at every push, under a fresh id (vLLM's prefix cache keys
    blocks by the LoRA's name, and an id already registered would not be reloaded)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.request: Any = None  # the LoRARequest generate() passes; None until the first push
        self._next_id = 1

    @property
    def worker_manager(self) -> Any:
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.lora_manager

    def load(self, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.request import LoRARequest

        wm = self.worker_manager
        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": None})
        helper.validate_legal(wm.lora_config)
        lora_id, self._next_id = self._next_id, self._next_id + 1
        lora = LoRAModel.from_lora_tensors(lora_id, {k: v.detach().clone() for k, v in tensors.items()}, helper,
                                           device="cpu", dtype=wm.lora_config.lora_dtype,
                                           model_vocab_size=wm.vocab_size)
        manager = wm._adapter_manager
        manager.remove_all_adapters()  # the previous step's adapter: one slot, one LoRA
        manager.add_adapter(lora)
        manager.activate_adapter(lora_id)
        self.request = LoRARequest(f"tripod-{lora_id}", lora_id, lora_path=IN_MEMORY)
        self.llm.reset_prefix_cache()
