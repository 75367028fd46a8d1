"""LoRA's keys (engine/config/models.py's LoraConfig, engine/workers/lora_options.py) and target names (parallel/lora/targets.py):
megatron names, HF names and all-linear resolve through the family table to the fused linears and their parts; bad
input is refused in one line naming the key, before any model is built."""
import json

import pytest

from tripod.engine.config import LoraConfig, load_config
from tripod.engine.workers.lora_options import adapter_dir_problems, lora_problems
from tripod.parallel.arch import arch_from_hf
from tripod.parallel.lora import resolve_targets

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, tie_word_embeddings=False, num_hidden_layers=2)


def _arch(model_type: str, **extra):
    import transformers

    cls = {"qwen2": transformers.Qwen2Config, "qwen3_moe": transformers.Qwen3MoeConfig,
           "deepseek_v3": transformers.DeepseekV3Config}[model_type]
    return arch_from_hf(cls(**{**COMMON, **extra}).to_dict())


MOE = dict(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
MLA = dict(num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
           topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12,
           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


def test_verl_default_and_hf_names_resolve_to_fused_parts():
    arch = _arch("qwen2")
    default = resolve_targets(arch, LoraConfig().target_modules)
    assert default == {"self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                       "self_attention.linear_proj": ("self_attn.o_proj",),
                       "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"), "mlp.linear_fc2": ("mlp.down_proj",)}
    assert resolve_targets(arch, ["all-linear"]) == default
    # HF names adapt only their part of a fused linear, as peft does on the HF model
    assert resolve_targets(arch, ["q_proj", "v_proj", "up_proj"]) == {
        "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.v_proj"), "mlp.linear_fc1": ("mlp.up_proj",)}
    assert resolve_targets(arch, ["all-linear"], ["linear_qkv", "down_proj"]) == {
        "self_attention.linear_proj": ("self_attn.o_proj",), "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj")}


def test_moe_and_mla_targets():
    moe = resolve_targets(_arch("qwen3_moe", **MOE), ["linear_fc1"])
    assert moe == {"mlp.experts.local_experts.{e}.linear_fc1": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"),
                   "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj")}  # the dense layers' (mlp_only_layers)
    mla = resolve_targets(_arch("deepseek_v3", **MLA), ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                                                        "linear_kv_up_proj"])
    assert set(mla) == {"self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
                        "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj"}
    with pytest.raises(ValueError, match=r"model.lora.target_modules: 'linear_qkv' is not a linear of deepseek; use 'all-linear'"):
        resolve_targets(_arch("deepseek_v3", **MLA), ["linear_qkv"])


@pytest.mark.parametrize("targets, exclude, message", [
    (["linear_qkvv"], [], r"target_modules: 'linear_qkvv' is not a linear of qwen2; use 'all-linear'"),
    (["lm_head"], [], r"'lm_head' is not a linear"),
    (["linear_proj"], ["o_proj"], r"leaves no linear of qwen2"),
    (["linear_proj"], ["gate"], r"exclude_modules: 'gate' is not a linear"),
])
def test_bad_targets_are_one_line(targets, exclude, message):
    with pytest.raises(ValueError, match=message) as err:
        resolve_targets(_arch("qwen2"), targets, exclude, "actor_rollout_ref.model.lora")
    assert "\n" not in str(err.value) and str(err.value).startswith("actor_rollout_ref.model.lora.")


def test_lora_config_checks():
    assert LoraConfig().check("k") == []  # rank 0: off, nothing else read
    assert LoraConfig(rank=-1).check("k") == ["k.rank=-1 must be >= 0 (0 turns LoRA off)"]
    assert "k.adapter_path is set but k.rank=0" in LoraConfig(adapter_path="x").check("k")[0]
    bad = LoraConfig(rank=8, alpha=0, dropout=1.0, merge=False, target_modules=[]).check("k")
    assert [m.split("=")[0].split(" ")[0] for m in bad] == ["k.alpha", "k.dropout", "k.target_modules"]


