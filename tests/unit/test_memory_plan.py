"""parallel/memory_plan.py against independent counts: the HF model's own parameter count, and the byte rules of
megatron's optimizers (scripts/bench_memory.py measures the live objects; bench/RESULTS.md has that table)."""
import pytest
import torch

from tests.helpers.common import make_tiny_hf_model


@pytest.mark.parametrize("tie", [False, True])
def test_stage_numel_matches_the_hf_model(tmp_path, tie):
    from transformers import AutoModelForCausalLM

    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import stage_numel

    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", vocab_size=128 * 2, tie_word_embeddings=tie)  # no vocab padding
    arch = arch_from_hf(hf_dir)
    hf_numel = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(hf_dir).parameters())
    assert stage_numel(arch, 1, 1) == [hf_numel]
    assert sum(stage_numel(arch, 2, 1)) * 2 > hf_numel > sum(stage_numel(arch, 2, 1))  # norms replicated over TP
    per_stage = stage_numel(arch, 1, 2)
    extra = arch.vocab_size * arch.hidden_size if tie else 0  # megatron's last-stage copy of the tied embedding
    assert sum(per_stage) == hf_numel + extra


def test_optimizer_byte_rules():
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import ModelMemory

    arch = arch_from_hf(dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    fp32 = ModelMemory("a", 1, 1, 4, torch.float32, True, False).compute(arch)
    n = fp32.numel
    assert fp32.rows == {"params": 4 * n, "grads": 4 * n, "main_params": 0, "optim": 8 * n}
    bf16 = ModelMemory("a", 1, 1, 4, torch.bfloat16, True, True).compute(arch)
    assert bf16.rows == {"params": 2 * n, "grads": 4 * n, "main_params": n, "optim": 2 * n}
    ref = ModelMemory("r", 1, 1, 4, torch.bfloat16, False).compute(arch)
    assert ref.rows == {"params": 2 * n}
