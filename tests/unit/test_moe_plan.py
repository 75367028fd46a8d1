"""`tripod plan` for MoE models: per-rank parameter counts with EP / expert TP against the HF model's own count, the
distributed optimizer's expert-DP sharding, the MLA KV cache, and the Qwen3-30B-A3B recipe's parameter rows against an
independent count."""
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
def test_tripod_plan_of_the_moe_recipe_counts_its_parameters(recipe, capsys):
    """The plan's per-rank parameters (dense / TP*PP + experts / PP*EP*ETP) within 5% of an independent count from
    config.json (tests/helpers/hf_param_count.py), SGLang's reservation at the rollout, and the verdict against 80 GB
    with the recipe's gradient and optimizer offload. The DeepSeek-V3 recipe (512 ranks) takes ~40 s to plan; it is
    not planned here."""
    from tests.helpers.common import REPO_ROOT
    from tests.helpers.hf_param_count import expected_rank_params, plan_row_params
    from tripod.engine.cli import main

    assert main(["plan", recipe]) == 0
    out = capsys.readouterr().out
    assert "experts EP=8 ETP=1" in out and "Qwen--Qwen3-30B-A3B.json" in out
    layout, dtype, mib = plan_row_params(out)
    assert layout == "TP4xPP2xDP2EP8ETP1" and dtype == "bfloat16", layout
    expected = expected_rank_params(REPO_ROOT / "recipes/model_configs/Qwen--Qwen3-30B-A3B.json", tp=4, pp=2, ep=8,
                                    etp=1)
    assert abs(mib * 2 ** 20 / 2 / expected - 1) <= 0.05, (mib, expected)
    # SGLang reserves its mem_fraction_static of the device while the parameters and the generation shard (alive
    # until the push returns) are there: the rollout is the peak, and fits once gradients and optimizer are on the host
    assert "SGLang reservation (mem_fraction_static 0.6 x 80 GiB" in out
    assert "offload: actor: grads+optim" in out
    assert "verdict vs 80 GiB per device: fits; peak" in out and " in rollout (" in out
