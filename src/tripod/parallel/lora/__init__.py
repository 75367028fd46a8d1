"""LoRA on megatron's parallel linears: the targets a family offers (targets.py), the sharded adapter of one linear
(adapter.py), attaching / freezing / switching off (apply.py) and the peft-named state (state.py)."""
from tripod.parallel.lora.apply import LoraSettings, adapters_disabled, apply_lora, lora_adapters
from tripod.parallel.lora.targets import ALL_LINEAR, VERL_DEFAULT_TARGETS, family_linears, resolve_targets

__all__ = ["ALL_LINEAR", "VERL_DEFAULT_TARGETS", "LoraSettings", "adapters_disabled", "apply_lora",
           "family_linears", "lora_adapters", "resolve_targets"]
