"""`tripod plan` for MoE models: per-rank parameter counts with EP / expert TP against the HF model's own count, the
distributed optimizer's expert-DP sharding, the MLA KV cache, and the two big MoE recipes fitting 80 GB."""
import pytest
import torch

from tests.helpers.moe_models import COMMON, FAMILIES, hf_moe_model


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_expert_parallel_rank_counts_add_up_to_the_hf_model(family):
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import stage_numel_split

    cfg = {**COMMON, **FAMILIES[family], "model_type": family, "vocab_size": 256}  # no vocab padding at TP <= 2
    arch = arch_from_hf(cfg)
    model = hf_moe_model(family, 0, vocab_size=256)
    hf_experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    # the router's expert bias is a buffer on both sides; the plan counts it with the parameters (E floats a layer)
    hf_total = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert stage_numel_split(arch, 1, 1) == [(hf_total - hf_experts, hf_experts)]
    for tp, pp, ep, etp in [(1, 1, 2, 1), (2, 1, 2, 1), (2, 2, 4, 1), (1, 2, 2, 2), (2, 1, 4, 2)]:
        split = stage_numel_split(arch, tp, pp, ep=ep, etp=etp)
        # every expert element lives on exactly one (stage, EP rank, expert-TP rank)
        assert sum(e for _, e in split) * ep * etp == hf_experts, (tp, pp, ep, etp)


def test_distributed_optimizer_shards_experts_over_expert_dp():
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import ModelMemory

    arch = arch_from_hf({**COMMON, **FAMILIES["qwen3_moe"], "model_type": "qwen3_moe", "vocab_size": 256})
    m = ModelMemory("actor", 2, 1, 4, torch.bfloat16, True, True, ep=2, etp=1).compute(arch)
    dense = m.numel - m.expert_numel
    assert m.edp == 4 and m.rows["optim"] == (dense // 4 + m.expert_numel // 4) * 8
    assert m.rows["grads"] == m.numel * 4 and m.rows["params"] == m.numel * 2


def test_mla_kv_cache_is_the_latent():
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import kv_cache_bytes

    arch = arch_from_hf({**COMMON, **FAMILIES["deepseek_v3"], "model_type": "deepseek_v3"})
    per_token = arch.num_layers * (arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim) * 4
    assert kv_cache_bytes(arch, 2, 3, 10, torch.float32) == per_token * 30  # replicated over rollout TP


@pytest.mark.parametrize("recipe", ["recipes/qwen3/30b-a3b-gsm8k.yaml"])
def test_tripod_plan_shows_the_moe_recipe_fits_80_gb(recipe, capsys):
    """The DeepSeek-V3 recipe (512 ranks) takes ~40 s to plan on this machine; its numbers are in the closing note."""
    from tripod.engine.cli import main

    assert main(["plan", recipe]) == 0
    out = capsys.readouterr().out
    assert "experts EP=8 ETP=1" in out and "Qwen--Qwen3-30B-A3B.json" in out
    peak = float(out.split("at the rollout peak: ")[1].split(" MiB")[0])
    assert 30_000 < peak < 80 * 1000 ** 3 / 2 ** 20
