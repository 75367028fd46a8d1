"""An independent parameter count of a Hugging Face decoder from its config.json alone (no tripod code): what the
recipe tests hold `tripod plan`'s per-rank parameter rows against. Families: llama / qwen2 / qwen3 (dense) and
qwen3_moe; written from the models' published layer shapes (transformers' modeling files)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def hf_param_count(config: dict[str, Any] | str | Path) -> tuple[int, int]:
    """(every parameter outside the routed experts, the routed experts' parameters)."""
    if not isinstance(config, dict):
        config = json.loads(Path(config).read_text())
    c = config
    h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    d = c.get("head_dim") or h // heads
    family = c["model_type"]
    attention = h * heads * d + 2 * h * kv * d + heads * d * h
    if family == "qwen2" or c.get("attention_bias"):
        attention += heads * d + 2 * kv * d
    if family in ("qwen3", "qwen3_moe"):
        attention += 2 * d  # q_norm, k_norm
    dense_mlp = 3 * h * c["intermediate_size"]
    dense, experts = 0, 0
    for i in range(layers):
        dense += attention + 2 * h
        moe = family == "qwen3_moe" and i not in c.get("mlp_only_layers", []) and \
            (i + 1) % c.get("decoder_sparse_step", 1) == 0
        if moe:
            dense += h * c["num_experts"]  # router
            experts += c["num_experts"] * 3 * h * c["moe_intermediate_size"]
        else:
            dense += dense_mlp
    dense += vocab * h + h + (0 if c.get("tie_word_embeddings") else vocab * h)
    return dense, experts


def expected_rank_params(config: dict[str, Any] | str | Path, tp: int, pp: int, ep: int = 1,
                         etp: int | None = None) -> float:
    """Parameters one rank of a (TP, PP, EP, expert-TP) layout holds on average: the non-expert ones over TP x PP,
    the routed experts over PP x EP x expert-TP."""
    dense, experts = hf_param_count(config)
    return dense / (tp * pp) + experts / (pp * ep * (etp or tp))


def plan_row_params(out: str, model: str = "actor") -> tuple[str, str, float]:
    """(layout, dtype, params MiB) of `model`'s row in `tripod plan`'s memory table."""
    row = next(line.split() for line in out.splitlines() if line.startswith(f"{model} ") and "MiB" not in line
               and len(line.split()) >= 9)
    return row[1], row[2], float(row[4])
