"""The FLOP count behind MFU (engine/throughput.py) against torch's FlopCounterMode over Hugging Face's own models.

For every supported family (dense GQA with and without QKV bias and q/k norms, and the MoE families: Qwen3-MoE,
Qwen2-MoE with a gated shared expert, DeepSeek-V3 / V2 with MLA, group routing and first dense layers), one forward
of random tokens through the transformers model (eager attention: the scores are two matmuls FlopCounterMode sees)
is counted, and the decoder layers' share must equal `PerfCounter.flops_per_token(seq, backward=False)` per token.
The LM head's FLOPs are checked alike against `head_flops`. Routing sends each token to exactly top-k experts, so
the MoE count is exact, not an expectation.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers.moe_models import hf_moe_model
from tripod.engine.data.tiny_models import TINY_CONFIG
from tripod.engine.throughput import PerfCounter, active_matmul_params, attention_width
from tripod.parallel.arch import arch_from_hf

DENSE = {"llama": dict(), "qwen2": dict(), "qwen3": dict(head_dim=24)}  # qwen3: heads * head_dim != hidden


def _dense_model(family: str):
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}[family]
    config = config_cls(**{**TINY_CONFIG, **DENSE[family]})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()


def _model(family: str):
    if family in DENSE:
        return _dense_model(family)
    model = hf_moe_model(family, seed=3)
    model.set_experts_implementation("eager")  # a loop of mm per expert (FlopCounterMode does not count grouped_mm)
    return model


def _counted(model, batch: int, seq: int) -> tuple[float, float]:
    """(FLOPs of the decoder layers, FLOPs of the LM head) of one forward of random tokens."""
    tokens = torch.randint(3, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(input_ids=tokens)
    per_module = counter.get_flop_counts()
    layers = sum(sum(v.values()) for k, v in per_module.items() if k.count(".") == 3 and ".layers." in k)
    head = sum(per_module.get(f"{type(model).__name__}.lm_head", {}).values())
    return float(layers), float(head)


def _perf(arch) -> PerfCounter:
    perf = PerfCounter.__new__(PerfCounter)  # the count only: no peak-FLOP/s measurement
    perf.arch, perf.world = arch, 1
    perf.params, perf.attention_width = active_matmul_params(arch), attention_width(arch)
    return perf


@pytest.mark.parametrize("family", [*DENSE, "qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2"])
def test_forward_flops_equal_flop_counter_on_hf_model(family: str):
    model = _model(family)
    arch = arch_from_hf(model.config.to_dict())
    batch, seq = 3, 17
    layers, head = _counted(model, batch, seq)
    perf = _perf(arch)
    expected = batch * seq * perf.flops_per_token(seq, backward=False)
    assert layers == pytest.approx(expected, rel=1e-9), (family, layers, expected)
    assert head == pytest.approx(perf.head_flops(batch * seq, backward=False), rel=1e-9)
    # the forward + backward count is 3x the forward's, matmuls and attention alike
    assert perf.flops_per_token(seq, True) == pytest.approx(3 * perf.flops_per_token(seq, False), rel=1e-12)

