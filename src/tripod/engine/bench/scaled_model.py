"""A recipe's model scaled down to one host, so a recipe whose model does not fit can still be benchmarked at its own
shapes (`scripts/bench_recipes.py`: the actor-update MFU of every recipe by `tripod bench`).

Kept: every per-layer shape (hidden size, heads and head dims, the dense MLP and expert widths, MLA's ranks, top-k,
QKV bias, q/k norms, RoPE), so each matmul of a layer has the recipe's shapes. Cut:
- the depth, to `layers` (an MoE model keeps at least one MoE layer);
- the vocabulary, to the tokenizer's at hand (no model hub here), with its special token ids;
- the routed experts, to E / DP: in the recipe's layout each of its DP ranks sends the T*k expert-tokens of a T-token
  micro-batch to the E experts (T*DP*k / E to each); one rank holding E / DP experts with the same top-k gives each
  expert the same number of tokens, so the expert matmuls have the recipe's shapes too. Group-limited routing is
  dropped (which experts a token picks does not change the work).
Where that still does not fit `memory_gb`, in order: one layer; the embeddings tied (the LM head's work unchanged);
experts and top-k halved together (each expert's token count and matmul shapes kept; a token's active expert FLOPs
halve). Weights are random
(transformers' initialisation): MFU does not depend on their values, and a random model answers every prompt to the
full response length.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# bytes per parameter: fp32 weights + fp32 gradients + Adam's two fp32 moments (a trained model), fp32 weights (the
# reference); activations and the rollout's KV cache are the `reserve_gb` margin
TRAINED_BYTES, FROZEN_BYTES = 16, 4


@dataclass
class ScaledModel:
    config: dict[str, Any]
    """The scaled HF config.json."""
    params: int
    """Its parameter count."""
    changes: list[str] = field(default_factory=list)
    """What differs from the recipe's model, one phrase each (for the report)."""


def _expert_keys(cfg: dict[str, Any]) -> tuple[str, str] | None:
    """(the experts key, the top-k key) of an MoE config, None for a dense one."""
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if cfg.get(key):
            return key, "num_experts_per_tok"
    return None


def count_parameters(cfg: dict[str, Any]) -> int:
    """Parameters of the HF model `cfg` describes (built on the meta device: no memory, no time)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    return sum(p.numel() for p in model.parameters())


def scale_config(cfg: dict[str, Any], *, layers: int, data_parallel: int, tokenizer) -> ScaledModel:
    """`cfg` (a recipe model's config.json) at `layers` layers, E / `data_parallel` experts and `tokenizer`'s
    vocabulary (module docstring)."""
    out = {k: v for k, v in cfg.items() if k not in ("quantization_config", "auto_map", "_name_or_path")}
    changes = [f"{min(layers, cfg['num_hidden_layers'])} of {cfg['num_hidden_layers']} layers"]
    out["num_hidden_layers"] = min(layers, cfg["num_hidden_layers"])
    out.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id, torch_dtype="float32")
    changes.append(f"vocabulary {len(tokenizer)} (the tokenizer's) for {cfg['vocab_size']}")
    keys = _expert_keys(cfg)
    if keys is not None:
        experts_key, topk_key = keys
        experts = max(cfg[topk_key], cfg[experts_key] // max(data_parallel, 1))
        if experts != cfg[experts_key]:
            changes.append(f"{experts} of {cfg[experts_key]} experts (as many tokens each as at DP{data_parallel})")
        out[experts_key] = experts
        if "n_group" in cfg:
            out.update(n_group=1, topk_group=1)
        if "first_k_dense_replace" in cfg:  # keep an MoE layer: DeepSeek's first layers are dense
            out["first_k_dense_replace"] = min(cfg["first_k_dense_replace"], out["num_hidden_layers"] - 1)
        if "mlp_only_layers" in cfg:
            out["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < out["num_hidden_layers"] - 1]
    return ScaledModel(out, count_parameters(out), changes)


def run_bytes(params: int, *, critic: bool, reference: bool) -> int:
    """Host memory of a 1-rank run's models: the actor (and critic) trained, the reference frozen."""
    return params * (TRAINED_BYTES * (2 if critic else 1) + (FROZEN_BYTES if reference else 0))


def fit_scaled_model(cfg: dict[str, Any], *, layers: int, data_parallel: int, tokenizer, memory_gb: float,
                     critic: bool, reference: bool) -> ScaledModel:
    """`scale_config`, then the fallbacks of the module docstring until the run's models fit `memory_gb`."""
    limit = memory_gb * 2 ** 30
    scaled = scale_config(cfg, layers=layers, data_parallel=data_parallel, tokenizer=tokenizer)

    def fits(model: ScaledModel) -> bool:
        return run_bytes(model.params, critic=critic, reference=reference) <= limit

    if not fits(scaled) and layers > 1:
        scaled = scale_config(cfg, layers=1, data_parallel=data_parallel, tokenizer=tokenizer)
    if not fits(scaled) and not scaled.config.get("tie_word_embeddings"):
        config = dict(scaled.config, tie_word_embeddings=True)
        scaled = ScaledModel(config, count_parameters(config), [*scaled.changes, "embeddings tied"])
    keys = _expert_keys(cfg)
    while not fits(scaled) and keys is not None and scaled.config[keys[1]] % 2 == 0 and scaled.config[keys[1]] > 1:
        experts_key, topk_key = keys
        config = dict(scaled.config)
        config[experts_key] //= 2
        config[topk_key] //= 2
        note = (f"{config[experts_key]} of {cfg[experts_key]} experts, top-{config[topk_key]} of {cfg[topk_key]} "
                f"(each expert's tokens as at DP{data_parallel})")
        scaled = ScaledModel(config, count_parameters(config),
                             [c for c in scaled.changes if "experts" not in c] + [note])
    if not fits(scaled):
        need = run_bytes(scaled.params, critic=critic, reference=reference) / 2 ** 30
        raise ValueError(f"the scaled model ({scaled.params / 1e6:.0f}M parameters: {', '.join(scaled.changes)}) "
                         f"needs ~{need:.1f} GiB for its run's models; memory_gb={memory_gb} is less: raise it")
    return scaled


def write_scaled_model(scaled: ScaledModel, tokenizer, out: str, seed: int = 0) -> str:
    """Save the scaled model with random weights and `tokenizer` to `out` (skipped when `out` already holds this
    config); return `out`."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    marker = os.path.join(out, "scaled_config.json")
    if os.path.isfile(marker):
        with open(marker) as f:
            if json.load(f) == scaled.config:
                return out
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**scaled.config), dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    with open(marker, "w") as f:
        json.dump(scaled.config, f, indent=1)
    return out
