"""A reward model's arch and table: `*ForSequenceClassification` configs get the `score` row, other label counts and
checkpoints without `score.weight` are refused with one line, and `with_score_head` renames a causal LM's config."""
import json

import pytest
import torch

from tests.helpers.common import make_tiny_hf_model
from tripod.parallel.arch import arch_from_hf, with_score_head
from tripod.parallel.convert import canonical_names, hf_to_megatron, megatron_to_hf


def test_score_row_round_trips_and_replaces_the_lm_head(tmp_path):
    from safetensors.torch import load_file

    hf_dir = make_tiny_hf_model(tmp_path, "llama", sequence_classification=True)
    arch = arch_from_hf(hf_dir)
    assert arch.score_head and not arch.tie_word_embeddings
    state = load_file(f"{hf_dir}/model.safetensors")
    full = hf_to_megatron(arch, state)
    assert full["output_layer.weight"].shape == (1, arch.hidden_size)
    assert torch.equal(full["output_layer.weight"], state["score.weight"])
    back = dict(kv for name, t in full.items() for kv in megatron_to_hf(arch, name, t))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)


def test_more_than_one_label_is_refused(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", sequence_classification=True, num_labels=2)
    with pytest.raises(ValueError, match=r"num_labels=2.*re-save it with num_labels=1"):
        arch_from_hf(hf_dir)


def test_a_classification_checkpoint_without_score_weight_is_refused(tmp_path):
    from safetensors.torch import load_file

    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", sequence_classification=True)
    state = load_file(f"{hf_dir}/model.safetensors")
    del state["score.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): score\.weight"):
        hf_to_megatron(arch_from_hf(hf_dir), state)


def test_with_score_head_renames_a_causal_lm(tmp_path):
    hf_dir = make_tiny_hf_model(tmp_path, "qwen2", tie_word_embeddings=True)
    causal = arch_from_hf(hf_dir)
    rm = with_score_head(causal)
    assert rm.score_head and not rm.tie_word_embeddings and rm.hf_config["architectures"] == [
        "Qwen2ForSequenceClassification"]
    assert causal.hf_config["architectures"] == ["Qwen2ForCausalLM"]  # the original is not touched
    assert "output_layer.weight" in canonical_names(rm) and "output_layer.weight" not in canonical_names(causal)
    assert arch_from_hf(json.loads(json.dumps(rm.hf_config))) == rm  # its config.json reads back as the same arch
