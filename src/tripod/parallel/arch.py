"""Model architecture as tripod sees it: one typed record read from a Hugging Face `config.json`
(plus the EOS ids of its `generation_config.json`, where the stop tokens of generation are declared).

Every room that needs the shape of a model (Megatron model building, the weight converter, the
embedded rollout engine, the resharding plan) reads it from `ModelArch`, so the HF config is parsed
in exactly one place. A `*ForSequenceClassification` config (one label) is a reward model: `score_head` says so,
and the family table then names HF's `score.weight` [1, hidden] where a causal LM has `lm_head.weight`. Which HF `model_type`s are supported is the family registry's business
(parallel/families/): built in are Llama, Qwen2/Qwen2.5 and Qwen3 (RMSNorm, SwiGLU, RoPE with optional
scaling, GQA, optional QKV bias, Qwen3's per-head q/k RMSNorm, tied or untied embeddings) and the MoE families Qwen3-MoE, Qwen2-MoE and
DeepSeek-V3/V2, whose routed-expert MLP (`ModelArch.moe`) and multi-head latent attention (`ModelArch.mla`) are
parsed by parallel/moe_arch.py.

With MLA the dense attention fields keep a meaning where one exists: `num_kv_heads == num_heads` (every head has
its own keys and values after the kv up-projection; there are no shared KV groups) and `head_dim` is the RoPE
head dim `qk_rope_head_dim` (HF's `config.head_dim` for DeepSeek), so `rope_inv_freq()` is the per-layer rotary
embedding of MLA. The q/k/v head dims of MLA live in `ModelArch.mla`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tripod.parallel.moe_arch import MLAArch, MoEArch, mla_from_hf, moe_from_hf


@dataclass(frozen=True)
class ModelArch:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    rope_parameters: dict[str, Any] = field(default_factory=dict)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # generation_config.json's eos_token_id (an int or a list, e.g. a chat model's end-of-turn ids), which HF
    # `generate` and vLLM stop at besides config.json's; not part of the architecture (compare=False)
    generation_eos_token_ids: tuple[int, ...] = field(default=(), compare=False)
    moe: MoEArch | None = None  # routed experts (None: dense MLP in every layer)
    mla: MLAArch | None = None  # multi-head latent attention (None: standard GQA attention)
    # an HF *ForSequenceClassification model with one label: a scalar `score` head [1, hidden] instead of an LM head
    # (tie_word_embeddings is then False: such a model has no LM head to tie)
    score_head: bool = False
    # the share of each head's dims that RoPE rotates (the first `rotary_dim`; GLM-4.5: 0.5), as HF's
    # partial_rotary_factor and megatron's rotary_percent; the rest pass through unrotated
    partial_rotary_factor: float = 1.0
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every EOS id the model declares: config.json's `eos_token_id` and generation_config.json's, sorted."""
        eos = self.eos_token_id
        ids = set(self.generation_eos_token_ids) | ({eos} if isinstance(eos, int) else set(eos or ()))
        return tuple(sorted(ids))

    @property
    def rotary_dim(self) -> int:
        """Head dims RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense model)."""
        return self.moe.num_experts if self.moe is not None else 0

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """(inv_freq [rotary_dim/2] float32, attention_scaling) exactly as `transformers` computes them.

        Both the Megatron model and the embedded rollout engine use this, so RoPE (incl. llama3 /
        linear / yarn scaling) is defined once, by the reference implementation.
        """
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        cfg = AutoConfig.for_model(**self.hf_config)
        rope_type = (self.rope_parameters or {}).get("rope_type", "default")
        if rope_type == "default":
            base, dim = self.rope_theta, self.rotary_dim
            inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            return inv, 1.0
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported; "
                             f"use one of {sorted(ROPE_INIT_FUNCTIONS)} or 'default'")
        inv, scale = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
        return inv.float(), float(scale)


def read_hf_config(path_or_dict: str | os.PathLike | dict) -> dict[str, Any]:
    """The HF config as a dict, from a dict, a model directory or a `config.json` path."""
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no config.json here; pass a Hugging Face model directory "
                                "(made with save_pretrained) or its config.json")
    with open(path) as f:
        return json.load(f)


GENERATION_CONFIG = "generation_config.json"


