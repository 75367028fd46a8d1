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


@pytest.mark.parametrize("tie", [False, True])
def test_reward_model_rows_match_the_hf_classifier_and_get_a_phase(tmp_path, tie):
    """The reward model's row counts HF's own *ForSequenceClassification parameters (score head [1, hidden], no
    bias, no LM head), and `tripod plan` places it: on the device only while it scores when it is offloaded."""
    from transformers import AutoModelForSequenceClassification

    from tripod.engine.config import load_config
    from tripod.engine.offload import OffloadFlags
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_phases import phase_memory
    from tripod.parallel.memory_plan import plan_from_config, stage_numel

    rm_dir = make_tiny_hf_model(tmp_path / "rm", "qwen2", vocab_size=128 * 2, tie_word_embeddings=tie,
                                sequence_classification=True)
    actor_dir = make_tiny_hf_model(tmp_path / "actor", "qwen2", vocab_size=128 * 2, tie_word_embeddings=tie)
    rm_arch = arch_from_hf(rm_dir)
    hf_numel = sum(p.numel() for p in AutoModelForSequenceClassification.from_pretrained(rm_dir).parameters())
    assert stage_numel(rm_arch, 1, 1, value_head=True) == [hf_numel]

    cfg = load_config(None, [f"actor_rollout_ref.model.path={actor_dir}", "trainer.n_gpus_per_node=2",
                             "trainer.device=cuda", "reward_model.enable=true", f"reward_model.model.path={rm_dir}",
                             "reward_model.offload=true"])
    plan = plan_from_config(cfg, 2, arch_from_hf(actor_dir), reward_arch=rm_arch)
    rm = next(m for m in plan.models if m.name == "reward_model")
    assert rm.rows == {"params": hf_numel * 4} and rm.offloaded  # fp32 params, frozen: no grads or optimizer
    phases = {p.phase: p for p in phase_memory(plan, {"reward_model": OffloadFlags(params=True)})}
    assert phases["reward"].parts["reward_model.params"] == hf_numel * 4
    assert all("reward_model.params" not in p.parts for name, p in phases.items() if name != "reward")
