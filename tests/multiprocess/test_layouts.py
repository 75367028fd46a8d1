"""ParallelLayout: per-model process groups (actor and critic in one world) and input validation."""
import json
import re

import pytest

from tests.helpers.common import make_tiny_hf_model, run_torchrun

# a number, even when another rank's output was glued to it on the shared pipe
FLOAT = r"(-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf)"


def _arch(**overrides):
    from tripod.parallel.arch import arch_from_hf

    cfg = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2}
    cfg.update(overrides)
    return arch_from_hf(cfg)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=4), "actor tensor_model_parallel_size=4 does not divide num_attention_heads=6; use one of [1, 2, 3, 6]"),
    (dict(tp=3), "actor tensor_model_parallel_size=3 does not divide num_key_value_heads=2; use one of [1, 2]"),
    (dict(tp=1, pp=3), "actor pipeline_model_parallel_size=3 does not divide num_hidden_layers=4; use one of [1, 2, 4]"),
    (dict(tp=0), "actor tensor_model_parallel_size=0 must be a positive integer"),
])
def test_layout_refuses_arch_it_cannot_shard_before_any_group(kwargs, message):
    from tripod.parallel.layout import ParallelLayout

    # no torch.distributed here: the arch check must come first, before any process group work
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelLayout(name="actor", arch=_arch(), **kwargs)


def test_unknown_architecture_is_refused(tmp_path):
    from tripod.parallel.arch import arch_from_hf

    cfg = {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model_type='gpt_neox'.*not supported.*\['deepseek_v2', 'deepseek_v3', 'glm4_moe', 'llama', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_moe'\]"):
        arch_from_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        arch_from_hf(tmp_path / "missing")


@pytest.mark.dist
def test_actor_and_critic_layouts_share_one_world(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path, "llama", seed=3)
    out = run_torchrun("actor_critic_layout_worker.py", 4, hf_dir, timeout=300).stdout
    assert out.count("LAYOUT_WORKER_OK") == 4, out[-3000:]
    assert out.count("REFUSED") == 12
    assert "launch 6 processes" in out
    assert out.count("ACTOR_FWD") == 4 and out.count("CRITIC_FWD") == 4  # 2 last-stage ranks x 2 rounds
    norms = re.findall(rf"grad_norm {FLOAT} ref {FLOAT}", out)
    assert len(norms) == 8 and all(abs(float(a) - float(b)) <= 1e-5 * float(b) for a, b in norms)
