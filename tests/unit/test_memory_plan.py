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
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_phases import phase_memory
    from tripod.parallel.memory_plan import plan_from_config, stage_numel
    from tripod.runtime.offload import OffloadFlags

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


def _dense_arch(layers: int = 4):
    from tripod.parallel.arch import arch_from_hf

    return arch_from_hf(dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2))


def test_in_flight_micro_batches_follow_megatrons_schedules():
    """1F1B: PP rank r holds min(PP - r, M) micro-batches; interleaved: the first stage holds
    PP * (1 + (PP - 1) / (PP * VPP)) (Megatron-LM's theoretical_memory_usage.py factor) when M is large."""
    from tripod.parallel.activation_plan import (
        ActivationLayout,
        activation_bytes,
        in_flight_microbatches,
        layer_bytes,
    )

    assert [in_flight_microbatches(4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches(4, 0, 2) == 2 and in_flight_microbatches(1, 0, 8) == 1
    for pp, vpp in [(2, 2), (4, 2), (4, 3)]:
        assert in_flight_microbatches(pp, 0, 64, vpp) == pytest.approx(pp * (1 + (pp - 1) / (pp * vpp)))
    arch = _dense_arch(8)
    first = 4 * layer_bytes(arch, ActivationLayout(), 0, 2, 32, 4, True) + 2 * 32 * 8  # 4 layers and the token ids
    assert activation_bytes(arch, 1, 2, 2, 32, torch.float32, num_microbatches=4) == 2 * first
    interleaved = activation_bytes(arch, 1, 2, 2, 32, torch.float32, num_microbatches=4,
                                   layout=ActivationLayout(pp=2, vpp=2))
    assert interleaved == 2.5 * first  # (2*(2-1) + (2-1)*2 + 1) chunk micro-batches of half the stage each


def test_sequence_parallel_and_recompute_num_layers():
    """SP divides the norms' and the layer inputs' bytes by TP; full recompute keeps one input per group of
    recompute_num_layers (uniform) or per recomputed layer (block), plus one group recomputed in the backward."""
    from tripod.parallel.activation_plan import ActivationLayout, activation_bytes, layer_bytes

    arch, b, s, e = _dense_arch(8), 2, 32, 4
    t, h = b * s, arch.hidden_size
    norms = 2 * (2 * t * h * 4 + t * 4 + t * h * e)  # a layer's two norms (and the linear inputs they feed)
    plain, sp = (layer_bytes(arch, ActivationLayout(tp=2, sequence_parallel=q), 0, b, s, e, True) for q in (0, 1))
    assert plain - sp == norms // 2
    layer, held = layer_bytes(arch, ActivationLayout(), 0, b, s, e, True), t * h * e
    full = {(method, n): activation_bytes(arch, 1, 1, b, s, torch.float32, layout=ActivationLayout(
        recompute="full", recompute_method=method, recompute_num_layers=n)) for method in ("uniform", "block")
        for n in (1, 2, 8)}
    none = activation_bytes(arch, 1, 1, b, s, torch.float32)
    ends = none - 8 * layer
    assert full["uniform", 1] == 8 * held + layer + ends
    assert full["uniform", 2] == 4 * held + 2 * layer + ends
    assert full["block", 2] == 2 * held + 6 * layer + layer + ends
    assert full["block", 8] == full["uniform", 1]


def test_moe_and_mla_terms_use_their_own_dims():
    """An MoE layer counts its routed rows (tokens x top-k) at the expert FFN width; MLA's q / k use
    qk_nope + qk_rope dims and v v_head_dim (not the RoPE dim the old plan took for all three)."""
    from tests.helpers.moe_models import COMMON, FAMILIES
    from tripod.parallel.activation_plan import ActivationLayout, layer_bytes
    from tripod.parallel.arch import arch_from_hf

    moe = arch_from_hf({**COMMON, **FAMILIES["qwen3_moe"], "model_type": "qwen3_moe"})
    wider = arch_from_hf({**COMMON, **FAMILIES["qwen3_moe"], "model_type": "qwen3_moe", "moe_intermediate_size": 64})
    lay, b, s, e = ActivationLayout(), 2, 32, 4
    rows = b * s * moe.moe.topk
    assert layer_bytes(wider, lay, 0, b, s, e, True) - layer_bytes(moe, lay, 0, b, s, e, True) == rows * 6 * 32 * e
    mla = arch_from_hf({**COMMON, **FAMILIES["deepseek_v3"], "model_type": "deepseek_v3"})
    bigger_v = arch_from_hf({**COMMON, **FAMILIES["deepseek_v3"], "model_type": "deepseek_v3", "v_head_dim": 32})
    heads, t = mla.num_heads, b * s
    # v (keys x heads x v_dim) and the out-projection's input (tokens x heads x v_dim), 16 more dims each
    assert layer_bytes(bigger_v, lay, 0, b, s, e, False) - layer_bytes(mla, lay, 0, b, s, e, False) == \
        2 * t * heads * 16 * e


def test_kv_cache_is_the_engines_that_runs(tmp_path):
    """Embedded: its KV cache; SGLang / vLLM on CUDA: their fraction of the device; vLLM on CPU: its weights copy
    and kv_cache_memory_bytes, held for the whole run."""
    from tripod.engine.config import load_config
    from tripod.parallel.arch import arch_from_hf
    from tripod.parallel.memory_plan import generation_shard_bytes, kv_cache_bytes, plan_from_config, rollout_ranks_plan

    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", vocab_size=256)
    arch = arch_from_hf(hf_dir)
    base = [f"actor_rollout_ref.model.path={hf_dir}", "trainer.n_gpus_per_node=2", "data.train_batch_size=4"]
    cfg = load_config(None, base)
    embedded = plan_from_config(cfg, 2, arch)
    seq = cfg.data.max_prompt_length + cfg.actor_rollout_ref.rollout.response_length
    sequences = cfg.data.gen_batch_size * cfg.actor_rollout_ref.rollout.n // 2
    assert embedded.kv_cache == kv_cache_bytes(arch, 1, sequences, seq, torch.float32)
    for name in ("sglang", "vllm"):
        cfg = load_config(None, base + ["trainer.device=cuda", f"actor_rollout_ref.rollout.name={name}",
                                        "actor_rollout_ref.rollout.gpu_memory_utilization=0.25"])
        plan = plan_from_config(cfg, 2, arch, gpu_memory_gb=40)
        assert plan.kv_cache == 10 << 30 and "0.25 x 40 GiB" in plan.kv_label, (name, plan.kv_label)
        assert plan.device_total() >= 10 << 30
    cfg = load_config(None, base + ["actor_rollout_ref.rollout.name=vllm",
                                    "actor_rollout_ref.rollout.engine_kwargs={kv_cache_memory_bytes: 1048576}"])
    plan = plan_from_config(cfg, 2, arch)
    assert plan.kv_cache == generation_shard_bytes(arch, 1, torch.float32) + (1 << 20) and plan.kv_resident
    assert plan.host_peak() - plan.runtime - sum(m.total for m in plan.models) == \
        plan.kv_cache + max(plan.generation_shard, *plan.activations.values())
    # the rollout on ranks of its own holds the same engine memory as the colocated one
    own = [f"actor_rollout_ref.model.path={hf_dir}", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1",
           "data.train_batch_size=4", "trainer.device=cuda", "actor_rollout_ref.rollout.name=sglang",
           "actor_rollout_ref.rollout.gpu_memory_utilization=0.25"]
    ranks = rollout_ranks_plan(load_config(None, own), arch, gpu_memory_gb=40)
    assert ranks.kv_cache == 10 << 30 and "SGLang reservation" in ranks.describe(0), ranks.describe(0)
    ranks = rollout_ranks_plan(load_config(None, own[:4]), arch)
    assert ranks.kv_cache == kv_cache_bytes(arch, 1, cfg.data.gen_batch_size * cfg.actor_rollout_ref.rollout.n, seq,
                                            torch.float32) and "+ KV cache" in ranks.describe(0)