def read_generation_eos(path_or_dict: str | os.PathLike | dict) -> tuple[int, ...]:
    """generation_config.json's `eos_token_id` next to the model's config.json (an int or a list of ints, as HF's
    `GenerationConfig` and vLLM read it), as a tuple; () for a dict, or when the file or the key is absent."""
    if isinstance(path_or_dict, dict):
        return ()
    path = os.fspath(path_or_dict)
    path = os.path.join(path if os.path.isdir(path) else os.path.dirname(path), GENERATION_CONFIG)
    if not os.path.isfile(path):
        return ()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else [] if eos is None else [None]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id={eos!r} must be a token id or a list of token ids; fix the file "
                         "or delete the key")
    return tuple(ids)


def arch_from_hf(path_or_dict: str | os.PathLike | dict) -> ModelArch:
    """Parse and validate an HF config into a `ModelArch` (clear errors for unsupported models)."""
    from tripod.parallel.families import family_for_model_type, supported_model_types

    cfg = read_hf_config(path_or_dict)
    model_type = cfg.get("model_type")
    family = family_for_model_type(model_type)
    if family is None:
        raise ValueError(f"config.json model_type={model_type!r} (architectures={cfg.get('architectures')}) "
                         f"is not supported; tripod converts {supported_model_types()}. "
                         "Add a FamilySpec in parallel/families/ for a new family (docs/extending.md).")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r}: only SwiGLU ('silu') MLPs are supported")
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    mla = mla_from_hf(cfg)
    if mla is not None:  # see the module docstring: no KV groups, head_dim is the RoPE head dim
        kv = heads
    if heads % kv:
        raise ValueError(f"config.json num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
    head_dim = mla.qk_rope_head_dim if mla is not None else cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:  # the pre-transformers-4.45 key (e.g. DeepSeek-V3's config.json)
        rope["rope_type"] = rope["type"]
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    if not 0.0 < partial <= 1.0 or int(head_dim * partial) % 2:
        raise ValueError(f"config.json partial_rotary_factor={partial} with head_dim={head_dim}: RoPE needs an even "
                         "number of rotated dims in (0, head_dim]")
    qkv_bias = family.qkv_bias(cfg)
    score_head = is_sequence_classification(cfg)
    if cfg.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported (Llama/Qwen2 MLPs have no bias)")
    return ModelArch(
        family=family.name,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        ffn_hidden_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        qkv_bias=qkv_bias,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) and not score_head,
        rope_parameters=rope,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        generation_eos_token_ids=read_generation_eos(path_or_dict),
        moe=moe_from_hf(cfg),
        mla=mla,
        score_head=score_head,
        partial_rotary_factor=partial,
        hf_config=cfg,
    )


SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def is_sequence_classification(cfg: dict[str, Any]) -> bool:
    """Whether an HF config is a `*ForSequenceClassification` model (a reward model); refuses more than one label
    (tripod's score head is a scalar)."""
    if not any(str(a).endswith(SEQUENCE_CLASSIFICATION) for a in cfg.get("architectures") or []):
        return False
    labels = len(cfg["id2label"]) if cfg.get("id2label") else cfg.get("num_labels") or 2  # transformers' default
    if labels != 1:
        raise ValueError(f"config.json architectures={cfg.get('architectures')} has num_labels={labels}; a reward "
                         "model has one scalar score: re-save it with num_labels=1")
    return True


def with_score_head(arch: ModelArch, pad_token_id: int | None = None) -> ModelArch:
    """`arch` as an HF `*ForSequenceClassification` model with one label (a reward model's arch; config.json's
    `architectures` renamed from `<X>ForCausalLM`, `num_labels` 1). `pad_token_id` fills config.json's when it has
    none: HF scores the last token that is not padding, and refuses batches without a pad token."""
    if arch.score_head:
        return arch
    cfg = dict(arch.hf_config)
    if cfg.get("pad_token_id") is None and pad_token_id is not None:
        cfg["pad_token_id"] = pad_token_id
    names = [str(a) for a in cfg.get("architectures") or []]
    base = names[0].removesuffix("ForCausalLM") if names else arch.family.capitalize()
    cfg["architectures"] = [base + SEQUENCE_CLASSIFICATION]
    cfg["id2label"] = {"0": "LABEL_0"}
    cfg["label2id"] = {"LABEL_0": 0}
    cfg.pop("num_labels", None)
    return dataclasses.replace(arch, score_head=True, tie_word_embeddings=False, hf_config=cfg)
