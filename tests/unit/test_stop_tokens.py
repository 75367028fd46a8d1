"""What ends a rollout response, before any engine runs: generation_config.json's `eos_token_id` read as HF and vLLM read
it, actor_rollout_ref.rollout.stop_token_ids / stop carried into every step's SamplingParams and every backend's
request, the start-up line naming the ids, and bad settings refused with the key. The engines' stopping itself is
checked in tests/multiprocess/test_rollout.py (embedded, against HF `generate`) and tests/multiprocess/test_vllm.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

from tripod.engine.config import load_config
from tripod.engine.rollout import SamplingParams
from tripod.engine.rollout.factory import describe_stops, engine_kwargs, step_sampling_params, stop_problems
from tripod.engine.rollout.stop_strings import first_stop
from tripod.parallel.arch import arch_from_hf, read_generation_eos

CONFIG = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "eos_token_id": 2}


def _model_dir(tmp_path, generation_config: dict | None):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


@pytest.mark.parametrize("generation_config,expected", [
    (None, ()), ({"bos_token_id": 1}, ()), ({"eos_token_id": 7}, (7,)), ({"eos_token_id": [2, 151, 7]}, (2, 151, 7))])
def test_generation_config_eos_is_read_as_hf_does(tmp_path, generation_config, expected):
    model = _model_dir(tmp_path, generation_config)
    arch = arch_from_hf(model)
    assert arch.generation_eos_token_ids == expected == read_generation_eos(model / "config.json")
    assert arch.eos_token_ids == tuple(sorted({2, *expected}))
    assert SamplingParams(max_new_tokens=1).stop_ids(arch) == {2, *expected}
    assert SamplingParams(max_new_tokens=1, stop_token_ids=[9], ignore_eos=True).stop_ids(arch) == {9}
    assert arch_from_hf(CONFIG).generation_eos_token_ids == ()  # a dict has no directory to look in


def test_a_malformed_generation_config_names_the_file(tmp_path):
    _model_dir(tmp_path, {"eos_token_id": "<|im_end|>"})
    with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id='<\|im_end\|>' must be a token id"):
        arch_from_hf(tmp_path)


def test_config_keys_reach_every_step_and_the_start_line(tmp_path):
    model = _model_dir(tmp_path, {"eos_token_id": [2, 7]})
    cfg = load_config(None, [f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.stop_token_ids=[9]",
                             "actor_rollout_ref.rollout.stop=['</answer>']", "actor_rollout_ref.rollout.name=vllm"])
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.check() == []
    for validate in (False, True):
        params = step_sampling_params(cfg, validate, step=1, gen_batch=0, replica=0)
        assert params.stop_token_ids == (9,) and params.stop == ("</answer>",)
    arch = arch_from_hf(model)
    assert SamplingParams(max_new_tokens=1, stop_token_ids=(9,)).stop_ids(arch) == {2, 7, 9}
    line = describe_stops(arch, rollout)
    assert line.startswith("rollout stops at token ids [2, 7, 9] (config.json eos_token_id: 2; generation_config.json "
                           "eos_token_id: [2, 7]; actor_rollout_ref.rollout.stop_token_ids: [9])"), line
    assert "'</answer>'" in line
    # the tokenizer travels only with stop strings: data.tokenizer, else the model directory
    assert engine_kwargs(cfg, 0, "float32", "cpu", None)["tokenizer"] == str(model)
    cfg.actor_rollout_ref.rollout.name = "embedded"
    assert engine_kwargs(cfg, 0, "float32", "cpu", None)["tokenizer"] == str(model)
    cfg.actor_rollout_ref.rollout.stop = []
    assert "tokenizer" not in engine_kwargs(cfg, 0, "float32", "cpu", None)


def test_bad_stop_settings_name_the_key(tmp_path):
    cfg = load_config(None, ["actor_rollout_ref.rollout.stop_token_ids=[-1]", "actor_rollout_ref.rollout.stop=['']"])
    problems = cfg.actor_rollout_ref.rollout.check()
    assert any("actor_rollout_ref.rollout.stop_token_ids=[-1]" in p for p in problems), problems
    assert any("actor_rollout_ref.rollout.stop=['']" in p for p in problems), problems
    arch = arch_from_hf(CONFIG)
    rollout = dataclasses.replace(cfg.actor_rollout_ref.rollout, stop_token_ids=[5, 300])
    assert stop_problems(arch, rollout) == ["actor_rollout_ref.rollout.stop_token_ids=[5, 300]: [300] outside the "
                                            "model's vocabulary [0, 300); list token ids of this model's tokenizer"]
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        SamplingParams(max_new_tokens=1, stop=("",))


def test_sglang_requests_carry_the_stops():
    from tripod.engine.rollout.sglang_engine import sglang_sampling_params

    arch = dataclasses.replace(arch_from_hf(CONFIG), generation_eos_token_ids=(2, 7))
    req = sglang_sampling_params(SamplingParams(max_new_tokens=4, stop_token_ids=(9,), stop=("</a>",)), arch, 0)
    assert req["stop_token_ids"] == [2, 7, 9] and req["stop"] == ["</a>"] and req["ignore_eos"] is False
    with pytest.raises(ValueError, match="ignore_eos also ignores stop_token_ids"):
        sglang_sampling_params(SamplingParams(max_new_tokens=4, stop_token_ids=(9,), ignore_eos=True), arch, 0)


@pytest.mark.parametrize("text,new_chars,expected", [
    ("abc</a>", 1, "</a>"),        # completed by the last character
    ("abc</a>x", 1, None),         # completed earlier: already reported then, not searched again
    ("a</a>b<stop>", 11, "</a>"),  # two in the new text: the one that ends first
    ("a</a>b<stop>", 6, "<stop>"),  # only where a match can end in the new text
    ("ab</", 2, None),
])
def test_stop_string_search_is_vllms(text, new_chars, expected):
    assert first_stop(text, new_chars, ["<stop>", "</a>"]) == expected