def test_adapter_only_sync_needs_the_vllm_rollout():
    """lora.merge=false: vLLM serves the adapters (engine/rollout/vllm_lora.py); the embedded and SGLang backends and
    the rollout on its own ranks take merged weights only: one line naming the key and the fix."""
    from tripod.engine.config_validation import _adapter_sync_problems

    lora = ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.merge=false"]
    assert _adapter_sync_problems(load_config(None, lora + ["actor_rollout_ref.rollout.name=vllm"])) == []
    assert _adapter_sync_problems(load_config(None, ["actor_rollout_ref.model.lora.merge=false"])) == []  # LoRA off
    for name in ("embedded", "sglang"):
        problems = _adapter_sync_problems(load_config(None, lora + [f"actor_rollout_ref.rollout.name={name}"]))
        assert len(problems) == 1 and problems[0].startswith("actor_rollout_ref.model.lora.merge=false with rollout"
                                                             f".name={name}: only the vLLM backend serves"), problems
    from tripod.engine.rollout.factory import engine_kwargs

    vllm = load_config(None, lora + ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.path=m"])
    assert engine_kwargs(vllm, 0, "float32", "cpu", None)["lora_rank"] == 8  # the engine serves the adapters
    merged = load_config(None, lora[:1] + ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.path=m"])
    assert "lora_rank" not in engine_kwargs(merged, 0, "float32", "cpu", None)
    separate = load_config(None, lora + ["actor_rollout_ref.rollout.name=vllm", "rollout.n_gpus_per_node=1"])
    assert "rollout on its own ranks" in _adapter_sync_problems(separate)[0]
    from tripod.engine.rollout.vllm_lora import vllm_max_lora_rank

    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 512)] == [1, 8, 8, 16, 512]
    with pytest.raises(ValueError, match="lora.rank=513: vLLM serves LoRA ranks up to 512"):
        vllm_max_lora_rank(513)


def test_preflight_refuses_what_the_model_or_layout_cannot_take(tmp_path):
    arch = _arch("qwen3_moe", **MOE)
    cfg = load_config(None, ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.target_modules=[all-linear]",
                             "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                             "actor_rollout_ref.actor.megatron.use_te=true"])
    problems = lora_problems(cfg, arch)  # experts at expert TP 2 (ETP follows TP) are taken: adapter.py shards them
    assert len(problems) == 1 and "use_te to auto or false" in problems[0], problems
    cfg = load_config(None, ["actor_rollout_ref.model.lora.rank=8",
                             "actor_rollout_ref.model.lora.target_modules=[up_proj,q_proj]"])
    assert lora_problems(cfg, arch) == []
    cfg = load_config(None, ["actor_rollout_ref.model.lora.rank=8", "algorithm.use_kl_in_reward=true",
                             "actor_rollout_ref.actor.megatron.param_offload=true"])
    assert [p.split(": ")[1][:36] for p in lora_problems(cfg, arch)] == ["the reference pass runs on the actor"]
    cfg = load_config(None, ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.target_modules=[wq]"])
    assert lora_problems(cfg, arch)[0].startswith("actor_rollout_ref.model.lora.target_modules: 'wq'")


def test_mla_attention_and_experts_under_tensor_parallelism_are_taken():
    arch = _arch("deepseek_v3", **MLA)
    for etp in (1, 2):
        cfg = load_config(None, ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.target_modules=[all-linear]",
                                 "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                 f"actor_rollout_ref.actor.megatron.expert_tensor_parallel_size={etp}"])
        assert lora_problems(cfg, arch) == []


def test_adapter_directory_must_match_rank_and_alpha(tmp_path):
    assert "not a peft adapter directory" in adapter_dir_problems(str(tmp_path), 8, 16, "k")[0]
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 32}))
    assert adapter_dir_problems(str(tmp_path), 8, 32, "k") == []
    assert "has r=8 lora_alpha=32; set k.rank / alpha" in adapter_dir_problems(str(tmp_path), 8, 16, "k")[0]
