"""`model.lora` (engine/config/models.py's LoraConfig) -> the workers' LoRA: the settings parallel/lora/ builds adapters from,
the checks that need the model family (run by preflight before any model is built), a saved adapter's loading, and
the reference pass that is the actor with its adapters switched off."""
from __future__ import annotations

import contextlib
import json
import os

from tripod.parallel.lora import LoraSettings, adapters_disabled, resolve_targets


def lora_settings(lora, key: str, seed: int = 0) -> LoraSettings | None:
    """The parallel side of one `model.lora` section; None where LoRA is off (rank 0)."""
    if lora.rank <= 0:
        return None
    return LoraSettings(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                        target_modules=list(lora.target_modules), exclude_modules=list(lora.exclude_modules),
                        seed=seed, key=key, adapter_path=lora.adapter_path)


def lora_problems(cfg, arch) -> list[str]:
    """One line per `model.lora` setting the model or the layout cannot take: a target the family lacks, an offloaded
    actor that is the reference, Transformer Engine layers, an adapter directory that is not a peft adapter of the
    same rank and alpha."""
    sections = [("actor_rollout_ref", cfg.actor_rollout_ref.model.lora, cfg.actor_rollout_ref.actor.megatron)]
    if cfg.uses_critic:
        sections.append(("critic", cfg.critic.model.lora, cfg.critic.megatron))
    e: list[str] = []
    for name, lora, m in sections:
        key = f"{name}.model.lora"
        if lora.rank <= 0:
            continue
        try:
            resolve_targets(arch, lora.target_modules, lora.exclude_modules, key)
        except ValueError as err:
            e.append(str(err))
            continue
        if name == "actor_rollout_ref" and cfg.uses_reference and m.param_offload:
            e.append(f"{key}: the reference pass runs on the actor (adapters off), which "
                     "actor_rollout_ref.actor.megatron.param_offload would keep on the host in that phase; set it false")
        if str(m.use_te).lower() == "true":
            e.append(f"{key}: LoRA runs on megatron's local linears; set {name}.megatron.use_te to auto or false")
        if lora.adapter_path:
            e += adapter_dir_problems(lora.adapter_path, lora.rank, lora.alpha, key)
    return e


def adapter_dir_problems(path: str, rank: int, alpha: float, key: str) -> list[str]:
    """A peft adapter directory whose r and lora_alpha are the run's (the scale alpha / rank comes from the config,
    so a mismatch would silently rescale the adapter)."""
    config = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config) or not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        return [f"{key}.adapter_path={path}: not a peft adapter directory (adapter_config.json + "
                "adapter_model.safetensors)"]
    with open(config) as f:
        saved = json.load(f)
    if saved.get("r") != rank or float(saved.get("lora_alpha", -1)) != float(alpha):
        return [f"{key}.adapter_path={path} has r={saved.get('r')} lora_alpha={saved.get('lora_alpha')}; set "
                f"{key}.rank / alpha to those"]
    return []


def reference_pass(actor, ref):
    """The reference log-prob pass: `ref` itself, or, where LoRA made no reference model (ref None), the actor with
    its adapters switched off."""
    return contextlib.nullcontext() if ref is not None else adapters_disabled(actor.chunks)
